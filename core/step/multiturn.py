"""Multi-turn rollouts: the policy and an environment take turns, token in, token out.

Core owns the token ids. Each row is the prompt's rendering, then per turn the ids the engine
sampled (the *action*, ``action_mask`` True) and the chat template's rendering of the
environment's answer (the *observation*: response tokens the policy did not choose). What the
model sampled is never re-tokenised: the next turn's engine prompt is the row built so far. An
observation is the template's diff: the text the template adds to the conversation for the new
messages, after what the model already wrote (its EOS included), so a separator the template
puts after the assistant turn is kept, not dropped.

Each row leaves a *receipt*: the final conversation re-rendered by the template and compared
with the row's text outside the actions: ``exact``, ``assistant_drift`` (the template renders
the model's words differently from its sampled ids: harmless, the trainer scores the sampled
ids) or ``boundary_drift`` (a turn boundary differs: a real bug). A template that rewrites
earlier turns when one is appended is refused at start (`check_template`).

>>> def render(messages, generation_prompt):  # a ChatML-like template; "|" ends a turn (EOS)
...     text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
...     return text + ("<assistant>" if generation_prompt else "")
>>> chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
...         {"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]
>>> row = [("text", "<user>hi|<assistant>"), ("action", "yo", True, True),
...        ("text", "<tool>42|<assistant>"), ("action", "ok", True, True)]
>>> receipt(render, chat, row, "|")
'exact'
>>> receipt(render, chat, row[:3] + [("action", "ok", True, False)], "|")  # ids re-encode otherwise
'assistant_drift'
>>> receipt(render, chat, row[:2] + [("text", "<tool>42<assistant>")] + row[3:], "|")  # a lost "|"
'boundary_drift'
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.environment import EnvironmentContract, call_env, cut_messages
from rlpipe.core.contracts.registry import PluginError
from rlpipe.core.step.journal import Journal

RECEIPTS = S.RECEIPTS
_COUNTS = ("tool_calls", "tool_errors", "timeouts")


@dataclass
class Row:
    """One conversation being built: its messages, token ids and per-token marks."""

    env: object
    messages: list
    prompt: list[int]
    ids: list[int] = field(default_factory=list)        # response tokens: actions and observations
    action: list[bool] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    pieces: list[tuple] = field(default_factory=list)  # the row as text and actions (`receipt`)
    rewards: list[float] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))
    stop: str | None = None
    error: str = ""                                    # the environment's failure, if it ended the row
    index: int | None = None                           # its key in the step's journal (None: none)


class Renderer:
    """The tokenizer's chat template as text, with the environment's tools."""

    def __init__(self, tokenizer, tools: tuple = ()):
        self.tokenizer, self.tools = tokenizer, list(tools) or None

    def __call__(self, messages: list, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int], special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)


def check_template(render: Renderer, label: str) -> None:
    """Refuse a chat template that rewrites earlier turns when one is appended (e.g. one that drops
    an earlier turn's reasoning): token in, token out needs each rendering to extend the last."""
    turns = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "<think>a</think>A"},
             {"role": "tool", "content": "R"}, {"role": "assistant", "content": "B"}]
    for n in (2, 3, 4):
        before, after = render(turns[:n - 1], True), render(turns[:n], False)
        if not after.startswith(before if turns[n - 1]["role"] == "assistant" else render(turns[:n - 1], False)):
            raise UserError(f"{label}: the tokenizer's chat template rewrites earlier turns when a "
                            f"{turns[n - 1]['role']} message is appended, so the token ids the model "
                            f"sampled could not be kept; use an append-only template "
                            f"(a tokenizer whose chat template only appends)")


def observation(render: Renderer, row: Row, action_text: str, new: list, eos_text: str,
                ended_by_eos: bool) -> str:
    """The text the template appends after the model's action for ``new`` messages: the rest of
    the assistant turn's closing the model did not write (e.g. the newline after its EOS), the new
    messages, and the next generation prompt."""
    before = render(row.messages, True)
    closed = render(row.messages + [{"role": "assistant", "content": action_text}], False)
    after = render(row.messages + [{"role": "assistant", "content": action_text}] + new, True)
    closing = closed[len(before) + len(action_text):] if closed.startswith(before + action_text) else ""
    if ended_by_eos and closing.startswith(eos_text):
        closing = closing[len(eos_text):]
    return closing + after[len(closed):]


