"""The environment contract and the built-in ``tools`` environment (issue 51): schemas from type
hints and docstrings, a turn's calls run at once, and every failure a message to the model."""

import asyncio
import sys
import threading

import pytest

from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.environment import (EnvironmentContract, StopReason, call_env,
                                               contract_of)
from rlpipe.plugins.environments.tools import ToolsEnvironment, tool_schema

BARRIER = threading.Barrier(2, timeout=20)
RELEASE = threading.Event()


def lookup(key: str, limit: int = 3, exact: bool = True) -> str:
    """Look a key up in the table.

    Args:
        key: the key to find
        limit: at most this many rows
        exact: whole-key matches only
    """
    return f"{key}:{limit}:{exact}"


def meet_a(x: int) -> int:
    """Wait for meet_b: returns only when both run at the same time.

    Args:
        x: a number
    """
    BARRIER.wait()
    return x


def meet_b(x: int) -> int:
    """Wait for meet_a.

    Args:
        x: a number
    """
    BARRIER.wait()
    return -x


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: a number
    """
    raise ValueError(f"bad x {x}")


def hang() -> str:
    """Never answers in time (until the test releases it)."""
    RELEASE.wait(30)
    return "late"


def flood() -> str:
    """Returns 10 MB."""
    return "x" * 10_000_000


def calls(*pairs) -> str:
    return "".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in pairs)


def test_schema_from_type_hints_and_docstring():
    function = tool_schema(lookup)["function"]
    assert function["name"] == "lookup" and function["description"] == "Look a key up in the table."
    assert function["parameters"] == {
        "type": "object", "required": ["key"],
        "properties": {"key": {"type": "string", "description": "the key to find"},
                       "limit": {"type": "integer", "description": "at most this many rows"},
                       "exact": {"type": "boolean", "description": "whole-key matches only"}}}


def test_a_tool_without_a_docstring_is_one_line():
    def bare(x: int):
        return x
    with pytest.raises(UserError, match="tool bare: .*no docstring.*Args: entry per argument"):
        ToolsEnvironment([bare])


def test_the_contract_carries_the_schemas_and_is_checked_before_any_model():
    contract = contract_of(ToolsEnvironment, {"tools": [lookup], "max_turns": 2}, "tools")
    assert contract.max_turns == 2 and contract.tool_call_format == "hermes"
    assert [s["function"]["name"] for s in contract.tools] == ["lookup"]
    with pytest.raises(UserError, match="^environment 'tools': max_turns must be an integer >= 1, got 0$"):
        contract_of(ToolsEnvironment, {"tools": [lookup], "max_turns": 0}, "tools")
    with pytest.raises(UserError, match="timeout_s must be a number > 0"):
        ToolsEnvironment([lookup], timeout_s=-1)


@pytest.mark.parametrize("fields,expected", [
    ({"max_turns": 0}, "max_turns must be an integer >= 1, got 0"),
    ({"timeout_s": -1.0}, "timeout_s must be a number > 0 and finite, got -1.0"),
    ({"tools": ({"type": "function", "function": {"description": "no name"}},)},
     "tools[0]: a tool schema needs a name"),
    ({"tools": ({"name": "a"}, {"name": "a"})}, "tools: the names a are used more than once"),
    ({"tool_call_format": "xml"}, "tool_call_format 'xml' is not known; known: hermes"),
])
def test_contract_problems_are_one_line(fields, expected):
    problem = EnvironmentContract(**fields).problem()
    assert problem.startswith(expected) and "\n" not in problem


def test_stop_reasons_are_the_batchs():
    assert tuple(r.value for r in StopReason) == schema.STOP_REASONS


def test_a_reference_is_resolved(tmp_path, monkeypatch):
    (tmp_path / "my_tools_51.py").write_text(
        "def shout(text: str) -> str:\n    '''Upper-case.\n\n    Args:\n        text: what\n"
        "    '''\n    return text.upper()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    env = ToolsEnvironment(["my_tools_51:shout"])
    assert env.step(calls(("shout", '{"text": "hi"}')))[0][0]["content"] == "HI"
    with pytest.raises(UserError, match="cannot load tool 'my_tools_51:nope'"):
        ToolsEnvironment(["my_tools_51:nope"])


def test_reset_takes_prompt_text_or_messages():
    env = ToolsEnvironment([lookup])
    assert env.reset({"prompt": "hi"}, 0) == [{"role": "user", "content": "hi"}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert env.reset({"messages": messages}, 0) == messages
    with pytest.raises(UserError, match="a row needs 'prompt'"):
        env.reset({"question": "hi"}, 0)


def test_a_turns_calls_run_at_the_same_time():
    env = ToolsEnvironment([meet_a, meet_b], timeout_s=30)
    messages, reward, done, info = env.step(calls(("meet_a", '{"x": 4}'), ("meet_b", '{"x": 5}')))
    assert [m["content"] for m in messages] == ["4", "-5"]   # each waited for the other
    assert (reward, done, info) == (0.0, False, {"tool_calls": 2, "tool_errors": 0, "timeouts": 0})


def test_a_tool_that_raises_is_a_message():
    env = ToolsEnvironment([explode, lookup])
    messages, _, done, info = env.step(calls(("explode", '{"x": 1}'), ("lookup", '{"key": "k"}')))
    assert messages[0] == {"role": "tool", "name": "explode", "content": "error: ValueError: bad x 1"}
    assert messages[1]["content"] == "k:3:True" and not done
    assert info == {"tool_calls": 2, "tool_errors": 1, "timeouts": 0}
    messages, _, _, info = env.step(calls(("lookup", '{"nokey": 1}'), ("nope", "{}")))
    assert messages[0]["content"].startswith("error: TypeError: ")
    assert messages[1]["content"] == "error: unknown tool 'nope'; tools: explode, lookup"
    assert info["tool_errors"] == 2


def test_a_tool_that_hangs_times_out():
    env = ToolsEnvironment([hang, lookup], timeout_s=0.2)
    try:
        messages, _, done, info = env.step(calls(("hang", "{}"), ("lookup", '{"key": "k"}')))
    finally:
        RELEASE.set()
    assert messages[0]["content"] == "error: timed out after 0.2 s" and not done
    assert messages[1]["content"] == "k:3:True"
    assert info == {"tool_calls": 2, "tool_errors": 1, "timeouts": 1}


def test_a_10_mb_output_is_cut_with_a_marker():
    env = ToolsEnvironment([flood], max_output_chars=100)
    content = env.step(calls(("flood", "{}")))[0][0]["content"]
    assert content == "x" * 100 + "\n[... 9999900 more characters cut]"


def test_a_malformed_call_is_an_error_message_and_no_call_is_done():
    env = ToolsEnvironment([lookup])
    messages, _, done, info = env.step('<tool_call>{"name": "lookup", "arguments": {</tool_call>')
    assert len(messages) == 1 and messages[0]["role"] == "tool" and not done
    assert messages[0]["content"].startswith("error: tool call 1: not valid JSON")
    assert info == {"tool_calls": 0, "tool_errors": 1, "timeouts": 0}
    assert env.step("The answer is 4.") == ([], 0.0, True,
                                            {"tool_calls": 0, "tool_errors": 0, "timeouts": 0})


class Silent:
    """A third-party environment that answers nothing."""

    def reset(self, row, seed):
        return []

    async def step(self, action):
        return [], 0.0, False, {}


class Slow:
    async def reset(self, row, seed):
        await asyncio.sleep(30)


def test_an_environment_that_returns_no_messages_is_one_line():
    env = Silent()
    with pytest.raises(UserError, match="reset\\(\\) returned no messages"):
        call_env(env.reset, {}, 0, label="environment 'silent'")
    with pytest.raises(UserError, match="step\\(\\) returned no messages and done=False"):
        call_env(env.step, "hi", label="environment 'silent'")


def test_call_env_runs_async_methods_under_the_timeout():
    with pytest.raises(TimeoutError, match="reset\\(\\) ran past 0.1 s"):
        call_env(Slow().reset, {}, 0, timeout_s=0.1, label="environment 'slow'")
    with pytest.raises(UserError, match="step\\(\\) must return \\(messages, reward, done, info\\)"):
        call_env(Wrong().step, "x", label="environment 'wrong'")
    with pytest.raises(UserError, match="reward must be a finite number, got nan"):
        call_env(Wrong().step, "nan", label="environment 'wrong'")


class Wrong:
    def step(self, action):
        return ([], float(action), True, {}) if action == "nan" else ("text", 1.0)
