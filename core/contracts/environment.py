"""What an environment (plugin group ``rlpipe.environments``) and core agree on.

An environment speaks chat messages only; core owns the token ids, masks, budgets and timeouts:

- ``reset(row: dict, seed: int) -> list[dict]``: the conversation's first messages for a dataset
  row (at least one);
- ``step(action: str) -> (messages, reward: float, done: bool, info: dict)``: the model's turn in,
  the world's answer out (``messages`` may be empty only when ``done``);
- either may be ``async def``: `call_env` calls both kinds, and checks what comes back;
- classmethod ``contract(**args) -> EnvironmentContract``, from the constructor arguments, before
  any model loads (as a collector's, `rlpipe.core.contracts.collector`).

>>> class Echo:
...     def reset(self, row, seed):
...         return [{"role": "user", "content": row["prompt"]}]
...     async def step(self, action):
...         return [{"role": "user", "content": action}], 0.0, action == "bye", {}
>>> env = Echo()
>>> call_env(env.reset, {"prompt": "hi"}, 0)
[{'role': 'user', 'content': 'hi'}]
>>> call_env(env.step, "bye")
([{'role': 'user', 'content': 'bye'}], 0.0, True, {})
>>> EnvironmentContract(max_turns=0).problem()
'max_turns must be an integer >= 1, got 0'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import inspect
import math
import threading
from dataclasses import dataclass

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.toolcalls import FORMATS
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.kinds import declared_contract


class StopReason(str, enum.Enum):
    """Why a trajectory ended (the batch's ``stop_reason``)."""

    DONE = "done"              # the environment said done (a final answer)
    MAX_TURNS = "max_turns"    # the contract's max_turns ran out
    LENGTH = "length"          # the row's token budget (max_response_tokens) ran out
    TOOL_ERROR = "tool_error"  # the environment could not go on after a tool's failure
    TIMEOUT = "timeout"        # the environment's reset or step ran past timeout_s
    TURN_LENGTH = "turn_length"  # one turn ran past the collector's max_new_tokens


def tool_name(schema) -> str | None:
    """A tool schema's name: OpenAI's ``{"type": "function", "function": {"name": ...}}`` or the
    bare ``{"name": ...}``; None when it has none.

    >>> tool_name({"type": "function", "function": {"name": "lookup"}}), tool_name({"x": 1})
    ('lookup', None)
    """
    if not isinstance(schema, dict):
        return None
    name = (schema.get("function") if isinstance(schema.get("function"), dict) else schema).get("name")
    return name if isinstance(name, str) and name else None


@dataclass(frozen=True)
class EnvironmentContract:
    """What an environment declares about itself (defaults: four turns, no tools)."""

    max_turns: int = 4                 # model turns per trajectory, at least 1
    tools: tuple = ()                  # the tools' JSON schemas (OpenAI function format), for
                                       # the chat template's ``tools=``
    tool_call_format: str = "hermes"   # how the model writes calls (`rlpipe.core.base.toolcalls`)
    timeout_s: float = 30.0            # core's limit on one reset or step, in seconds
    deterministic: bool = False        # the same seed and actions give the same messages
    max_observation_tokens: int | None = None   # core cuts a longer message (run's tokenizer)

    def problem(self) -> str | None:
        """What is wrong with these values, or None.

        >>> EnvironmentContract(tools=({"type": "function", "function": {}},)).problem()
        'tools[0]: a tool schema needs a name, got {"type": "function", "function": {}}'
        """
        turns = self.max_turns
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            return f"max_turns must be an integer >= 1, got {turns!r}"
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                0 < timeout < math.inf):
            return f"timeout_s must be a number > 0 and finite, got {timeout!r}"
        if self.tool_call_format not in FORMATS:
            return (f"tool_call_format {self.tool_call_format!r} is not known; known: "
                    f"{', '.join(FORMATS)}")
        if not isinstance(self.tools, tuple):
            return f"tools must be a tuple of JSON schemas, got {type(self.tools).__name__}"
        names = [tool_name(schema) for schema in self.tools]
        for i, (schema, name) in enumerate(zip(self.tools, names)):
            if name is None:
                shown = str(schema).replace("'", '"')
                return f"tools[{i}]: a tool schema needs a name, got {shown[:80]}"
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            return f"tools: the names {', '.join(twice)} are used more than once"
        if not isinstance(self.deterministic, bool):
            return f"deterministic must be true or false, got {self.deterministic!r}"
        cap = self.max_observation_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            return f"max_observation_tokens must be an integer >= 1 or null, got {cap!r}"
        return None


