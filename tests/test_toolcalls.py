"""The safe tool-call parser: json.loads only; what the model gets wrong is an error entry."""

import builtins
import json

import pytest

from rlpipe.core.base import toolcalls
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.toolcalls import ToolCall, parse_tool_calls


def call(payload: str) -> str:
    return f"<tool_call>{payload}</tool_call>"


def test_whitespace_and_several_calls_in_one_turn():
    text = ("I will call two tools.\n<tool_call>\n  {\"name\": \"a\",\n \"arguments\": {\"x\": 1}}"
            "\n</tool_call>\n\n<tool_call>{\"name\": \" b \", \"arguments\": {}}</tool_call> done")
    assert parse_tool_calls(text) == ([ToolCall("a", {"x": 1}), ToolCall("b", {})], [])


def test_nested_braces_and_tags_inside_strings():
    args = {"q": {"deep": [{"x": "}{"}]}, "s": "a } b { c"}
    calls, errors = parse_tool_calls(call('{"name": "f", "arguments": %s}' % json.dumps(args)))
    assert calls == [ToolCall("f", args)] and errors == []


@pytest.mark.parametrize("payload,expected", [
    ('{"name": "f", "arguments": {"x": 1}', "not valid JSON"),
    ("{'name': 'f'}", "not valid JSON"),
    ('["f", {}]', "expected a JSON object"),
    ('{"arguments": {}}', "'name' must be a non-empty string"),
    ('{"name": 3}', "'name' must be a non-empty string"),
    ('{"name": "f", "arguments": 7}', "'arguments' must be a JSON object, got int"),
    ('{"name": "f", "arguments": "x=1"}', "is a string that is not JSON"),
    ('', "not valid JSON"),
])
def test_malformed_calls_are_error_entries_not_exceptions(payload, expected):
    calls, errors = parse_tool_calls("text " + call(payload) + call('{"name": "ok"}'))
    assert calls == [ToolCall("ok", {})]
    assert len(errors) == 1 and errors[0].startswith("tool call 1") and expected in errors[0]


def test_hostile_input_is_never_evaluated(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the parser evaluated model output")
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    calls, errors = parse_tool_calls(call("__import__('os').system('touch /tmp/pwned')"))
    assert calls == [] and "not valid JSON" in errors[0]
    calls, errors = parse_tool_calls(call('{"name": "__import__(\'os\')", "arguments": {}}'))
    assert calls == [ToolCall("__import__('os')", {})]   # only a name: the environment refuses it


def test_huge_and_deeply_nested_payloads_are_capped():
    huge = '{"name": "f", "arguments": {"x": "' + "a" * (toolcalls.MAX_CALL_CHARS + 1) + '"}}'
    calls, errors = parse_tool_calls(call(huge))
    assert calls == [] and "over the cap" in errors[0] and len(errors[0]) < 200
    deep = "[" * (toolcalls.MAX_CALL_CHARS - 1)   # under the cap, but past the recursion limit
    calls, errors = parse_tool_calls(call(deep))
    assert calls == [] and "not valid JSON" in errors[0] and len(errors[0]) < 200


def test_too_many_calls_in_one_turn():
    calls, errors = parse_tool_calls(call('{"name": "f"}') * (toolcalls.MAX_CALLS + 5))
    assert len(calls) == toolcalls.MAX_CALLS and len(errors) == 1 and "more than" in errors[0]


def test_an_unclosed_last_call_is_read_to_the_end():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 2}}') == (
        [ToolCall("f", {"x": 2})], [])


def test_an_unknown_format_is_one_line():
    with pytest.raises(UserError, match="tool_call_format 'xml' is not known; known: hermes"):
        parse_tool_calls("", fmt="xml")
