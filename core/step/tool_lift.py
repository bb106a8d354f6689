"""The tools disabled: what evaluation compares the tool-using policy against (docs/tool-lift.md).

`ToolsDisabled` wraps any environment: ``reset`` and a turn without a tool call (the final
answer) go to it as they are (plain or ``async def``: the caller's `call_env` runs both); each
tool call of a turn, well-formed or not, is answered ``error: tool unavailable``, the environment
never called. Prompts, tool schemas and budgets stay the run's: only what the tools add is gone.

>>> class Env:
...     def reset(self, row, seed):
...         return [{"role": "user", "content": row["prompt"]}]
...     def step(self, action):
...         raise AssertionError("a tool call reached the environment")
>>> env = ToolsDisabled(Env())
>>> env.step('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call><tool_call>{</tool_call>')
([{'role': 'tool', 'content': 'error: tool unavailable'}, {'role': 'tool', 'name': 'add', 'content': 'error: tool unavailable'}], 0.0, False, {'tool_calls': 1, 'tool_errors': 2})
"""

from __future__ import annotations

from rlpipe.core.base.toolcalls import parse_tool_calls
from rlpipe.core.step.multiturn import MultiTurn

UNAVAILABLE = "error: tool unavailable"


class ToolsDisabled:
    """``env`` with its tools answering `UNAVAILABLE` (calls parsed as ``tool_call_format``)."""

    def __init__(self, env, tool_call_format: str = "hermes"):
        self.env, self.format = env, tool_call_format

    def reset(self, row: dict, seed: int):
        return self.env.reset(row, seed)

    def step(self, action: str):
        calls, errors = parse_tool_calls(action, self.format)
        if not calls and not errors:
            return self.env.step(action)   # the final answer: the environment judges it
        messages = [{"role": "tool", "content": UNAVAILABLE} for _ in errors]  # as `tools` orders them
        messages += [{"role": "tool", "name": c.name, "content": UNAVAILABLE} for c in calls]
        return messages, 0.0, False, {"tool_calls": len(calls), "tool_errors": len(messages)}


def without_tools(turns: MultiTurn) -> MultiTurn:
    """``turns``' conversations (same engine, contract, template and budget) with each fresh
    environment wrapped in `ToolsDisabled`."""
    fmt, make = turns.contract.tool_call_format, turns.make_env
    return MultiTurn(turns.collector, lambda: ToolsDisabled(make(), fmt), turns.contract,
                     turns.render.tokenizer, turns.budget, turns.label, turns.streams)
