"""``rlpipe replay RUN_DIR --step N --sample I``: one conversation of a run's tool-call journal,
run again live, for debugging or as a golden test of an environment (docs/replay.md).

The environment is rebuilt from the run's ``config.yaml``; ``reset`` gets the recorded row and
seed, then ``step`` each recorded action, in order. Each live result goes through the journal's
JSON round trip and is compared with the recorded one (status, messages, reward, done, info):
`replay` returns the conversation's lines (``role: content``, one per message) and the first
difference, or None when every call matches.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.plan import plan_run
from rlpipe.core.config.settings import load_config
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.environment import call_env
from rlpipe.core.step.journal import FILE, FOLDER, Journal, read

FIELDS = {"reset": ("messages",), "step": ("messages", "reward", "done", "info")}


def calls_of(run_dir: Path, step: int, sample: int) -> list[dict]:
    """The recorded calls of conversation ``sample`` of step ``step``, in order; what is missing
    is one line."""
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not an rlpipe run directory (no config.yaml)")
    path = Journal(run_dir / FOLDER).path(step)
    if not path.is_file():
        steps = sorted(int(m[1]) for p in (run_dir / FOLDER).glob("step_*.jsonl")
                       if (m := FILE.fullmatch(p.name)))
        raise UserError(f"{run_dir} has no journal of step {step} (journaled steps: "
                        f"{', '.join(map(str, steps)) or 'none'})")
    entries = read(path)
    calls = [entries[key] for key in sorted(entries) if key[0] == sample]
    if not calls or calls[0]["method"] != "reset":
        count = len({key[0] for key in entries})
        raise UserError(f"step {step}'s journal has no conversation {sample} (samples 0-{count - 1})")
    return calls


def _live(env, method: str, args: list, timeout_s: float, label: str) -> tuple[str, object]:
    """``(status, result)`` of one live call, as the journal writes them; cut at ``timeout_s``."""
    out = {}

    def run() -> None:
        try:
            out["call"] = ("ok", call_env(getattr(env, method), *args, timeout_s=timeout_s,
                                          label=label))
        except TimeoutError:
            out["call"] = ("timeout", None)
        except UserError as err:
            out["call"] = (f"error: {err}", None)

    thread = threading.Thread(target=run, daemon=True, name="rlpipe-replay")
    thread.start()
    thread.join(timeout_s)
    status, result = out.get("call", ("timeout", None))
    return status, json.loads(json.dumps(result, default=repr))


def _short(value) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 200 else text[:200] + "..."


def difference(call: int, method: str, recorded: dict, status: str, result) -> str | None:
    """What differs between a recorded call and its live run (None: nothing)."""
    if recorded["status"] != status:
        return f"call {call} ({method}): status recorded {recorded['status']!r}, live {status!r}"
    want, got = recorded["result"], result
    if method == "reset":
        want, got = [want], [got]
    for name, a, b in zip(FIELDS[method], want or (), got or ()):
        if a != b:
            return f"call {call} ({method}): {name} recorded {_short(a)}, live {_short(b)}"
    return None


def _lines(messages) -> list[str]:
    return [f"{m.get('role')}: {str(m.get('content')).replace(chr(10), ' / ')}"
            for m in messages or ()]


def replay(run_dir: Path, step: int, sample: int) -> tuple[list[str], str | None]:
    """The conversation's lines, and the first difference from the journal (None: same)."""
    run_dir = Path(run_dir)
    calls = calls_of(run_dir, step, sample)
    plan = plan_run(load_config(run_dir / "config.yaml"))
    stage = plan.environment
    if stage is None:
        raise UserError(f"{run_dir}'s config has no environment section")
    env = registry.instantiate(stage.plugin.obj, dict(stage.args), RunContext(), stage.label)
    lines, first = [], None
    for entry in calls:
        method, args = entry["method"], entry["args"]
        if method == "step":
            lines += _lines([{"role": "assistant", "content": args[0]}])
        status, result = _live(env, method, args, plan.environment_contract.timeout_s, stage.label)
        lines += _lines(result if method == "reset" else (result or [None])[0])
        if status != "ok":
            lines.append(f"({status})")
        first = first or difference(entry["key"][1], method, entry, status, result)
    return lines, first
