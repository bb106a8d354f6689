"""The environment conformance kit (`rlpipe.testing.check_environment`): the built-in ``tools``
environment and the third-party example's pass; an environment broken in one way fails that
check alone, with a line naming it."""

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.conftest import CHAT_TEMPLATE, NO_ISOLATION, python_path
from rlpipe.plugin import EnvironmentContract, parse_tool_calls
from rlpipe.plugins.environments.tools import ToolsEnvironment
from rlpipe.testing import SCRIPT, Verdict, check_environment

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "examples" / "tiny" / "model"
WAIT = '<tool_call>{"name": "wait", "arguments": {"seconds": 30}}</tool_call>'
ALL = ["contract", "build", "reset", *SCRIPT, "max_turns", "timeout", "determinism", "pickle",
       "roles", "content", "json", "info", "template", "receipts"]


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny example's tokenizer with a chat template (tests/conftest.py's)."""
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Good:
    """Well-formed: deterministic, picklable, an async step, a ``wait`` tool it cuts itself at
    half its ``timeout_s`` (so a slow tool comes back to the model as a message)."""

    @classmethod
    def contract(cls, max_turns: int = 3):
        tool = {"type": "function", "function": {"name": "wait", "parameters": {}}}
        return EnvironmentContract(max_turns=max_turns, tools=(tool,), timeout_s=1.0,
                                   deterministic=True)

    def __init__(self, max_turns: int = 3):
        self.secret, self.turns = 0, 0

    def reset(self, row, seed):
        self.secret = random.Random(seed).randrange(100)
        return [{"role": "system", "content": "Find the number."},
                {"role": "user", "content": row["prompt"]}]

    async def step(self, action):
        self.turns += 1
        calls, errors = parse_tool_calls(action)
        if not calls and not errors:
            return [], float(str(self.secret) in action), True, {"tool_calls": 0}
        out = [f"error: {e}" for e in errors]
        for call in calls:
            try:
                await asyncio.wait_for(asyncio.sleep(call.arguments.get("seconds", 0)), 0.5)
                out.append(f"turn {self.turns}: {self.secret % 10}")
            except asyncio.TimeoutError:
                out.append("error: wait timed out after 0.5 s")
        return [self.answer(text) for text in out], 0.0, False, {"tool_calls": len(calls)}

    def answer(self, text):
        return {"role": "tool", "content": text}


class ListlessReset(Good):
    def reset(self, row, seed):
        super().reset(row, seed)
        return {"role": "user", "content": row["prompt"]}


class Unseeded(Good):
    def reset(self, row, seed):
        messages = super().reset(row, seed)
        return messages + [{"role": "user", "content": f"Hint: {random.random()}"}]


class HoldsALock(Good):
    def reset(self, row, seed):
        self.lock = threading.Lock()
        return super().reset(row, seed)


class HoldsALambda(Good):
    def reset(self, row, seed):
        self.score = lambda text: len(text)
        return super().reset(row, seed)


class ForgetsOnPickle(Good):
    def __reduce__(self):
        return type(self), ()   # the copy starts over: another secret


class RaisesOnEmpty(Good):
    async def step(self, action):
        if not action:
            raise ValueError("an empty turn")
        return await super().step(action)


class HangsOnEmpty(Good):
    async def step(self, action):
        await asyncio.sleep(0 if action else 60)
        return await super().step(action)


class EvalsCalls(Good):
    async def step(self, action):
        if "<tool_call>" in action:
            json.loads(action.split("<tool_call>")[1].split("</tool_call>")[0])
        return await super().step(action)


class KnowsOnlyItsTools(Good):
    async def step(self, action):
        calls, _ = parse_tool_calls(action)
        {"wait": 1}[calls[0].name] if calls else None
        return await super().step(action)


class ChokesOnLong(Good):
    def step(self, action):
        assert len(action) < 10_000, "too long"
        return asyncio.run(super().step(action))


class SilentFinal(Good):
    async def step(self, action):
        messages, reward, done, info = await super().step(action)
        return messages, reward, done and "answer" not in action, info


class EndsAtTurnTwo(Good):
    async def step(self, action):
        if self.turns == 2:
            raise RuntimeError("no third turn")
        return await super().step(action)


class SleepsInStep(Good):
    def step(self, action):
        time.sleep(2.0 if "seconds" in action else 0)
        return asyncio.run(super().step(action))


class SaysObserver(Good):
    def answer(self, text):
        return {"role": "observer", "content": text}


class NumberContent(Good):
    def answer(self, text):
        return {"role": "tool", "content": {"result": text}}


class RawResult(Good):
    def answer(self, text):
        return {"role": "tool", "content": text, "raw": {text}}


class WordCounts(Good):
    async def step(self, action):
        messages, reward, done, info = await super().step(action)
        return messages, reward, done, {"tool_calls": "one"}


class SystemMidway(Good):
    def answer(self, text):
        return {"role": "system", "content": text}


class NoTurns(Good):
    @classmethod
    def contract(cls, max_turns: int = 3):
        return EnvironmentContract(max_turns=0)


class NeedsAKey(Good):
    def __init__(self, max_turns: int = 3):
        raise KeyError("API_KEY")


HOISTS_SYSTEM = ("{% for m in messages if m['role'] == 'system' %}{{ m['content'] }} {% endfor %}"
                 "{% for m in messages if m['role'] != 'system' %}"
                 "{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")
LAST_TWO = ("{% for m in messages[-2:] %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


def failed(verdict: Verdict) -> list[str]:
    return [problem.split(":")[0] for problem in verdict.problems]


def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def test_the_built_in_tools_environment_passes(tokenizer):
    """Its timeout check included: a hung tool is cut at timeout_s and the answer arrives within
    the contract's limit (a grace above it)."""
    slow = '<tool_call>{"name": "nap", "arguments": {"seconds": 30}}</tool_call>'
    verdict = check_environment(ToolsEnvironment, {"tools": [add, nap], "max_turns": 3,
                                                   "timeout_s": 0.5},
                                tokenizer=tokenizer, slow_action=slow)
    verdict.assert_ok()
    assert verdict and verdict.checks == [c for c in ALL if c != "determinism"]
    assert verdict.skipped == ["determinism: the contract says deterministic=False"]