def receipt(render, messages: list, pieces: list[tuple], eos_text: str) -> str:
    """``exact``, ``assistant_drift`` or ``boundary_drift`` for a row built from ``pieces``:
    ``("text", TEXT)`` (the prompt, observations) and ``("action", CONTENT, BY_EOS, SAME_IDS)``
    (an action's words, whether it ended with the EOS token, whether the words re-encode to the
    sampled ids). Walking ``render(messages, False)``, each text piece must come next, then each
    action's words (an EOS the action wrote counts as the action's); the row may stop before the
    rendering's last closing."""
    rendered, pos = render(messages, False), 0
    for piece in pieces:
        if piece[0] == "text":
            if not rendered.startswith(piece[1], pos):
                return ("exact" if pos + len(piece[1]) > len(rendered)
                        and piece[1].startswith(rendered[pos:]) and piece is pieces[-1]
                        else "boundary_drift")
            pos += len(piece[1])
            continue
        _, content, by_eos, _ = piece
        if not rendered.startswith(content, pos):
            return "boundary_drift"
        pos += len(content)
        if by_eos and rendered.startswith(eos_text, pos):
            pos += len(eos_text)
    return "exact" if all(p[3] for p in pieces if p[0] == "action") else "assistant_drift"


class MultiTurn:
    """Runs conversations between a collector's engine and one environment per sample.

    ``make_env()`` builds a fresh environment (its own state per conversation); ``contract`` is
    its `EnvironmentContract`; ``max_response_tokens`` bounds each row's response (actions and
    observations) and the collector's ``max_new_tokens`` each turn. `collect` returns the batch of
    `rlpipe.core.base.schema` with ``action_mask``, ``turn_id``, ``turn_reward``, ``num_turns``,
    ``stop_reason``, ``conversation`` and per-row counts under ``("env", NAME)``. With a
    ``journal`` (`rlpipe.core.step.journal`; training's) each ``reset`` and ``step`` of a numbered
    step goes through it: recorded as it completes, replayed when the step runs again.
    """

    def __init__(self, collector, make_env, contract: EnvironmentContract, tokenizer,
                 max_response_tokens: int, label: str = "environment", streams: bool = False):
        self.collector, self.make_env, self.contract, self.label = collector, make_env, contract, label
        self.streams = streams  # the collector's contract says it offers ``converse`` (`_turn`)
        if streams and not callable(getattr(collector, "converse", None)):
            raise PluginError(f"{label}: the collector declares streams but has no converse()")
        self.journal: Journal | None = None
        self.render = Renderer(tokenizer, contract.tools)
        self.budget = max_response_tokens
        self.eos_ids = set(collector.eos_ids)
        self.eos_text = self.render.decode(collector.eos_ids[:1])   # "" without an EOS token
        check_template(self.render, label)

    def collect(self, rows: list[dict], seed: int = 0, step: int | None = None) -> TensorDict:
        """``n`` conversations per dataset row (``collector.n``), turn by turn: each turn the rows
        still going generate together (a shrinking batch), then their environments answer; or,
        where the collector streams, each row at its own turn (`_turn`). ``step``: the numbered
        step, the journal's key (None: no journal)."""
        n = self.collector.n
        journaled = self.journal is not None and step is not None
        base = self.journal.begin(step, len(rows) * n) if journaled else None
        convs = []
        for k in range(len(rows) * n):
            c = Row(self.make_env(), [], [], index=None if base is None else base + k)
            kind, value = self._call(c, 0, "reset", [rows[k // n], seed + k])
            if kind == "error":
                raise value
            c.messages = list(value)
            text = self.render(c.messages, True)
            c.prompt, c.pieces = self.render.encode(text), [("text", text)]
            convs.append(c)
        if self.streams:  # each row at its own turn, to its end (no row is left active below)
            self.collector.converse([self._request(c, 0, seed + k) for k, c in enumerate(convs)],
                                    self._turn)
        for turn in range(self.contract.max_turns):
            active = [c for c in convs if c.stop is None]
            if not active:
                break
            self._act(active, turn)
            self._answer([c for c in active if c.stop is None], turn)
        return self._batch(convs, n)

    def _act(self, active: list[Row], turn: int) -> None:
        """One engine call for the active rows: each row's sampled ids become an action."""
        cap = min(self.collector.max_new_tokens, max(self.budget - len(c.ids) for c in active))
        ids = [c.prompt + c.ids for c in active]
        width, pad = max(map(len, ids)), self.collector.pad_id
        prompt_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        prompt_mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in ids])
        device = self.collector.device
        saved = self.collector.n, self.collector.max_new_tokens
        self.collector.n, self.collector.max_new_tokens = 1, cap
        try:
            out = self.collector.generate(ids, prompt_ids.to(device), prompt_mask.to(device))
        finally:
            self.collector.n, self.collector.max_new_tokens = saved
        for i, c in enumerate(active):
            mask = out[S.RESPONSE_MASK][i].bool()
            self._take(c, out[S.RESPONSE_IDS][i][mask].tolist(),
                       out[S.ENGINE_LOG_PROB][i][mask].tolist(), bool(out[S.FINISHED][i]), turn)

    def _take(self, c: Row, sampled: list, logp: list, finished: bool, turn: int) -> None:
        """The ids the engine sampled for ``c`` (``finished``: it stopped by itself) as its action,
        cut at the row's budget."""
        left = self.budget - len(c.ids)
        complete, sampled, logp = finished and len(sampled) <= left, sampled[:left], logp[:left]
        by_eos = bool(sampled) and sampled[-1] in self.eos_ids
        words = sampled[:-1] if by_eos else sampled
        content = self.render.decode(words, False)
        c.pieces.append(("action", content, by_eos, self.render.encode(content) == words))
        c.ids += sampled
        c.action += [True] * len(sampled)
        c.turn += [turn] * len(sampled)
        c.logp += logp
        c.messages.append({"role": "assistant", "content": content})
        if not complete:   # the row's budget, or this turn's max_new_tokens, ran out
            c.stop = "length" if len(sampled) == left else "turn_length"

    def _request(self, c: Row, turn: int, seed: int) -> tuple:
        """A row's next turn for `converse`: ``(key, ids, max_new_tokens, seed)`` (turns < 4099)."""
        cap = min(self.collector.max_new_tokens, self.budget - len(c.ids))
        return (c, turn, seed), c.prompt + c.ids, cap, seed * 4099 + turn

    def _turn(self, key: tuple, sampled: list, logp: list, finished: bool) -> tuple | None:
        """A streamed row's turn was sampled (called in the collector's pool): it becomes the
        action, the environment answers (`_answer`, one row), and the row's next turn is returned
        (None: it ended); for the same ids, the turn-batched loop's row."""
        c, turn, seed = key
        self._take(c, sampled, logp, finished, turn)
        if c.stop is None:
            self._answer([c], turn)
        return None if c.stop is not None else self._request(c, turn + 1, seed)

    def _call(self, c: Row, call: int, method: str, args: list) -> tuple[str, object]:
        """``c.env.METHOD(*args)`` (`call_env`): ``("ok", result)``, or ``("error", err)`` for a
        `TimeoutError` or `PluginError`; through the journal when the row has a key (a recorded
        call is replayed, a live one recorded once it completes)."""
        journal, key = (self.journal, (c.index, call)) if c.index is not None else (None, None)
        found = journal.replay(key, method, args, c.env) if journal else None
        if found is not None:
            status, result, c.env = found
            if status == "ok":
                return "ok", result if method == "reset" else tuple(result)
            return "error", (TimeoutError(status) if status == "timeout" else
                             PluginError(status.removeprefix("error: ")))
        for before in journal.catch_up(c.index) if journal else ():
            self._live(c.env, *before)   # an environment replayed without a state catches up
        t0 = time.monotonic()
        kind, value = self._live(c.env, method, args)
        if journal:
            status = ("ok" if kind == "ok" else "timeout" if isinstance(value, TimeoutError)
                      else f"error: {value}")
            journal.record(key, method, args, status, value if kind == "ok" else None,
                           time.monotonic() - t0, c.env)
        return kind, value

    def _live(self, env, method: str, args: list) -> tuple[str, object]:
        try:
            return "ok", call_env(getattr(env, method), *args, label=self.label,
                                  timeout_s=self.contract.timeout_s)
        except (TimeoutError, PluginError) as err:
            return "error", err

    def _answer(self, rows: list[Row], turn: int) -> None:
        """The environments answer the actions concurrently (a daemon thread each: a step that
        never returns cannot hold the process), all within the contract's timeout; a step that
        raises or runs past it ends its row (``tool_error``, ``timeout``)."""
        results: dict[int, tuple] = {}

        def run(i: int, c: Row) -> None:
            try:
                results[i] = self._call(c, turn + 1, "step", [c.messages[-1]["content"]])
            except BaseException as err:  # noqa: BLE001 - handed to the main thread below
                results[i] = ("error", err)

        threads = [threading.Thread(target=run, args=(i, c), daemon=True, name="rlpipe-env")
                   for i, c in enumerate(rows)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.contract.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for i, c in enumerate(rows):
            kind, value = results.get(i, ("error", None))
            if value is None and c.index is not None:   # cut at the deadline: the journal says so
                self.journal.record((c.index, turn + 1), "step", [c.messages[-1]["content"]],
                                    "timeout", None, self.contract.timeout_s, None)
            if kind == "error" and isinstance(value, (TimeoutError, type(None))):
                c.stop, c.counts["timeouts"] = "timeout", c.counts["timeouts"] + 1
                continue
            if kind == "error" and isinstance(value, PluginError):  # the environment's failure
                c.stop, c.error = "tool_error", str(value)
                continue
            if kind == "error":
                raise value  # the environment broke its contract: one line, the run stops
            new, reward, done, info = value
            c.rewards.append(reward)
            for key in _COUNTS:
                c.counts[key] += int(info.get(key, 0))
            if done:
                c.stop = "done"
            elif turn + 1 == self.contract.max_turns:
                c.stop = "max_turns"
            else:
                self._observe(c, new, turn)

    def _observe(self, c: Row, new: list, turn: int) -> None:
        """Append the template's rendering of ``new`` to the row (cut at the row's budget)."""
        new = cut_messages(new, self.contract.max_observation_tokens, self.render)
        text = observation(self.render, c, c.messages[-1]["content"], new, self.eos_text,
                           c.pieces[-1][2])  # the action just taken: did it end with EOS
        ids = self.render.encode(text)
        room = self.budget - len(c.ids)
        if len(ids) >= room:
            ids, c.stop = ids[:room], "length"
            text = self.render.decode(ids)
        c.pieces.append(("text", text))
        c.ids += ids
        c.action += [False] * len(ids)
        c.turn += [turn] * len(ids)
        c.logp += [0.0] * len(ids)
        c.messages += new

    def _batch(self, convs: list[Row], n: int) -> TensorDict:
        """The rows as one batch: prompts left-padded, responses right-padded."""
        pad, B = self.collector.pad_id, len(convs)
        P = max(len(c.prompt) for c in convs)
        R = max(1, max(len(c.ids) for c in convs))
        turns = self.contract.max_turns

        def right(values, fill, dtype):
            return torch.tensor([v + [fill] * (R - len(v)) for v in values], dtype=dtype)

        batch = TensorDict({
            S.PROMPT_IDS: torch.tensor([[pad] * (P - len(c.prompt)) + c.prompt for c in convs]),
            S.PROMPT_MASK: torch.tensor([[False] * (P - len(c.prompt)) + [True] * len(c.prompt)
                                         for c in convs]),
            S.RESPONSE_IDS: right([c.ids for c in convs], pad, torch.long),
            S.RESPONSE_MASK: right([[True] * len(c.ids) for c in convs], False, torch.bool),
            S.ACTION_MASK: right([c.action for c in convs], False, torch.bool),
            S.TURN_ID: right([c.turn for c in convs], 0, torch.long),
            S.ENGINE_LOG_PROB: right([c.logp for c in convs], 0.0, torch.float32),
            S.TURN_REWARD: torch.tensor([c.rewards + [0.0] * (turns - len(c.rewards))
                                         for c in convs], dtype=torch.float32),
            S.NUM_TURNS: torch.tensor([sum(p[0] == "action" for p in c.pieces) for c in convs]),
            S.STOP_REASON: torch.tensor([S.STOP_REASONS.index(c.stop or "max_turns") for c in convs]),
            S.GROUP_ID: torch.arange(B // n).repeat_interleave(n),
            S.FINISHED: torch.tensor([c.stop == "done" for c in convs]),
            S.ENV: {key: torch.tensor([c.counts[key] for c in convs]) for key in _COUNTS},
        }, batch_size=[B], device=self.collector.device)
        batch[S.ENV, "receipt"] = torch.tensor(
            [RECEIPTS.index(receipt(self.render, c.messages, c.pieces, self.eos_text)) for c in convs],
            device=self.collector.device)
        batch[S.PROMPT_TEXT] = NonTensorStack(*(_first_user(c.messages) for c in convs))
        batch[S.RESPONSE_TEXT] = NonTensorStack(*(_last_reply(c.messages) for c in convs))
        batch[S.CONVERSATION] = NonTensorStack(*(c.messages for c in convs))
        batch[S.ENV, "error"] = NonTensorStack(*(c.error for c in convs))
        return batch

    def close(self) -> None:
        """The journal's file; each step's thread is a daemon that ends with its step."""
        if self.journal is not None:
            self.journal.close()


def _first_user(messages: list) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def _last_reply(messages: list) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


def env_metrics(batch, journal: Journal | None = None) -> dict[str, float]:
    """The ``env/*`` metrics of a multi-turn batch (means over its conversations); with the
    step's ``journal``, ``env/journal/replayed`` and ``env/journal/diverged`` (calls this step)."""
    actions = batch[S.ACTION_MASK].sum().item()
    tokens = batch[S.RESPONSE_MASK].sum().item()
    out = {"env/turns": batch[S.NUM_TURNS].float().mean().item(),
           "env/obs_token_frac": (tokens - actions) / max(tokens, 1)}
    for key in _COUNTS:
        out[f"env/{key}"] = batch[S.ENV, key].float().mean().item()
    for i, name in enumerate(RECEIPTS):
        out[f"env/receipt/{name}"] = (batch[S.ENV, "receipt"] == i).float().mean().item()
    for i, name in enumerate(S.STOP_REASONS):
        out[f"env/stop/{name}"] = (batch[S.STOP_REASON] == i).float().mean().item()
    for key, count in (journal.counts.items() if journal is not None else ()):
        out[f"env/journal/{key}"] = float(count)
    return out
