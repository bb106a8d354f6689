"""What every collector shares, so that an engine (``hf``, ``vllm``, a third party's) writes only
its sampling call.

`Collector` checks the constructor arguments against their declared types and bounds (a `Bound`
in the ``Annotated`` hint, the same `Range` text config fields carry), checks the run context,
resolves the pad and EOS ids, encodes prompts (chat template, last ``prompt_budget`` tokens),
left-pads them, and packs what `Collector.generate` returns into the rollout batch with group ids
and decoded texts. It declares what core reads about its sampling in `Collector.contract` (a
`rlpipe.core.contracts.collector.CollectorContract` computed from the arguments, before any
engine starts) and offers ``close()``.

>>> pad_rows([[5, 6, 7], [8]], fill=0, left=True)[0].tolist()
[[5, 6, 7], [0, 0, 8]]
>>> check_args("toy collector", {"n": 0}, {"n": Count})
Traceback (most recent call last):
...
rlpipe.core.base.errors.UserError: toy collector: n must be an integer >= 1, got 0

A complete collector, with a word-level tokenizer and an engine that answers "two" then EOS:

>>> from types import SimpleNamespace
>>> from tokenizers import Tokenizer, models, pre_tokenizers
>>> from transformers import PreTrainedTokenizerFast
>>> vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "one", "two"])}
>>> backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
>>> backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
>>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
...                                     eos_token="</s>")
>>> class Echo(Collector):
...     name = "echo"
...     def generate(self, rows, prompt_ids, prompt_mask):
...         ids, mask = pad_rows([[3, 1]] * len(rows) * self.n, self.pad_id)
...         return {schema.RESPONSE_IDS: ids, schema.RESPONSE_MASK: mask,
...                 schema.FINISHED: mask[:, -1]}
...     def sync_weights(self, model):
...         pass
>>> actor = SimpleNamespace(config=SimpleNamespace(eos_token_id=1))
>>> batch = Echo(SimpleNamespace(tokenizer=tokenizer, actor=actor, device="cpu"),
...              n=2).collect(["one", "one one"])
>>> batch[schema.PROMPT_IDS].tolist(), batch[schema.GROUP_ID].tolist()
([[0, 2], [0, 2], [2, 2], [2, 2]], [0, 0, 1, 1])
>>> list(batch[schema.RESPONSE_TEXT])
['two', 'two', 'two', 'two']
"""

from __future__ import annotations

import inspect
import math
import sys
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.yamlconf import Range
from rlpipe.core.contracts.collector import CollectorContract

__all__ = ["Bound", "Collector", "Count", "Fraction", "Temperature", "TopK", "Tokens",
           "check_args", "eos_ids", "pad_rows"]


@dataclass(frozen=True)
class Bound:
    """A numeric argument's range as `rlpipe.core.base.yamlconf.Range` text (``">= 1"``,
    ``"in (0, 1]"``; empty: unbounded) and a note for its error, declared in the signature:
    ``n: Annotated[int, Bound(">= 1")] = 1``."""

    rule: str = ""
    note: str = ""


Count = Annotated[int, Bound(">= 1")]
Tokens = Annotated[int, Bound(">= 0")]
TopK = Annotated[int, Bound(">= 0", "0 disables it")]
Temperature = Annotated[float, Bound(">= 0", "0 = greedy")]
Fraction = Annotated[float, Bound("in (0, 1]")]


def check_args(owner: str, values: dict[str, Any], hints: dict[str, Any]) -> None:
    """Raise `UserError` ``"<owner>: <name> must be ..., got <value>"`` for the first value that
    does not fit its hint: ``bool``, ``int`` (not a bool), ``float`` (finite; an int counts),
    ``str``, ``Literal``, ``list[str]`` (non-empty strings), ``X | None``, each bounded by the
    `Bound` of an ``Annotated`` hint. A hint of another kind, or none, is not checked."""
    for name, value in values.items():
        wanted = _mismatch(value, hints.get(name, Any))
        if wanted:
            raise UserError(f"{owner}: {name} must be {wanted}, got {value!r}")


def _mismatch(value, hint) -> str | None:
    """What ``value`` should have been under ``hint``; None when it fits."""
    options = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in options:
        inner = typing.Union[tuple(a for a in options if a is not type(None))]
        wanted = None if value is None else _mismatch(value, inner)
        return wanted and f"{wanted} or null"
    bound = Bound()
    if typing.get_origin(hint) is Annotated:
        bound = next((m for m in hint.__metadata__ if isinstance(m, Bound)), bound)
        hint = hint.__origin__
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    fits = not bound.rule or (number and Range.parse(bound.rule).admits(value))
    note = f" ({bound.note})" if bound.note else ""
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        ok = number and isinstance(value, int) and fits
        return None if ok else f"an integer{' ' + bound.rule if bound.rule else ''}{note}"
    if hint is float:
        ok = number and math.isfinite(value) and fits
        return None if ok else f"{bound.rule or 'a finite number'}{note}"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if typing.get_origin(hint) is Literal:
        options = typing.get_args(hint)
        return None if value in options else f"one of {', '.join(map(repr, options))}"
    if typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
        ok = isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)
        return None if ok else "a list of non-empty strings"
    return None


