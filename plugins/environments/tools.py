"""The built-in ``tools`` environment: Python functions as tools the model calls.

Each tool is a function with type hints and a Google-style docstring (its ``Args:`` section
describes each argument): its JSON schema is read from them (`tool_schema`) and goes to the chat
template. On each model turn the environment parses the tool calls (`rlpipe.core.base.toolcalls`,
never ``eval``), runs them at once, one thread each, under ``timeout_s``, and answers with one
``tool`` message per call. Whatever goes wrong comes back to the model as a message that starts
with ``error:`` (an exception, a timeout, a malformed or unknown call), never as a crash; an
output over ``max_output_chars`` is cut with a visible marker. A turn without a tool call is the
final answer: done. The reward is 0 per turn (the reward plugins score the conversation);
``info`` counts ``tool_calls``, ``tool_errors`` and ``timeouts`` (a tool that raises
``TimeoutError`` counts in both).

>>> def add(a: int, b: int) -> int:
...     '''Add two integers.
...
...     Args:
...         a: the first
...         b: the second
...     '''
...     return a + b
>>> env = ToolsEnvironment([add])
>>> env.reset({"prompt": "What is 2 + 3?"}, seed=0)
[{'role': 'user', 'content': 'What is 2 + 3?'}]
>>> env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
([{'role': 'tool', 'name': 'add', 'content': '5'}], 0.0, False, {'tool_calls': 1, 'tool_errors': 0, 'timeouts': 0})
>>> env.step("It is 5.")
([], 0.0, True, {'tool_calls': 0, 'tool_errors': 0, 'timeouts': 0})
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from pathlib import Path

from transformers.utils import get_json_schema

from rlpipe.core.base.errors import UserError, describe
from rlpipe.core.base.toolcalls import ToolCall, parse_tool_calls
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.contracts.references import is_reference


def _load_tool(tool):
    """A tool given as a callable, or as ``module:function`` (imported from the installed
    packages, then from the working directory, as ``python -m`` does)."""
    if callable(tool):
        return tool
    if not is_reference(tool):
        raise UserError(f"environment 'tools': a tool must be a function or 'module:function', "
                        f"got {tool!r}")
    module_name, _, attr = tool.partition(":")
    cwd = str(Path.cwd())
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name.split(".")[0] or cwd in sys.path:
                raise
            sys.path.insert(0, cwd)
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except Exception as exc:  # noqa: BLE001 - user code: one line
        raise UserError(f"environment 'tools': cannot load tool {tool!r}: {describe(exc)}") from exc
    if not callable(fn):
        raise UserError(f"environment 'tools': {tool!r} is not callable")
    return fn


def tool_schema(fn) -> dict:
    """The OpenAI-style JSON schema of a tool, from its type hints and Google docstring
    (`transformers.utils.get_json_schema`); a missing docstring or ``Args:`` entry is one line.

    >>> def lookup(key: str) -> str:
    ...     '''Look a key up in the table.
    ...
    ...     Args:
    ...         key: the key
    ...     '''
    >>> tool_schema(lookup)["function"]["parameters"]
    {'type': 'object', 'properties': {'key': {'type': 'string', 'description': 'the key'}}, 'required': ['key']}
    """
    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise UserError(f"environment 'tools': tool {name}: {exc} (a tool needs type hints and a "
                        f"Google-style docstring with an Args: entry per argument)") from exc


def _tools(tools) -> dict:
    """``{name: function}`` of the tools, each loaded and its name checked to be unique."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, (list, tuple)) or not tools:
        raise UserError(f"environment 'tools': tools must be a non-empty list of functions or "
                        f"'module:function' references, got {tools!r}")
    found = {}
    for tool in tools:
        fn = _load_tool(tool)
        name = tool_schema(fn)["function"]["name"]
        if name in found:
            raise UserError(f"environment 'tools': two tools are named {name!r}")
        found[name] = fn
    return found


def _cut(text: str, cap: int) -> str:
    """``text`` cut to ``cap`` characters, with a marker that says how much was cut.

    >>> _cut("abcdef", 4)
    'abcd\\n[... 2 more characters cut]'
    """
    return text if len(text) <= cap else f"{text[:cap]}\n[... {len(text) - cap} more characters cut]"


def _as_text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError):
        return str(value)


