"""A safe parser of the tool calls a model writes: ``json.loads`` only, never ``eval``.

Format ``hermes`` (Hermes, Qwen, SmolLM chat templates): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; a turn may hold
several. Whatever the model gets wrong (bad JSON, no name, arguments that are not an object, a
payload over the cap) becomes an entry of ``errors``, one short line that quotes the start of the
offending text, and never an exception: the environment hands it back to the model.

>>> calls, errors = parse_tool_calls('Let me look. <tool_call>\\n{"name": "lookup", '
...                                  '"arguments": {"key": "x"}}\\n</tool_call>')
>>> calls, errors
([ToolCall(name='lookup', arguments={'key': 'x'})], [])
>>> parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')[1]
["tool call 1: 'arguments' must be a JSON object, got list"]
>>> parse_tool_calls("no call here")
([], [])
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from rlpipe.core.base.errors import UserError

FORMATS = ("hermes",)          # the tool-call formats `parse_tool_calls` reads
MAX_CALL_CHARS = 65536         # a call's JSON over this many characters is refused unparsed
MAX_CALLS = 32                 # calls in one turn past this many are refused
_QUOTE = 60                    # characters of the offending text an error quotes

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


class ToolCall(NamedTuple):
    """One parsed call: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict


def _quote(text: str) -> str:
    """The start of ``text`` on one line, for an error message.

    >>> _quote("a  b" + "c" * 100)[:8], len(_quote("c" * 100))
    ("'a bcccc", 65)
    """
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= _QUOTE else flat[:_QUOTE] + "...")


def _one_call(payload: str, number: int) -> ToolCall | str:
    """The call that ``payload`` (the text between the tags) holds, or an error line."""
    where = f"tool call {number}"
    if len(payload) > MAX_CALL_CHARS:
        return f"{where}: {len(payload)} characters, over the cap of {MAX_CALL_CHARS}"
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as exc:   # RecursionError: hostile nesting
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        return f"{where}: not valid JSON ({reason}): {_quote(payload)}"
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where}: 'name' must be a non-empty string, got {_quote(repr(name))}"
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):   # OpenAI's wire form: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return f"{where} ({name}): 'arguments' is a string that is not JSON: {_quote(arguments)}"
    if not isinstance(arguments, dict):
        return f"{where}: 'arguments' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name.strip(), arguments)


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[list[ToolCall], list[str]]:
    """``(calls, errors)`` found in a model's turn ``text``, in order. A ``<tool_call>`` left open at
    the end (a stop string cut the closing tag) is read to the end of the text. An unknown ``fmt``
    is the configuration's mistake: `UserError`.

    >>> parse_tool_calls('<tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b", '
    ...                  '"arguments": "{\\\\"x\\\\": 1}"}')[0]
    [ToolCall(name='a', arguments={}), ToolCall(name='b', arguments={'x': 1})]
    >>> parse_tool_calls("<tool_call>__import__('os').system('ls')</tool_call>")[1]
    ['tool call 1: not valid JSON (Expecting value): "__import__(\\'os\\').system(\\'ls\\')"']
    """
    if fmt not in FORMATS:
        raise UserError(f"tool_call_format {fmt!r} is not known; known: {', '.join(FORMATS)}")
    calls: list[ToolCall] = []
    errors: list[str] = []
    for number, match in enumerate(_HERMES.finditer(text), start=1):
        if number > MAX_CALLS:
            errors.append(f"more than {MAX_CALLS} tool calls in one turn: the rest were ignored")
            break
        parsed = _one_call(match.group(1).strip(), number)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
    return calls, errors
