"""Rollout collector on Hugging Face `generate`: prompts in, a padded rollout batch out.

The engine is the actor itself (``ctx.actor``), so weight sync is a no-op. Masks come from the
generation (the first EOS or stop string of each row), never from ``ids != pad``: pad may equal eos.
``engine_log_prob`` is the log-prob of each sampled token under the distribution ``generate``
sampled it from: its processed scores (logits / temperature, then top-k and top-p, renormalised;
greedy: the logits at temperature 1), read by a logits processor that runs last (`_SampledLogProbs`).

>>> collector = HFCollector(ctx, max_new_tokens=16, n=4)       # doctest: +SKIP
>>> batch = collector.collect(["Write a haiku."])               # doctest: +SKIP
>>> batch["response_ids"].shape, batch["group_id"].tolist()     # doctest: +SKIP
(torch.Size([4, 16]), [0, 0, 0, 0])
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from rlpipe.core import schema
from rlpipe.core.distributed import unsharded
from rlpipe.core.models import unwrap
from rlpipe.plugins.collectors.base import Collector, Count, Fraction, Temperature, Tokens, TopK


class HFCollector(Collector):
    """Samples ``n`` responses per prompt with ``ctx.actor.generate``, in micro-batches of
    ``micro_batch_size`` prompts. The sampling arguments are the base `Collector`'s."""

    name = "hf"

    def __init__(self, ctx, *, max_new_tokens: Count = 64, temperature: Temperature = 1.0,
                 top_p: Fraction = 1.0, top_k: TopK = 0, n: Count = 1, micro_batch_size: Count = 32,
                 max_prompt_tokens: Count = 256, chat_template: bool = False,
                 stop_strings: list[str] | None = None, min_new_tokens: Tokens = 0,
                 score_truncated: bool = False):
        self.check_own_args(micro_batch_size=micro_batch_size)
        super().__init__(ctx, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, n=n, max_prompt_tokens=max_prompt_tokens,
                         chat_template=chat_template, stop_strings=stop_strings,
                         min_new_tokens=min_new_tokens, score_truncated=score_truncated)
        self.model, self.micro_batch_size = ctx.actor, micro_batch_size
        # The sampling warpers are ours (`_warpers`), so that a processor can run after them; the
        # config keeps generate's own neutral, which adds none.
        neutral = dict(temperature=1.0, top_p=1.0, top_k=0) if temperature > 0 else {}
        self.generation_config = GenerationConfig(
            do_sample=temperature > 0, **neutral, max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            num_beams=1, repetition_penalty=1.0, use_cache=True, pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids or None,
            bos_token_id=self.tokenizer.bos_token_id)

    def generate(self, rows, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> dict:
        """``n`` samples per prompt, ``micro_batch_size`` prompts per ``generate`` call."""
        prompt_ids = prompt_ids.repeat_interleave(self.n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(self.n, dim=0)
        size = self.micro_batch_size * self.n
        parts = [self._generate(prompt_ids[i:i + size], prompt_mask[i:i + size])
                 for i in range(0, len(prompt_ids), size)]
        width = max(ids.shape[1] for ids, _, _, _ in parts)
        return {
            schema.RESPONSE_IDS: torch.cat([F.pad(ids, (0, width - ids.shape[1]), value=self.pad_id)
                                            for ids, _, _, _ in parts]),
            schema.RESPONSE_MASK: torch.cat([F.pad(mask, (0, width - mask.shape[1]), value=False)
                                             for _, mask, _, _ in parts]),
            schema.FINISHED: torch.cat([finished for _, _, finished, _ in parts]),
            schema.ENGINE_LOG_PROB: torch.cat([F.pad(logp, (0, width - logp.shape[1]))
                                               for _, _, _, logp in parts])}

    def _warpers(self) -> list:
        """The sampling warpers ``generate`` itself would add, in its order: temperature, top-k,
        top-p (none when greedy)."""
        if self.temperature <= 0:
            return []
        warpers = [TemperatureLogitsWarper(self.temperature)] if self.temperature != 1.0 else []
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p))
        return warpers

    def sync_weights(self, model) -> None:
        """No-op: this collector generates with the actor itself, so it always has its weights."""

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """One micro-batch: (response ids [b, r] right-padded, mask [b, r], finished [b],
        engine log-probs [b, r], 0 on padding)."""
        width = int(prompt_mask.sum(dim=1).max())       # drop columns that are padding in every row
        prompt_ids, prompt_mask = prompt_ids[:, -width:], prompt_mask[:, -width:]
        sampled = _SampledLogProbs()
        tracker = _EndTracker(width, len(prompt_ids), self.eos_ids, self.stop_strings, self.tokenizer,
                              prompt_ids.device, sampled)
        # no_grad, not inference_mode: under FSDP2 the gathered parameters would become
        # inference tensors that the trainer's next all-gather cannot write into. `unsharded`
        # gathers the actor once, so ranks that stop after different numbers of tokens run no
        # collective (a no-op for an unsharded model).
        with torch.no_grad(), unsharded(self.model), \
                _generation_mode(self.model, self.generation_config):
            out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(),
                                      generation_config=self.generation_config,
                                      logits_processor=LogitsProcessorList([*self._warpers(), sampled]),
                                      stopping_criteria=StoppingCriteriaList([tracker]))
        new = out[:, width:]
        finished = tracker.lengths >= 0
        lengths = torch.where(finished, tracker.lengths, new.shape[1])
        mask = torch.arange(new.shape[1], device=new.device) < lengths[:, None]
        r = int(lengths.max())
        logp = torch.stack(sampled.taken, dim=1)[:, :new.shape[1]] if sampled.taken else \
            torch.zeros(new.shape, dtype=torch.float32, device=new.device)
        return (new.masked_fill(~mask, self.pad_id)[:, :r], mask[:, :r], finished,
                torch.where(mask, logp, 0.0)[:, :r])


class _SampledLogProbs(LogitsProcessor):
    """The last logits processor: keeps ``log_softmax`` of the fully processed scores (the
    distribution the next token is drawn from); `take` then records the drawn token's entry."""

    def __init__(self):
        self.log_probs, self.taken = None, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.log_probs = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def take(self, tokens: torch.LongTensor) -> None:
        """Record the log-prob of ``tokens`` [b], the tokens just drawn."""
        self.taken.append(self.log_probs.gather(-1, tokens[:, None]).squeeze(-1))


class _EndTracker(StoppingCriteria):
    """Stops a row at its first EOS token or stop string and records ``lengths``: how many new
    tokens the row had then (EOS / stop tokens included), -1 while it runs. Called after each
    token is drawn, it also hands the drawn tokens to ``sampled`` (their engine log-probs)."""

    def __init__(self, prompt_width, batch_size, eos_ids, stop_strings, tokenizer, device,
                 sampled: _SampledLogProbs):
        self.prompt_width, self.stop_strings, self.tokenizer = prompt_width, stop_strings, tokenizer
        self.sampled = sampled
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.lengths = torch.full((batch_size,), -1, dtype=torch.long, device=device)
        # A stop string of L characters spans at most 4 L tokens (byte-level tokens: 4 per char).
        self.window = 4 * max(map(len, stop_strings), default=0)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_width:]
        self.sampled.take(new[:, -1])
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