def pad_rows(rows: list[list], fill, *, left: bool = False,
             dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as one ``[len(rows), longest]`` tensor padded with ``fill`` on the right (on the
    left with ``left=True``), and the bool mask of the real entries."""
    width = max(map(len, rows), default=0)
    values = torch.full((len(rows), width), fill, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        values[i, span], mask[i, span] = torch.tensor(row, dtype=dtype), True
    return values, mask


def eos_ids(tokenizer, model) -> list[int]:
    """Every EOS id the tokenizer, the model config and its generation config name, sorted."""
    found = [tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None),
             getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    flat = [i for ids in found for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
    return sorted({int(i) for i in flat if i is not None})


class Collector:
    """Samples ``n`` responses per prompt; a subclass implements `generate` and `sync_weights`.

    ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those filters. Prompts keep
    their last ``max_prompt_tokens`` tokens (``prompt_budget``, which an engine may lower to fit
    its context). ``chat_template=True`` wraps each prompt as one user message with the
    generation prompt. A row also stops when its response ends with one of ``stop_strings``
    (kept in the response; the row counts as finished). ``min_new_tokens`` suppresses EOS for
    the first tokens of each response. The arguments are kept as attributes of the same names,
    which `collect` reads at each call. Core reads `contract` (from the same arguments: ``n``,
    the budgets, ``temperature``, ``top_k``, ``top_p``, ``score_truncated``, ``chat_template``)
    and calls ``close()`` at the end of a run (a no-op here).

    A subclass declares every argument in its own signature (config checks names and types
    against it) with the hints above, passes the shared ones to ``super().__init__`` and checks
    its own with `check_own_args`. ``name`` starts its error messages: ``"hf collector: ..."``.

    Args:
        max_new_tokens: most tokens per response
        temperature: sampling temperature (0: greedy)
        top_p: nucleus sampling: the smallest set of tokens holding this probability (1: off)
        top_k: sample from the k most likely tokens only (0: off)
        n: responses per prompt (a GRPO/RLOO group)
        max_prompt_tokens: a prompt keeps its last this many tokens (lowered to what the model's context leaves after max_new_tokens)
        chat_template: wrap each plain-string prompt as one user message through the tokenizer's chat template (chat-message prompts are applied always)
        stop_strings: a response also ends at any of these strings (kept; the row counts as finished)
        min_new_tokens: EOS is suppressed until a response has this many tokens
        score_truncated: with top_k/top_p: the trainer scores tokens under the same truncated, renormalised distribution (rollout-correction.md)
    """

    name = "custom"

    def __init__(self, ctx, *, max_new_tokens: Count = 64, temperature: Temperature = 1.0,
                 top_p: Fraction = 1.0, top_k: TopK = 0, n: Count = 1,
                 max_prompt_tokens: Count = 256, chat_template: bool = False,
                 stop_strings: list[str] | None = None, min_new_tokens: Tokens = 0,
                 score_truncated: bool = False):
        shared = dict(locals())
        del shared["self"], shared["ctx"]
        hints = typing.get_type_hints(Collector.__init__, include_extras=True)
        check_args(self.label, shared, hints)
        if min_new_tokens > max_new_tokens:
            raise UserError(f"{self.label}: min_new_tokens must be an integer in "
                            f"[0, max_new_tokens={max_new_tokens}], got {min_new_tokens!r}")
        if ctx.actor is None or ctx.tokenizer is None:
            raise UserError(f"{self.label}: the run context has no actor model or no tokenizer")
        if chat_template and not getattr(ctx.tokenizer, "chat_template", None):
            raise UserError(f"{self.label}: chat_template=true but the tokenizer has no chat "
                            f"template; set chat_template: false or use a tokenizer that defines one")
        self.tokenizer, self.device = ctx.tokenizer, torch.device(ctx.device)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = (
            max_new_tokens, temperature, top_p, top_k)
        self.n, self.max_prompt_tokens, self.chat_template = n, max_prompt_tokens, chat_template
        self.stop_strings, self.min_new_tokens = tuple(stop_strings or ()), min_new_tokens
        self.score_truncated = score_truncated
        self.prompt_budget = max_prompt_tokens
        self.eos_ids = eos_ids(self.tokenizer, ctx.actor)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else None)
        if self.pad_id is None:
            raise UserError(f"{self.label}: the tokenizer has neither a pad token nor an EOS token")

    @property
    def label(self) -> str:
        return f"{self.name} collector"

    @classmethod
    def contract(cls, **args) -> CollectorContract:
        """What core reads about this collector built with ``args`` (its constructor's defaults
        for the rest), checked as the constructor checks them."""
        params = inspect.signature(cls.__init__).parameters
        values = {name: p.default for name, p in params.items() if p.default is not p.empty}
        values.update(args)
        hints = typing.get_type_hints(Collector.__init__, include_extras=True)
        check_args(f"{cls.name} collector", {k: values[k] for k in hints if k in values}, hints)
        return CollectorContract(
            samples_per_prompt=values["n"], max_new_tokens=values["max_new_tokens"],
            max_prompt_tokens=values["max_prompt_tokens"],
            budget_args=("max_prompt_tokens", "max_new_tokens"),
            defaults=frozenset(params) - set(args), temperature=float(values["temperature"]),
            top_k=values["top_k"], top_p=float(values["top_p"]),
            score_truncated=values["score_truncated"], chat_template=values["chat_template"])

    def check_own_args(self, **values) -> None:
        """`check_args` for a subclass's own arguments, against its ``__init__`` hints."""
        hints = typing.get_type_hints(type(self).__init__, include_extras=True)
        check_args(self.label, values, hints)

    def collect(self, prompts: list[str]) -> TensorDict:
        """Generate for ``prompts``; a TensorDict of batch size ``[len(prompts) * n]`` with the
        prompt/response keys of `rlpipe.core.base.schema` (and what `generate` adds), ``n``
        consecutive rows per prompt; prompts left-padded, responses right-padded."""
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise UserError(f"{self.label}: collect() needs a non-empty list of prompt strings")
        rows = self.encode(prompts)
        prompt_ids, prompt_mask = pad_rows(rows, self.pad_id, left=True)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        out = dict(self.generate(rows, prompt_ids, prompt_mask))
        S, n = schema, self.n
        batch = TensorDict({
            S.PROMPT_IDS: prompt_ids.repeat_interleave(n, dim=0),
            S.PROMPT_MASK: prompt_mask.repeat_interleave(n, dim=0),
            S.RESPONSE_IDS: out.pop(S.RESPONSE_IDS), S.RESPONSE_MASK: out.pop(S.RESPONSE_MASK),
            S.GROUP_ID: torch.arange(len(prompts), device=self.device).repeat_interleave(n),
            S.FINISHED: out.pop(S.FINISHED), **out,
        }, batch_size=[len(prompts) * n], device=self.device)
        responses = self.tokenizer.batch_decode(
            [ids[mask].tolist() for ids, mask in zip(batch[S.RESPONSE_IDS], batch[S.RESPONSE_MASK])],
            skip_special_tokens=True)
        batch[S.PROMPT_TEXT] = NonTensorStack(*(p for p in prompts for _ in range(n)))
        batch[S.RESPONSE_TEXT] = NonTensorStack(*responses)
        return batch

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (wrapped as a user turn of the chat template if asked), keeping
        the last ``prompt_budget`` tokens; a prompt that encodes to nothing is an error naming it."""
        if self.chat_template:
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                        add_generation_prompt=True, tokenize=False)
                     for p in prompts]
            rows = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            rows = self.tokenizer(list(prompts))["input_ids"]
        long = [i for i, row in enumerate(rows) if len(row) > self.prompt_budget]
        if long and not getattr(self, "_said_cut", False):  # once per run: a line, not a flood
            self._said_cut = True
            print(f"warning: {self.label}: {len(long)} of {len(rows)} prompts are longer than "
                  f"the prompt budget ({self.prompt_budget} tokens: max_prompt_tokens and the "
                  f"model's context) and keep only their last {self.prompt_budget} tokens (the "
                  f"first has {len(rows[long[0]])}); shorten them or raise max_prompt_tokens",
                  file=sys.stderr)
        rows = [list(row[-self.prompt_budget:]) for row in rows]
        if not all(rows):
            raise UserError(f"{self.label}: prompt {rows.index([])} encodes to no tokens")
        return rows

    def generate(self, rows: list[list[int]], prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The engine call: ``n`` samples for each prompt (``rows``: its token ids; the same
        left-padded with ``pad_id`` on ``device``), prompt by prompt. Returns ``response_ids``
        [B, R] right-padded with ``pad_id`` (EOS or stop tokens kept), ``response_mask`` from the
        generation (never ``ids != pad``), ``finished`` [B] (ended by EOS or a stop string),
        and any other batch keys (e.g. ``engine_log_prob``)."""
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def sync_weights(self, model) -> None:
        """Make the engine sample from ``model``'s current weights (called after each update)."""
        raise NotImplementedError(f"{type(self).__name__}.sync_weights")

    def close(self) -> None:
        """Release the engine at the end of a run; nothing to release here."""