def cut_messages(messages: list, cap: int | None, tokenizer) -> list:
    """Each text content of ``messages`` past ``cap`` tokens (``tokenizer.encode`` and
    ``decode``: the run's) cut, with a marker that says how many went.

    >>> import types; words = types.SimpleNamespace(encode=str.split, decode=" ".join)
    >>> cut_messages([{"role": "tool", "content": "a b c d e"}], 2, words)
    [{'role': 'tool', 'content': 'a b\\n[... 3 more tokens cut]'}]
    """
    ids = [tokenizer.encode(m["content"]) if cap and isinstance(m["content"], str) else ()
           for m in messages]
    return [{**m, "content": f"{tokenizer.decode(i[:cap])}\n[... {len(i) - cap} more tokens cut]"}
            if cap and len(i) > cap else m for m, i in zip(messages, ids)]


def contract_of(environment, args: dict, label: str) -> EnvironmentContract:
    """The contract ``environment`` (a class or an instance) declares for constructor arguments
    ``args`` (no ``contract``: `EnvironmentContract`'s defaults); what ``contract`` raises, a
    return of the wrong type, or values out of range is one line naming ``label``."""
    declare = getattr(environment, "contract", None)
    return declared_contract(declare, args, label, EnvironmentContract)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """One event loop in a daemon thread for every async environment of the process, so an
    environment's coroutines all run on the loop that created its state."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="rlpipe-environments",
                             daemon=True).start()
        return _LOOP


def _messages(value, label: str, what: str) -> list[dict]:
    if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in value):
        raise UserError(f"{label}: {what} must return a list of messages "
                        f"({{'role': ..., 'content': ...}}), got {str(value)[:80]}")
    return value


def call_env(method, *args, timeout_s: float | None = None, label: str | None = None):
    """``method(*args)`` of an environment, plain or ``async def`` (then run on one shared event
    loop, and cut after ``timeout_s``: `TimeoutError`), its answer checked: ``reset`` must return
    at least one message, ``step`` a ``(messages, reward, done, info)`` whose messages are empty
    only when done. What the method raises, or returns wrong, is one line naming the plugin."""
    label = label or registry.label_of(method)
    what = f"{getattr(method, '__name__', 'call')}()"
    timed_out = False
    with registry.calling(label, what):
        result = method(*args)
        if inspect.isawaitable(result):
            future = asyncio.run_coroutine_threadsafe(_awaited(result), _loop())
            try:
                result = future.result(timeout_s)
            except concurrent.futures.TimeoutError:
                timed_out = future.cancel() or True
    if timed_out:   # not the plugin's failure: the caller ends the row (StopReason.TIMEOUT)
        raise TimeoutError(f"{label}: {what} ran past {timeout_s} s")
    if what == "reset()":
        if not _messages(result, label, what):
            raise UserError(f"{label}: reset() returned no messages: the model would have "
                            f"nothing to answer")
        return result
    if not (isinstance(result, tuple) and len(result) == 4):
        raise UserError(f"{label}: {what} must return (messages, reward, done, info), got "
                        f"{str(result)[:80]}")
    messages, reward, done, info = result
    _messages(messages, label, what)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise UserError(f"{label}: {what}: reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool) or not isinstance(info, dict):
        raise UserError(f"{label}: {what}: done must be a bool and info a dict, got "
                        f"{done!r}, {type(info).__name__}")
    if not messages and not done:
        raise UserError(f"{label}: {what} returned no messages and done=False: the model "
                        f"would have nothing new to answer")
    return messages, float(reward), done, info


async def _awaited(awaitable):
    return await awaitable