class ToolsEnvironment:
    """Python functions as tools (see the module docstring).

    Args:
        tools: the tools: Python functions, or 'module:function' references
        max_turns: the model's turns per conversation
        timeout_s: the limit on one turn's tool calls, in seconds
        max_output_chars: a tool's output is cut past this many characters (with a marker)
        max_output_tokens: core then cuts each answer past this many tokens of the run's
            tokenizer (with a marker; null: characters only)
        tool_call_format: how the model writes tool calls (hermes: <tool_call>{json}</tool_call>)
    """

    def __init__(self, tools: list, max_turns: int = 4, timeout_s: float = 10.0,
                 max_output_chars: int = 4000, max_output_tokens: int | None = 1024,
                 tool_call_format: str = "hermes"):
        self.declared = self.contract(tools, max_turns, timeout_s, max_output_chars,
                                      max_output_tokens, tool_call_format)
        self.tools = _tools(tools)
        self.max_output_chars, self.timeout_s = max_output_chars, float(timeout_s)

    @classmethod
    def contract(cls, tools: list = (), max_turns: int = 4, timeout_s: float = 10.0,
                 max_output_chars: int = 4000, max_output_tokens: int | None = 1024,
                 tool_call_format: str = "hermes") -> EnvironmentContract:
        """The contract, before any model loads: the tools are loaded and their schemas read;
        values out of range are one line.

        >>> ToolsEnvironment.contract(["json:dumps"], max_turns=0)
        Traceback (most recent call last):
        ...
        rlpipe.core.base.errors.UserError: environment 'tools': max_turns must be an integer >= 1, got 0
        """
        if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int) or (
                max_output_chars < 1):
            raise UserError(f"environment 'tools': max_output_chars must be an integer >= 1, "
                            f"got {max_output_chars!r}")
        contract = EnvironmentContract(max_turns=max_turns, timeout_s=timeout_s,
                                       tool_call_format=tool_call_format, deterministic=False,
                                       max_observation_tokens=max_output_tokens)
        problem = contract.problem()
        if problem:
            raise UserError(f"environment 'tools': {problem}")
        schemas = tuple(tool_schema(fn) for fn in _tools(tools).values())
        # core's limit on a whole step: the tools' timeout_s plus a grace, so that a tool cut at
        # timeout_s comes back to the model as a message instead of ending its conversation
        grace = 1.0 + 0.1 * timeout_s
        return EnvironmentContract(max_turns, schemas, tool_call_format,
                                   float(timeout_s + grace), False, max_output_tokens)

    def reset(self, row: dict, seed: int) -> list[dict]:
        """The row's prompt as messages: ``messages`` (a list of chat messages), or ``prompt``
        (text, or a list of messages)."""
        del seed   # the tools environment draws nothing at random
        prompt = row.get("messages", row.get("prompt"))
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt:
            return [dict(message) for message in prompt]
        raise UserError(f"environment 'tools': a row needs 'prompt' (text or messages) or "
                        f"'messages', got the columns {sorted(row)}")

    def step(self, action: str) -> tuple[list[dict], float, bool, dict]:
        """Run the tool calls of the model's turn ``action``; none (and nothing malformed) is
        the final answer."""
        calls, errors = parse_tool_calls(action, self.declared.tool_call_format)
        info = {"tool_calls": len(calls), "tool_errors": len(errors), "timeouts": 0}
        if not calls and not errors:
            return [], 0.0, True, info
        messages = [{"role": "tool", "content": f"error: {error}"} for error in errors]
        for call, (text, failed, timed_out) in zip(calls, self._run(calls)):
            info["tool_errors"] += failed
            info["timeouts"] += timed_out
            messages.append({"role": "tool", "name": call.name,
                             "content": _cut(text, self.max_output_chars)})
        return messages, 0.0, False, info

    def _run(self, calls: list[ToolCall]) -> list[tuple[str, bool, bool]]:
        """``(output, failed, timed_out)`` per call, the calls run at once: one daemon thread
        each (a hung tool blocks neither the other calls nor the process's exit), all under one
        deadline of ``timeout_s``."""
        results: list = [None] * len(calls)

        def run(i: int, call: ToolCall) -> None:
            try:
                results[i] = (_as_text(self.tools[call.name](**call.arguments)), False, False)
            except Exception as exc:  # noqa: BLE001 - the tool's failure goes to the model
                results[i] = (f"error: {describe(exc)}", True, isinstance(exc, TimeoutError))

        threads = []
        for i, call in enumerate(calls):
            if call.name not in self.tools:
                results[i] = (f"error: unknown tool {call.name!r}; tools: "
                              f"{', '.join(self.tools)}", True, False)
                continue
            thread = threading.Thread(target=run, args=(i, call), daemon=True,
                                      name=f"rlpipe-tool-{call.name}")
            thread.start()
            threads.append((i, thread))
        deadline = time.monotonic() + self.timeout_s
        for i, thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                results[i] = (f"error: timed out after {self.timeout_s:g} s", True, True)
        return results
