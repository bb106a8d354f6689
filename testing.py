"""A conformance kit for environments (plugin group ``rlpipe.environments``).

`check_environment` builds an environment the way a run does, reads its contract, and drives it
through scripted turns with rlpipe's own `call_env` (plain or ``async def``, each call cut after
the contract's ``timeout_s``). It never raises for the environment's faults: it returns a
`Verdict` whose ``problems`` are one line each, starting with the check's name, and whose
``assert_ok()`` fails a pytest test with all of them. The checks:

- ``contract``, ``build``, ``reset``: the contract is in range, an instance builds, ``reset``
  gives at least one message for every row;
- ``malformed_call``, ``unknown_tool``, ``overlong`` (100,000 characters), ``empty`` (``""``),
  ``final_answer``: one first turn each, answered within the contract (a ``done`` at the first
  turn with no messages is allowed); ``max_turns``: ``max_turns`` turns that call the first
  declared tool (placeholder arguments);
- ``timeout``: ``slow_action`` (a turn that makes the environment's tools slow) is answered
  within ``timeout_s``; past it, rlpipe ends the conversation (skipped without ``slow_action``);
- ``roles``, ``content``, ``json``, ``info``: every message has a known chat role (`ROLES`) and
  text content and is JSON-serialisable; ``info``'s counts are integers;
- ``determinism``: with ``deterministic=True``, the same seed gives the same answers;
- ``pickle``: an instance after ``reset`` and after a step (a tool call) survives pickling, and
  the copy answers the next turn (as the original does, when deterministic);
- ``template``, ``receipts`` (with a ``tokenizer``): the chat template only appends
  (`check_template`), and each scripted conversation, run through rlpipe's turn loop
  (`MultiTurn`) with the scripted turns as the sampled tokens, leaves no ``boundary_drift``
  receipt.

>>> class Mute:
...     def reset(self, row, seed):
...         return []
...     def step(self, action):
...         return [], 0.0, True, {}
>>> verdict = check_environment(Mute)
>>> verdict.ok, verdict.checks
(False, ['contract', 'build'])
>>> print(verdict.problems[0])  # doctest: +ELLIPSIS
reset: plugin ...Mute: reset() returned no messages: the model would have nothing to answer
>>> verdict.assert_ok()  # doctest: +ELLIPSIS
Traceback (most recent call last):
AssertionError: plugin ...Mute: 1 problem(s)
- reset: plugin ...Mute: reset() returned no messages: the model would have nothing to answer
"""

from __future__ import annotations

import copy
import inspect
import json
import pickle
import threading
from dataclasses import dataclass, field

import torch

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError, describe
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.environment import call_env, contract_of, tool_name
from rlpipe.core.step.multiturn import RECEIPTS, MultiTurn, Renderer, check_template

ROLES = ("system", "user", "assistant", "tool")   # the chat roles an environment may write
ROW = {"prompt": "What is 2 + 3?"}                # the dataset row used when none is given
MALFORMED = "<tool_call>{not json</tool_call>"
UNKNOWN = '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>'
SCRIPT = {"malformed_call": MALFORMED, "unknown_tool": UNKNOWN, "overlong": "x" * 100_000,
          "empty": "", "final_answer": "The answer is 42."}   # check name: the first turn
PLACEHOLDERS = {"string": "x", "integer": 1, "number": 1.0, "boolean": True, "array": [],
                "object": {}}                     # a tool argument of each JSON type
COUNTS = ("tool_calls", "tool_errors", "timeouts")   # the counts core sums from ``info``


@dataclass
class Verdict:
    """What `check_environment` found: the checks passed, the problems (one line each, starting
    with the check's name) and the checks not run, with why. True when there is no problem."""

    label: str
    checks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def assert_ok(self) -> None:
        """Raise `AssertionError` listing every problem (for a pytest test); nothing when ok."""
        if self.problems:
            lines = "\n".join(f"- {problem}" for problem in self.problems)
            raise AssertionError(f"{self.label}: {len(self.problems)} problem(s)\n{lines}")


