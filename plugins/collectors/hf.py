"""Rollout collector on Hugging Face `generate`: prompts in, a padded rollout batch out.

The engine is the actor itself (``ctx.actor``), so weight sync is a no-op. Masks come from the
generation (the first EOS or stop string of each row), never from ``ids != pad``: pad may equal eos.
Log-probs are not computed here; the trainer runs its own forward for ``old_log_prob``.

>>> collector = HFCollector(ctx, max_new_tokens=16, n=4)       # doctest: +SKIP
>>> batch = collector.collect(["Write a haiku."])               # doctest: +SKIP
>>> batch["response_ids"].shape, batch["group_id"].tolist()     # doctest: +SKIP
(torch.Size([4, 16]), [0, 0, 0, 0])
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from tensordict import NonTensorStack, TensorDict
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rlpipe.core import schema
from rlpipe.core.distributed import unsharded
from rlpipe.core.errors import UserError
from rlpipe.core.models import unwrap


def encode_prompts(tokenizer, prompts: list[str], chat_template: bool, budget: int,
                   collector: str) -> list[list[int]]:
    """Token ids of each prompt (wrapped as a user turn of the chat template if asked), keeping
    the last ``budget`` tokens; a prompt that encodes to nothing is an error naming it."""
    if chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=False)
                 for p in prompts]
        rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        rows = tokenizer(list(prompts))["input_ids"]
    rows = [list(row[-budget:]) for row in rows]
    if not all(rows):
        raise UserError(f"{collector} collector: prompt {rows.index([])} encodes to no tokens")
    return rows


class HFCollector:
    """Samples ``n`` responses per prompt with ``ctx.actor.generate``, in micro-batches of
    ``micro_batch_size`` prompts. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1``
    disable those filters. Prompts longer than ``max_prompt_tokens`` keep their last tokens.
    ``chat_template=True`` wraps each prompt as one user message with the generation prompt.
    A row also stops when its decoded response ends with one of ``stop_strings``; the stop tokens
    stay in the response and the row counts as finished. ``min_new_tokens`` suppresses EOS for
    the first tokens of each response (stop strings still end a row). The constructor arguments
    are kept as attributes of the same names (the trainer reads ``temperature`` and
    ``max_new_tokens``).
    """

    def __init__(self, ctx, *, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, micro_batch_size: int = 32,
                 max_prompt_tokens: int = 256, chat_template: bool = False,
                 stop_strings: list[str] | None = None, min_new_tokens: int = 0):
        _check_args(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    top_k=top_k, n=n, micro_batch_size=micro_batch_size,
                    max_prompt_tokens=max_prompt_tokens, stop_strings=stop_strings)
        check_context(ctx, "hf", chat_template, min_new_tokens, max_new_tokens)
        self.model, self.tokenizer, self.device = ctx.actor, ctx.tokenizer, torch.device(ctx.device)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = (
            max_new_tokens, temperature, top_p, top_k)
        self.n, self.micro_batch_size = n, micro_batch_size
        self.max_prompt_tokens, self.chat_template = max_prompt_tokens, chat_template
        self.stop_strings, self.min_new_tokens = tuple(stop_strings or ()), min_new_tokens
        self.eos_ids = _eos_ids(self.tokenizer, self.model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else None)
        if self.pad_id is None:
            raise UserError("hf collector: the tokenizer has neither a pad token nor an EOS token")
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0 else {}
        self.generation_config = GenerationConfig(
            do_sample=temperature > 0, **sampling, max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            num_beams=1, repetition_penalty=1.0, use_cache=True, pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids or None,
            bos_token_id=self.tokenizer.bos_token_id)

    def collect(self, prompts: list[str]) -> TensorDict:
        """Generate for ``prompts``; returns a TensorDict of batch size ``[len(prompts) * n]``
        with the prompt/response keys of `rlpipe.core.schema`, ``n`` consecutive rows per prompt."""
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise UserError("hf collector: collect() needs a non-empty list of prompt strings")
        prompt_ids, prompt_mask = self._encode(prompts)
        prompt_ids = prompt_ids.repeat_interleave(self.n, dim=0).to(self.device)
        prompt_mask = prompt_mask.repeat_interleave(self.n, dim=0).to(self.device)
        rows = self.micro_batch_size * self.n
        parts = [self._generate(prompt_ids[i:i + rows], prompt_mask[i:i + rows])
                 for i in range(0, len(prompt_ids), rows)]
        width = max(ids.shape[1] for ids, _, _ in parts)
        response_ids = torch.cat([F.pad(ids, (0, width - ids.shape[1]), value=self.pad_id)
                                  for ids, _, _ in parts])
        response_mask = torch.cat([F.pad(mask, (0, width - mask.shape[1]), value=False)
                                   for _, mask, _ in parts])
        batch = TensorDict({
            schema.PROMPT_IDS: prompt_ids, schema.PROMPT_MASK: prompt_mask,
            schema.RESPONSE_IDS: response_ids, schema.RESPONSE_MASK: response_mask,
            schema.GROUP_ID: torch.arange(len(prompts), device=self.device).repeat_interleave(self.n),
            schema.FINISHED: torch.cat([finished for _, _, finished in parts]),
        }, batch_size=[len(prompt_ids)], device=self.device)
        responses = self.tokenizer.batch_decode(
            [ids[mask].tolist() for ids, mask in zip(response_ids, response_mask)],
            skip_special_tokens=True)
        batch[schema.PROMPT_TEXT] = NonTensorStack(*(p for p in prompts for _ in range(self.n)))
        batch[schema.RESPONSE_TEXT] = NonTensorStack(*responses)
        return batch

    def sync_weights(self, model) -> None:
        """No-op: this collector generates with the actor itself, so it always has its weights."""

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [N, P] left-padded with ``pad_id``, and the bool mask of real tokens."""
        rows = encode_prompts(self.tokenizer, prompts, self.chat_template, self.max_prompt_tokens,
                              "hf")
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = True
        return ids, mask

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """One micro-batch: (response ids [b, r] right-padded, mask [b, r], finished [b])."""
        width = int(prompt_mask.sum(dim=1).max())       # drop columns that are padding in every row
        prompt_ids, prompt_mask = prompt_ids[:, -width:], prompt_mask[:, -width:]
        tracker = _EndTracker(width, len(prompt_ids), self.eos_ids, self.stop_strings, self.tokenizer,
                              prompt_ids.device)
        # no_grad, not inference_mode: under FSDP2 the gathered parameters would become
        # inference tensors that the trainer's next all-gather cannot write into. `unsharded`
        # gathers the actor once, so ranks that stop after different numbers of tokens run no
        # collective (a no-op for an unsharded model).
        with torch.no_grad(), unsharded(self.model), \
                _generation_mode(self.model, self.generation_config):
            out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(),
                                      generation_config=self.generation_config,
                                      stopping_criteria=StoppingCriteriaList([tracker]))
        new = out[:, width:]
        finished = tracker.lengths >= 0
        lengths = torch.where(finished, tracker.lengths, new.shape[1])
        mask = torch.arange(new.shape[1], device=new.device) < lengths[:, None]
        r = int(lengths.max())
        return new.masked_fill(~mask, self.pad_id)[:, :r], mask[:, :r], finished


