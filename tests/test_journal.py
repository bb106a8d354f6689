"""Issue 55: the tool-call journal (`rlpipe.core.step.journal`) and ``rlpipe replay``.

A tiny multi-turn run whose every model turn calls a counting tool (a side effect: each call is
logged in `CALLS`; the test process outlives the simulated kill) is killed at each point of step
2 (after a reset, after turn 0's first tool call, mid-turn 1, after collection before the update,
after the update before the checkpoint), resumed, and compared with an uninterrupted run: the
same final weights (``torch.equal``), the same metric rows (apart from ``time/``, ``perf/``,
``env/journal/``), and the tool called exactly as often, with the same arguments in the same order
per conversation. Kills raise `Killed` as in tests/test_resume_faults.py. A scripted engine (as in
tests/test_multiturn.py) covers a timeout's replay and an environment that cannot be pickled.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.journal import Journal, read
from rlpipe.core.step.multiturn import MultiTurn
from rlpipe.core.step.update import Updater
from rlpipe.plugins.environments.tools import ToolsEnvironment
from tests.conftest import CHAT_TEMPLATE, final_weights, logged_metrics
from tests.test_multiturn import CALL, ScriptedEngine, add, chatml_tokenizer
from tests.test_resume_faults import Killed, after_row

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny"
CALLS: list = []      # (conversation's seed, the model's turn) of every call of `count`: its world
DRIFT = {"by": 0}      # added to `count`'s answer: a tool that answers otherwise than it did


def count(conv: int, text: str) -> str:
    """Count the words of a turn and repeat it once per call so far with these arguments: each
    call is logged, and a call made again answers otherwise (as a database write would).

    Args:
        conv: the conversation's seed
        text: the model's turn
    """
    times = CALLS.count((conv, text)) + 1
    CALLS.append((conv, text))
    return f"{len(text.split()) + DRIFT['by']} " + " ".join([text.strip()] * times)


class Counting(ToolsEnvironment):
    """The tools environment with `count`: every model turn is a call of it (the tiny model
    cannot write a tool call itself)."""

    @classmethod
    def contract(cls, tools=(), max_turns: int = 3, *rest):   # also ToolsEnvironment.__init__'s call
        return ToolsEnvironment.contract([count], max_turns=max_turns, timeout_s=10.0)

    def __init__(self, max_turns: int = 3):
        super().__init__([count], max_turns=max_turns, timeout_s=10.0)

    def reset(self, row, seed):
        self.seed = seed
        return super().reset(row, seed)

    def step(self, action):
        call = json.dumps({"name": "count", "arguments": {"conv": self.seed, "text": action}})
        return super().step(f"<tool_call>{call}</tool_call>")


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny example's model with a chat template."""
    out = tmp_path_factory.mktemp("model") / "model"
    shutil.copytree(TINY / "model", out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def train(model, run_dir, resume=False) -> Path:
    cfg = load_config(TINY / "config.yaml", [
        f"models.actor.path={model}", f"run.output_dir={run_dir}", "run.steps=3",
        "data.batch_size=2", "collector.max_new_tokens=12", "collector.max_prompt_tokens=64",
        "train.epochs=1", "checkpoint.every=1", "checkpoint.keep=3", "log.progress=false",
        "environment.name=tests.test_journal:Counting"])
    return Pipeline(cfg, progress=False, resume=resume).train()


def per_conversation(calls) -> dict:
    grouped = defaultdict(list)
    for conv, text in calls:
        grouped[conv].append(text)
    return dict(grouped)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> tuple[Path, dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        CALLS.clear()
        run_dir = train(model, tmp_path_factory.mktemp("reference") / "run")
        return run_dir, per_conversation(CALLS)
    finally:
        torch.set_num_threads(threads)


def at_call(call: int, conversation: int | None = None):
    """Killed right after step 2's journal recorded call ``call`` (0: reset, t + 1: turn t's
    step) of ``conversation`` (None: the first conversation to get there)."""
    def install(mp):
        real = Journal.record

        def record(self, key, *args):
            real(self, key, *args)
            if self.step == 2 and key[1] == call and conversation in (None, key[0]):
                raise Killed
        mp.setattr(Journal, "record", record)
    return install


def before_update(mp):
    """Step 2 collected and scored, its update not begun."""
    real, seen = Updater.update, []

    def update(self, *args, **kwargs):
        seen.append(1)
        if len(seen) == 2:
            raise Killed
        return real(self, *args, **kwargs)
    mp.setattr(Updater, "update", update)


KILLS = {
    "after-a-reset": at_call(0, conversation=2),
    "after-turn-0s-first-call": at_call(1),
    "mid-turn-1": at_call(2),
    "before-the-update": before_update,
    "after-the-update-before-the-checkpoint": after_row(2),
}


def raw_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("point", KILLS)
def test_a_resumed_step_replays_its_tool_calls(point, model, tmp_path, reference):
    ref_dir, ref_calls = reference
    assert sum(map(len, ref_calls.values())) >= 8, ref_calls   # the tool is really called
    run_dir = tmp_path / "run"
    CALLS.clear()
    with pytest.MonkeyPatch.context() as mp:
        KILLS[point](mp)
        with pytest.raises(Killed):
            train(model, run_dir)
    train(model, run_dir, resume=True)
    wa, wb = final_weights(run_dir), final_weights(ref_dir)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    def comparable(rows):
        return [{k: v for k, v in row.items() if not k.startswith("env/journal/")} for row in rows]
    assert comparable(logged_metrics(run_dir)) == comparable(logged_metrics(ref_dir))
    assert per_conversation(CALLS) == ref_calls   # each call once, same arguments, same order
    step2 = raw_rows(run_dir)[1]
    assert step2["step"] == 2 and step2["env/journal/replayed"] > 0
    assert step2["env/journal/diverged"] == 0
    assert raw_rows(ref_dir)[1]["env/journal/replayed"] == 0


def test_pruned_with_the_checkpoints(model, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(TINY / "config.yaml", [
        f"models.actor.path={model}", f"run.output_dir={run_dir}", "run.steps=3",
        "data.batch_size=2", "collector.max_new_tokens=4", "train.epochs=1", "checkpoint.every=1",
        "checkpoint.keep=2", "log.progress=false", "environment.name=tests.test_journal:Counting",
        "environment.max_turns=1"])
    Pipeline(cfg, progress=False).train()
    # the oldest kept checkpoint is step 2: a resume never runs steps 1-2 again
    assert sorted(p.name for p in (run_dir / "journal").iterdir()) == ["step_3.jsonl"]


# ---- rlpipe replay ---------------------------------------------------------------------------

def replay(*args):
    return CliRunner().invoke(main, ["replay", *map(str, args)])


def with_tool_call(run_dir) -> int:
    """A conversation of step 2 with a tool call."""
    return min(key[0] for key in read(run_dir / "journal" / "step_2.jsonl") if key[1] == 1)


def test_replay_reruns_a_conversation_and_finds_it_the_same(reference):
    run_dir, _ = reference
    CALLS.clear()   # the tool's world as it was before the run
    result = replay(run_dir, "--step", 2, "--sample", with_tool_call(run_dir))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("user: ") and any(line.startswith("tool: ") for line in lines)
    assert lines[-1].startswith("same:")


def test_replay_says_where_an_environment_answers_otherwise(reference, monkeypatch):
    run_dir, _ = reference
    CALLS.clear()
    monkeypatch.setitem(DRIFT, "by", 1000)
    result = replay(run_dir, "--step", 2, "--sample", with_tool_call(run_dir))
    assert result.exit_code == 1
    assert result.stderr.startswith("differs: call 1 (step): messages recorded")


@pytest.mark.parametrize("args, says", [
    (("--step", 2, "--sample", 99), "no conversation 99"),
    (("--step", 99, "--sample", 0), "no journal of step 99"),
])
def test_replay_of_something_missing_is_one_line(reference, args, says, tmp_path):
    run_dir, _ = reference
    for target, message in ((run_dir, says), (tmp_path / "nowhere", "not an rlpipe run")):
        result = replay(target, *args)
        assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
        assert message in result.stderr


# ---- the journal inside MultiTurn, with a scripted engine ---------------------------------------

def collect(env, contract, replies, journal) -> tuple:
    tok = chatml_tokenizer()
    engine = ScriptedEngine(tok, replies)
    prompt = "What is 2 + 3?"
    engine.starts = [tok(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                 tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]]
    turns = MultiTurn(engine, env, contract, tok, 200)
    turns.journal = journal
    return turns.collect([{"prompt": prompt}], 0, step=1), journal.counts


class Slow:
    """Sleeps past the timeout on each step; counts its steps."""
    steps = 0

    def reset(self, row, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        Slow.steps += 1
        time.sleep(1.0)
        return [{"role": "tool", "content": "late"}], 0.0, False, {}


def test_a_recorded_timeout_replays_as_a_timeout(tmp_path):
    contract = EnvironmentContract(max_turns=2, timeout_s=0.2)
    batch, _ = collect(Slow, contract, [[CALL, CALL]], Journal(tmp_path))
    time.sleep(1.0)   # the late step completes: it must not be recorded as the call's result
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "timeout" and Slow.steps == 1
    assert [e["status"] for e in read(tmp_path / "step_1.jsonl").values()] == ["ok", "timeout"]
    again, counts = collect(Slow, contract, [[CALL, CALL]], Journal(tmp_path))
    assert Slow.steps == 1 and counts["replayed"] == 2   # not called again
    assert S.STOP_REASONS[int(again[S.STOP_REASON][0])] == "timeout"


class Unpicklable(ToolsEnvironment):
    """The tools environment holding a lock (cannot be pickled); logs its calls."""
    log: list = []

    def __init__(self):
        super().__init__([add])
        self.lock = threading.Lock()

    def reset(self, row, seed):
        Unpicklable.log.append("reset")
        return super().reset(row, seed)

    def step(self, action):
        Unpicklable.log.append("step")
        return super().step(action)


def test_an_environment_without_state_replays_whole_conversations_only(tmp_path, capsys):
    replies = [[CALL, CALL, "It is 5."]]
    contract = EnvironmentContract(max_turns=4)
    first, _ = collect(Unpicklable, contract, replies, Journal(tmp_path))
    assert "cannot pickle" in capsys.readouterr().err
    assert Unpicklable.log == ["reset", "step", "step", "step"]
    Unpicklable.log.clear()
    again, counts = collect(Unpicklable, contract, replies, Journal(tmp_path))
    assert Unpicklable.log == [] and counts["replayed"] == 4    # recorded whole: replayed whole
    path = tmp_path / "step_1.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # reset, 1st step
    again, counts = collect(Unpicklable, contract, replies, Journal(tmp_path))
    # the replayed prefix is made live again before the first unrecorded call
    assert Unpicklable.log == ["reset", "step", "step", "step"] and counts["replayed"] == 2
    assert again[S.CONVERSATION][0] == first[S.CONVERSATION][0]


class Tally:
    """Keeps its step count in its own state (picklable) and pays it as the turn's reward."""
    calls = 0   # real calls, over every instance

    def reset(self, row, seed):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        Tally.calls, self.n = Tally.calls + 1, self.n + 1
        return [{"role": "tool", "content": f"n={self.n}"}], float(self.n), "5" in action, {}


def test_a_diverged_call_runs_live_on_the_recorded_state(tmp_path):
    contract = EnvironmentContract(max_turns=4)
    first, _ = collect(Tally, contract, [[CALL, CALL, "It is 5."]], Journal(tmp_path))
    assert Tally.calls == 3 and first[S.TURN_REWARD][0][:3].tolist() == [1.0, 2.0, 3.0]
    again, counts = collect(Tally, contract, [[CALL, "It is 5."]], Journal(tmp_path))
    assert counts == {"replayed": 2, "diverged": 1} and Tally.calls == 4
    assert again[S.TURN_REWARD][0][:2].tolist() == [1.0, 2.0]   # n = 1 restored, then live