def check_environment(env, args: dict | None = None, *, tokenizer=None, rows: list | None = None,
                      seed: int = 0, slow_action: str | None = None) -> Verdict:
    """Drive ``env`` (an environment class built with the constructor arguments ``args``, an
    instance, copied per conversation as a run does, or the name of an installed one) through
    the scripted turns of the module docstring, resetting with ``rows`` (default: `ROW`) and
    ``seed``; with ``tokenizer`` (one with a chat template), also check the token receipts."""
    kit = _Kit(env, args, rows, seed)
    if not (kit.check("contract", kit.read_contract) and kit.check("build", kit.fresh)
            and kit.check("reset", kit.resets)):
        return kit.verdict
    passed = [name for name, action in SCRIPT.items()
              if kit.check(name, lambda action=action: kit.episode([action]))]
    going = [_tool_turn(kit.contract.tools)] * kit.contract.max_turns
    if kit.check("max_turns", lambda: kit.episode(going)):
        passed.append("max_turns")
    if slow_action is None:
        kit.verdict.skipped.append("timeout: no slow_action given")
    else:
        kit.check("timeout", lambda: kit.episode([slow_action]))
    scripts = [[SCRIPT[name]] if name in SCRIPT else going for name in passed]  # no failure twice
    if not kit.contract.deterministic:
        kit.verdict.skipped.append("determinism: the contract says deterministic=False")
    else:
        kit.check("determinism", lambda: kit.determinism(scripts))
    kit.check("pickle", kit.pickling)
    for name, bad in (("roles", _bad_role), ("content", _bad_content), ("json", _bad_json),
                      ("info", _bad_info)):
        kit.check(name, lambda bad=bad: kit.first_seen(bad))
    if tokenizer is None:
        kit.verdict.skipped.append("template, receipts: no tokenizer given")
    elif kit.check("template", lambda: check_template(
            Renderer(tokenizer, kit.contract.tools), kit.label)):
        kit.check("receipts", lambda: kit.receipts(
            tokenizer, [script[:1] + going[1:] for script in scripts]))
    return kit.verdict