class _EndTracker(StoppingCriteria):
    """Stops a row at its first EOS token or stop string and records ``lengths``: how many new
    tokens the row had then (EOS / stop tokens included), -1 while it runs."""

    def __init__(self, prompt_width, batch_size, eos_ids, stop_strings, tokenizer, device):
        self.prompt_width, self.stop_strings, self.tokenizer = prompt_width, stop_strings, tokenizer
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.lengths = torch.full((batch_size,), -1, dtype=torch.long, device=device)
        # A stop string of L characters spans at most 4 L tokens (byte-level tokens: 4 per char).
        self.window = 4 * max(map(len, stop_strings), default=0)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_width:]
        done = torch.isin(new[:, -1], self.eos_ids)
        if self.stop_strings:
            running = (self.lengths < 0).nonzero().flatten().tolist()
            texts = self.tokenizer.batch_decode(new[running, -self.window:].tolist(),
                                                skip_special_tokens=True)
            hits = torch.tensor([t.endswith(self.stop_strings) for t in texts], dtype=torch.bool)
            done[running] |= hits.to(done.device)
        self.lengths = torch.where(done & (self.lengths < 0), new.shape[1], self.lengths)
        return self.lengths >= 0


@contextmanager
def _generation_mode(model, config: GenerationConfig):
    """Eval mode, and ``config`` as the model's own generation config, both restored on exit.

    transformers 5 fills every unset field of the config passed to `generate` from
    ``model.generation_config`` (e.g. a checkpoint's ``repetition_penalty``), so a fresh config
    alone does not shield us from the checkpoint's sampling defaults.
    """
    owner = unwrap(model)
    saved, was_training = owner.generation_config, model.training
    owner.generation_config = config
    model.eval()
    try:
        yield
    finally:
        owner.generation_config = saved
        model.train(was_training)


def _eos_ids(tokenizer, model) -> list[int]:
    """Every EOS id the tokenizer, the model config and its generation config name, sorted."""
    found = [tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None),
             getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    flat = [i for ids in found for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
    return sorted({int(i) for i in flat if i is not None})


def check_context(ctx, collector: str, chat_template: bool, min_new_tokens, max_new_tokens: int):
    """The checks the hf and vllm collectors share: the run context, chat template, token floor."""
    if not isinstance(min_new_tokens, int) or isinstance(min_new_tokens, bool) \
            or not 0 <= min_new_tokens <= max_new_tokens:
        raise UserError(f"{collector} collector: min_new_tokens must be an integer in "
                        f"[0, max_new_tokens={max_new_tokens}], got {min_new_tokens!r}")
    if ctx.actor is None or ctx.tokenizer is None:
        raise UserError(f"{collector} collector: the run context has no actor model or no tokenizer")
    if chat_template and not getattr(ctx.tokenizer, "chat_template", None):
        raise UserError(f"{collector} collector: chat_template=true but the tokenizer has no chat "
                        f"template; set chat_template: false or use a tokenizer that defines one")


def _check_args(*, temperature, top_p, top_k, stop_strings, **positive_ints) -> None:
    """Raise `UserError` naming the first bad constructor argument."""
    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    def is_real(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    for name, value in positive_ints.items():
        if not is_int(value) or value < 1:
            raise UserError(f"hf collector: {name} must be an integer >= 1, got {value!r}")
    if not is_real(temperature) or temperature < 0:
        raise UserError(f"hf collector: temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise UserError(f"hf collector: top_p must be in (0, 1], got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        raise UserError(f"hf collector: top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if stop_strings is not None and (not isinstance(stop_strings, (list, tuple))
                                     or not all(isinstance(s, str) and s for s in stop_strings)):
        raise UserError(f"hf collector: stop_strings must be a list of non-empty strings, "
                        f"got {stop_strings!r}")
