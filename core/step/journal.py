"""The tool-call journal: every ``reset`` and ``step`` of a training step's environments, on disk
as each completes, so that a resumed step replays the recorded results instead of calling the
environment again (docs/replay.md).

``RUN_DIR/journal/step_N.jsonl`` holds one JSON line per call: its key ``[conversation, call]``
(the conversation's index in the step, counted across the step's collections; call 0 is
``reset``, call t + 1 the step of turn t), the method and its arguments with their sha256, the
status (``ok``, ``timeout``, ``error: TEXT``), the result, the latency and the environment's
state after the call (a base64 pickle; null when it cannot be pickled). A call whose key and
arguments match a recorded one returns the recorded result and leaves the environment as the
recorded state; other arguments (the run diverged) call the environment live.

>>> import tempfile
>>> from types import SimpleNamespace as Env
>>> journal = Journal(Path(tempfile.mkdtemp()))
>>> journal.begin(1, 2)
0
>>> journal.record((0, 1), "step", ["hi"], "ok", [[], 1.0, True, {}], 0.01, Env(n=5))
>>> again = Journal(journal.folder)   # the resumed run
>>> again.begin(1, 2)
0
>>> status, result, restored = again.replay((0, 1), "step", ["hi"], Env(n=0))
>>> status, result, restored.n, again.counts
('ok', [[], 1.0, True, {}], 5, {'replayed': 1, 'diverged': 0})
>>> again.replay((0, 1), "step", ["bye"], Env(n=0)), again.counts["diverged"]
(None, 1)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import re
import sys
import threading
from pathlib import Path

FOLDER = "journal"
FILE = re.compile(r"step_(\d+)(\.rank\d+)?\.jsonl")


def digest(method: str, args: list) -> str:
    """The sha256 of a call's method and arguments (their JSON; `repr` for what JSON lacks)."""
    text = json.dumps([method, args], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def read(path: Path) -> dict[tuple[int, int], dict]:
    """The entries of a journal file by key, the last one of a key winning; a line cut by a
    kill is skipped."""
    entries = {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else ():
        try:
            entry = json.loads(line)
            entries[tuple(entry["key"])] = entry
        except (ValueError, KeyError, TypeError):
            continue
    return entries


class Journal:
    """The journal of one run (``folder``: ``RUN_DIR/journal``; ``rank``: this process's file).
    Thread-safe: the environments of one turn answer in threads."""

    def __init__(self, folder: Path, rank: int = 0):
        self.folder, self.rank = Path(folder), rank
        self.lock = threading.Lock()
        self.step, self.next, self.recorded, self.file, self.cut = None, 0, {}, None, set()
        self.behind: dict[int, list] = {}   # conversation -> calls replayed without a state
        self.counts = {"replayed": 0, "diverged": 0}
        self.warned = False

    def path(self, step: int) -> Path:
        return self.folder / (f"step_{step}.jsonl" if self.rank == 0 else
                              f"step_{step}.rank{self.rank}.jsonl")

    def begin(self, step: int, size: int) -> int:
        """Start ``size`` conversations of step ``step``; returns the first one's index (a step's
        collections continue the count: dynamic sampling's rounds)."""
        if step != self.step:
            self.close()
            path = self.path(step)
            self.step, self.next, self.recorded, self.behind = step, 0, read(path), {}
            self.cut: set = set()   # calls cut at their deadline: what completes later is not theirs
            self.counts = {"replayed": 0, "diverged": 0}   # this step's
            self.folder.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")
            if self.file.tell() and not path.read_bytes().endswith(b"\n"):
                self.file.write("\n")   # after a line cut by a kill
        base, self.next = self.next, self.next + size
        return base

    def replay(self, key: tuple[int, int], method: str, args: list, env):
        """``(status, result, env)`` recorded for this call (``env``: the recorded state, or the
        environment given when none was recorded), or None: call it live."""
        with self.lock:
            entry = self.recorded.get(key)
            if entry is None:
                return None
            if entry["sha256"] != digest(method, args):
                self.counts["diverged"] += 1
                return None
            self.counts["replayed"] += 1
            if entry["state"] is None:   # the live call that follows must catch up first
                self.behind.setdefault(key[0], []).append((method, args))
            else:
                self.behind.pop(key[0], None)
                env = pickle.loads(base64.b64decode(entry["state"]))
        return entry["status"], entry["result"], env

    def catch_up(self, conversation: int) -> list:
        """The calls replayed on an environment without a recorded state, to be made live again
        before the conversation's next live call."""
        with self.lock:
            return self.behind.pop(conversation, [])

    def record(self, key: tuple[int, int], method: str, args: list, status: str, result,
               latency: float, env) -> None:
        """Append one completed call, flushed and fsynced: a kill after it keeps it. A timeout
        is final: the call's own late completion is not recorded."""
        entry = {"key": list(key), "method": method, "args": args,
                 "sha256": digest(method, args), "status": status, "result": result,
                 "latency_s": round(latency, 6), "state": self._state(env) if status == "ok" else None}
        line = json.dumps(entry, default=repr) + "\n"
        with self.lock:
            if key in self.cut:
                return
            if status == "timeout":
                self.cut.add(key)
            self.file.write(line)
            self.file.flush()
            os.fsync(self.file.fileno())

    def _state(self, env) -> str | None:
        try:
            return base64.b64encode(pickle.dumps(env)).decode()
        except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
            if not self.warned:
                self.warned = True
                print(f"warning: the journal cannot pickle the environment ({type(exc).__name__}: "
                      f"{exc}); on resume only its conversations whose calls are all recorded "
                      f"replay, the others run again from their reset (docs/replay.md)",
                      file=sys.stderr)
            return None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def prune(run_dir: Path, upto: int) -> None:
    """Delete the journals of steps up to ``upto`` (a resume never restarts them: the oldest
    kept checkpoint is at ``upto``); only rlpipe's own file names."""
    folder = Path(run_dir) / FOLDER
    for path in folder.iterdir() if folder.is_dir() else ():
        found = FILE.fullmatch(path.name)
        if found and int(found[1]) <= upto and path.is_file() and not path.is_symlink():
            path.unlink()