class _Kit:
    """The environment under test, its contract, and what the checks have seen."""

    def __init__(self, env, args: dict | None, rows: list | None, seed: int):
        self.obj = env
        self.label = f"environment {env!r}" if isinstance(env, str) else registry.label_of(env)
        self.args, self.rows, self.seed = dict(args or {}), list(rows or [ROW]), seed
        self.verdict, self.contract = Verdict(self.label), None
        self.seen: list[tuple[str, list, dict]] = []   # (which call, its messages, its info)

    def check(self, name: str, run) -> bool:
        """Run check ``name``: ``run()`` returns a problem line, or nothing when the check
        passes; what it raises is the problem."""
        try:
            problem = run()
        except TimeoutError as exc:
            problem = f"{exc}: rlpipe would end the conversation (stop_reason timeout)"
        except UserError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - anything the environment does is reported
            problem = describe(exc)
        if isinstance(problem, str) and problem:
            self.verdict.problems.append(f"{name}: {' '.join(problem.split())}")
            return False
        self.verdict.checks.append(name)
        return True

    def read_contract(self) -> None:
        """The contract (an installed environment's name: its class, loaded first)."""
        if isinstance(self.obj, str):
            plugin = registry.get("environments", self.obj)
            self.obj, self.label = plugin.obj, plugin.spec.label
            self.verdict.label = self.label
        self.contract = contract_of(self.obj, self.args, self.label)

    def fresh(self):
        """A new instance, as a run makes one per conversation."""
        if inspect.isclass(self.obj):
            return registry.instantiate(self.obj, dict(self.args), None, self.label)
        return copy.deepcopy(self.obj)

    def call(self, method, *args):
        """``call_env`` as the turn loop calls it: in a daemon thread, cut after ``timeout_s``
        (a step that never returns cannot hold the kit); what it returned is remembered."""
        timeout, box = self.contract.timeout_s, []

        def run() -> None:
            try:
                box.append((True, call_env(method, *args, timeout_s=timeout, label=self.label)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                box.append((False, exc))

        thread = threading.Thread(target=run, daemon=True, name="rlpipe-env-kit")
        thread.start()
        thread.join(timeout)
        name = getattr(method, "__name__", "call")
        what = f"{name}({_shown(args[0])})"
        if not box or (not box[0][0] and isinstance(box[0][1], TimeoutError)):  # ours or call_env's
            raise TimeoutError(f"{self.label}: {what} ran past timeout_s ({timeout:g} s)")
        returned, value = box[0]
        if not returned:
            raise value
        self.seen.append((what, value, {}) if name == "reset" else (what, value[0], value[3]))
        return value

    def resets(self) -> None:
        for i, row in enumerate(self.rows):
            self.call(self.fresh().reset, row, self.seed + i)

    def episode(self, actions: list[str]) -> list:
        """A fresh instance reset with the first row and the seed, then the turns ``actions``
        until it says done: its answers."""
        env = self.fresh()
        answers = [self.call(env.reset, self.rows[0], self.seed)]
        for action in actions:
            answers.append(self.call(env.step, action))
            if answers[-1][2]:
                break
        return answers

    def determinism(self, scripts: list[list[str]]) -> str | None:
        """The same seed and turns twice: the same answers, or the first difference."""
        for actions in scripts:
            first, second = self.episode(actions), self.episode(actions)
            if first != second:
                i = next(i for i, pair in enumerate(zip(first + [None], second + [None]))
                         if pair[0] != pair[1])
                what = "reset" if i == 0 else f"step({_shown(actions[i - 1])})"
                return (f"the contract says deterministic=True, but with seed {self.seed} {what} "
                        f"answered otherwise the second time: {_apart(first[i:], second[i:])}")
        return None

    def pickling(self) -> str | None:
        """An instance after reset, then after a step, pickled: the copy answers the next turn
        (the original's answer, when deterministic)."""
        env = self.fresh()
        self.call(env.reset, self.rows[0], self.seed)
        action = _tool_turn(self.contract.tools)
        for when in ("after reset", "after a step"):
            try:
                twin = pickle.loads(pickle.dumps(env))
            except Exception as exc:  # noqa: BLE001 - a lock, a lambda, an open file ...
                return f"{when}: the environment cannot be pickled: {describe(exc)}"
            mine = self.call(env.step, action)
            try:
                theirs = self.call(twin.step, action)
            except (UserError, TimeoutError) as exc:
                return f"{when}: the unpickled copy failed: {exc}"
            if self.contract.deterministic and theirs != mine:
                return (f"{when}: the unpickled copy answered step({_shown(action)}) otherwise "
                        f"than the original: {_apart(theirs, mine)}")
            if mine[2]:
                return None
        return None

    def first_seen(self, bad) -> str | None:
        """The first message (or info) the checks have seen that ``bad`` finds fault with."""
        for what, messages, info in self.seen:
            problem = bad(messages, info)
            if problem:
                return f"{what}: {problem}"
        return None

    def receipts(self, tokenizer, scripts: list[list[str]]) -> str | None:
        """Each script through rlpipe's turn loop, its turns as the sampled tokens: a receipt
        other than ``boundary_drift``."""
        engine = _Scripted(tokenizer)
        loop = MultiTurn(engine, self.fresh, self.contract, tokenizer, 1 << 30, self.label)
        for actions in scripts:
            engine.script = list(actions)
            batch = loop.collect([self.rows[0]], self.seed)
            if RECEIPTS[int(batch[S.ENV, "receipt"][0])] == "boundary_drift":
                roles = [m["role"] for m in batch[S.CONVERSATION][0]]
                return (f"the conversation {roles} (first turn {_shown(actions[0])}), "
                        f"re-rendered by the chat template, differs at a turn boundary from the "
                        f"row rlpipe built turn by turn (boundary_drift)")
        return None


class _Scripted:
    """A stand-in for a collector's engine: each turn it 'samples' the tokens of the script's
    next turn, then its end token."""

    n, device, max_new_tokens = 1, torch.device("cpu"), 1 << 30

    def __init__(self, tokenizer):
        self.tokenizer, self.script = tokenizer, []
        eos = tokenizer.eos_token_id
        self.eos_ids = [eos] if eos is not None else []
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)

    def generate(self, rows, prompt_ids, prompt_mask) -> dict:
        text = self.script.pop(0) if self.script else ""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.eos_ids
        width = max(1, len(ids))
        sampled = torch.tensor([ids + [self.pad_id] * (width - len(ids))] * len(rows))
        mask = torch.tensor([[True] * len(ids) + [False] * (width - len(ids))] * len(rows))
        return {S.RESPONSE_IDS: sampled, S.RESPONSE_MASK: mask, S.ENGINE_LOG_PROB: torch.zeros(
            mask.shape), S.FINISHED: torch.ones(len(rows), dtype=torch.bool)}


def _shown(value) -> str:
    """A short quote of ``value`` for a problem line.

    >>> _shown("x" * 100)
    "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (100 characters)"
    """
    text = value if isinstance(value, str) else str(value)
    return repr(text) if len(text) <= 30 else f"{text[:30]!r}... ({len(text)} characters)"


def _apart(one, two) -> str:
    """Where the texts of two answers part: each quoted from there.

    >>> _apart("turn 1: 41.", "turn 1: 42.")
    "from character 9: '1.' vs '2.'"
    """
    one, two = str(one), str(two)
    at = next((i for i, pair in enumerate(zip(one, two)) if pair[0] != pair[1]),
              min(len(one), len(two)))
    return f"from character {at}: {one[at:at + 30]!r} vs {two[at:at + 30]!r}"


def _tool_turn(tools: tuple) -> str:
    """A turn that calls the first declared tool, a placeholder for each required argument (the
    turn that keeps a tool environment going); with no tool, a turn of plain text.

    >>> _tool_turn(({"type": "function", "function": {"name": "add", "parameters": {
    ...     "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},))
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    """
    if not tools:
        return "Let me think about it."
    tool = _mapping(tools[0].get("function")) or tools[0]
    parameters = _mapping(tool.get("parameters"))
    properties, required = _mapping(parameters.get("properties")), parameters.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    arguments = {name: PLACEHOLDERS.get(_mapping(properties.get(name)).get("type"), "x")
                 for name in names}
    call = json.dumps({"name": tool_name(tools[0]), "arguments": arguments})
    return f"<tool_call>{call}</tool_call>"


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _bad_role(messages: list, info: dict) -> str | None:
    roles = [m["role"] for m in messages if m["role"] not in ROLES]
    return f"the role {roles[0]!r} is not a chat role ({', '.join(ROLES)})" if roles else None


def _bad_content(messages: list, info: dict) -> str | None:
    kinds = [type(m["content"]).__name__ for m in messages if not isinstance(m["content"], str)]
    return f"a message's content must be text, got {kinds[0]}" if kinds else None


def _bad_json(messages: list, info: dict) -> str | None:
    try:
        json.dumps(messages, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"the messages are not JSON-serialisable: {describe(exc)}"
    return None


def _bad_info(messages: list, info: dict) -> str | None:
    wrong = {k: info[k] for k in COUNTS if k in info and (
        isinstance(info[k], bool) or not isinstance(info[k], int) or info[k] < 0)}
    return f"info's counts must be integers >= 0, got {wrong}" if wrong else None