def test_a_well_formed_environment_passes_every_check(tokenizer):
    verdict = check_environment(Good, tokenizer=tokenizer, slow_action=WAIT,
                                rows=[{"prompt": "Guess."}, {"prompt": "Again."}])
    verdict.assert_ok()
    assert verdict.checks == ALL and verdict.skipped == []
    instance = check_environment(Good(), tokenizer=tokenizer)   # an instance: copied per run
    assert instance.ok and "determinism" in instance.checks


BROKEN = [  # environment, the one check it fails, what its line says
    (ListlessReset, "reset", "reset() must return a list of messages"),
    (Unseeded, "determinism", "deterministic=True, but with seed 0 reset answered"),
    (HoldsALock, "pickle", "after reset: the environment cannot be pickled: TypeError: cannot "
                           "pickle '_thread.lock' object"),
    (HoldsALambda, "pickle", "after reset: the environment cannot be pickled"),
    (ForgetsOnPickle, "pickle", "after reset: the unpickled copy answered step("),
    (RaisesOnEmpty, "empty", "tests.test_env_kit.RaisesOnEmpty failed in step(): ValueError: an "
                             "empty turn"),
    (HangsOnEmpty, "empty", "step('') ran past timeout_s (1 s): rlpipe would end the conversation"),
    (EvalsCalls, "malformed_call", "failed in step(): JSONDecodeError"),
    (KnowsOnlyItsTools, "unknown_tool", "failed in step(): KeyError: 'no_such_tool'"),
    (ChokesOnLong, "overlong", "failed in step(): AssertionError: too long"),
    (SilentFinal, "final_answer", "returned no messages and done=False"),
    (EndsAtTurnTwo, "max_turns", "failed in step(): RuntimeError: no third turn"),
    (SleepsInStep, "timeout", "ran past timeout_s (1 s): rlpipe would end the conversation "
                              "(stop_reason timeout)"),
    (SaysObserver, "roles", "the role 'observer' is not a chat role (system, user, assistant, "
                            "tool)"),
    (NumberContent, "content", "a message's content must be text, got dict"),
    (RawResult, "json", "the messages are not JSON-serialisable: TypeError: Object of type set"),
    (WordCounts, "info", "info's counts must be integers >= 0, got {'tool_calls': 'one'}"),
    (NoTurns, "contract", "contract(): max_turns must be an integer >= 1, got 0"),
    (NeedsAKey, "build", "NeedsAKey failed in __init__: KeyError: 'API_KEY'"),
]


@pytest.mark.parametrize("env, check, says", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_a_broken_environment_fails_the_check_it_breaks(env, check, says):
    verdict = check_environment(env, slow_action=WAIT)
    assert failed(verdict) == [check], verdict.problems
    assert says in verdict.problems[0] and "\n" not in verdict.problems[0], verdict.problems[0]
    with pytest.raises(AssertionError, match=f"1 problem.*\n- {check}: "):
        verdict.assert_ok()


def test_an_unknown_name_is_one_problem():
    verdict = check_environment("no_such_environment")
    assert not verdict and verdict.checks == [] and len(verdict.problems) == 1
    assert verdict.problems[0].startswith(
        "contract: unknown environment plugin 'no_such_environment'; available: tools")


def test_the_token_receipts_and_the_template(tokenizer):
    tokenizer.chat_template = HOISTS_SYSTEM   # puts every system message first
    try:
        assert check_environment(Good, tokenizer=tokenizer).ok   # a system message at the start
        drift = check_environment(SystemMidway, tokenizer=tokenizer)
        assert failed(drift) == ["receipts"] and "(boundary_drift)" in drift.problems[0]
        tokenizer.chat_template = LAST_TWO        # rewrites earlier turns
        refused = check_environment(Good, tokenizer=tokenizer)
        assert failed(refused) == ["template"] and "rewrites earlier turns" in refused.problems[0]
        assert "receipts" not in refused.checks
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE


def test_the_third_party_environment_installed_with_pip_passes(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *NO_ISOLATION,
                    "--target", str(site), str(ROOT / "examples" / "custom_plugin")],
                   check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": python_path(site)}
    env.pop("RLPIPE_DISABLE_PLUGIN_AUTOLOAD", None)
    script = ("import json, sys\n"
              "from transformers import AutoTokenizer\n"
              "from rlpipe.testing import check_environment\n"
              f"tok = AutoTokenizer.from_pretrained({str(TINY_MODEL)!r})\n"
              f"tok.chat_template = {CHAT_TEMPLATE!r}\n"
              "verdict = check_environment('codebook', {'max_turns': 3}, tokenizer=tok)\n"
              "verdict.assert_ok()\n"
              "print(json.dumps([verdict.label, verdict.checks]))\n")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    label, checks = json.loads(run.stdout.splitlines()[-1])
    assert "(rlpipe-example-plugin 0.1.0)" in label
    assert checks == [c for c in ALL if c != "timeout"]
