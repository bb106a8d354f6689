"""Rollout collector on Hugging Face `generate`: prompts in, a padded rollout batch out.

The engine is the actor itself (``ctx.actor``), so weight sync is a no-op. Masks come from the
generation (the first EOS or stop string of each row), never from ``ids != pad``: pad may equal eos.
Sampling: ``generate`` runs its greedy loop, and a logits processor that runs last (`_Sampler`)
draws each token from the processed scores (logits / temperature, then top-k and top-p) by inverse
CDF (`sample_from_scores`: one uniform per row) and hands ``generate`` a one-hot row to take. The
distribution is the one ``generate``'s own ``do_sample`` draws from; its ``torch.multinomial``
draws one exponential per vocabulary entry per row, which was 60% of a rollout's time on CPU.
``engine_log_prob`` is the log-prob of each drawn token under that distribution (greedy: the
logits at temperature 1). After ``record_hidden(True)`` (core asks for it when a shared-backbone
critic can use it) it also writes ``engine_hidden`` [B, R, H]: the input of the LM head that
scored each response token, i.e. the actor's last hidden state of the state before the token.
After ``record_actor_log_prob(temperature, truncation)`` it writes ``actor_log_prob``: each drawn
token's log-prob under the trainer's scoring distribution, from the same logits, taken before
any processor (EOS suppression, top-k, top-p) changes them; core then skips its own forward.
With ``ctx.shared_prefix`` (``models.shared_prefix``) the prompt tokens that rows share, a prefix
common to all or each distinct prompt of ``n`` samples, are prefilled once and ``generate`` gets
their KV cache (`rlpipe.core.models.lm.generation_cache`): the same logits, fewer prompt tokens run.
With ``eos_after_stop``, a row that ends on a stop string takes EOS at the next step instead of a
draw, with its unforced log-probs there (engine and actor, what the trainer's forward computes):
trained as an action like any other token, it teaches the model to end there.

>>> collector = HFCollector(ctx, max_new_tokens=16, n=4)       # doctest: +SKIP
>>> batch = collector.collect(["Write a haiku."])               # doctest: +SKIP
>>> batch["response_ids"].shape, batch["group_id"].tolist()     # doctest: +SKIP
(torch.Size([4, 16]), [0, 0, 0, 0])
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from rlpipe.core.models.distributed import unsharded
from rlpipe.core.models.lm import generation_cache, unwrap
from rlpipe.core.models.lora import merged_weights
from rlpipe.plugin import Collector, Count, Fraction, Temperature, Tokens, TopK, UserError, schema


STATIC_WIDTH = 64   # ``cache: static``: prompt widths are rounded up to a multiple of this


class HFCollector(Collector):
    """Samples ``n`` responses per prompt with ``ctx.actor.generate``, in micro-batches of
    ``micro_batch_size`` prompts. The sampling arguments are the base `Collector`'s.

    ``cache: static`` gives ``generate`` transformers' static KV cache, which transformers
    compiles the decoding step for on CUDA (4.0x the tokens/s of the dynamic cache for a 0.5B
    model on an H200, `generate` alone; BENCHMARKS.md). Prompt widths are rounded up to a
    multiple of `STATIC_WIDTH` so that few cache shapes are compiled. Sampling then runs every
    prompt token (no ``models.shared_prefix``); ``record_hidden`` and several processes are
    refused. On CPU, where nothing is compiled, it is slower (3.9 against 3.2 s for 16 x 32
    tokens of SmolLM2-135M).

    Args:
        micro_batch_size: prompts per generate call
        cache: dynamic, or static: transformers' static KV cache, compiled on CUDA (performance.md)
        eos_after_stop: a response that ends on a stop string gets EOS after it, trained as a policy token (the model learns to stop there)
    """

    name = "hf"

    def __init__(self, ctx, *, max_new_tokens: Count = 64, temperature: Temperature = 1.0,
                 top_p: Fraction = 1.0, top_k: TopK = 0, n: Count = 1, micro_batch_size: Count = 32,
                 max_prompt_tokens: Count = 256, chat_template: bool = False,
                 stop_strings: list[str] | None = None, min_new_tokens: Tokens = 0,
                 score_truncated: bool = False, cache: Literal["dynamic", "static"] = "dynamic",
                 eos_after_stop: bool = False):
        self.check_own_args(micro_batch_size=micro_batch_size, cache=cache,
                            eos_after_stop=eos_after_stop)
        super().__init__(ctx, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, n=n, max_prompt_tokens=max_prompt_tokens,
                         chat_template=chat_template, stop_strings=stop_strings,
                         min_new_tokens=min_new_tokens, score_truncated=score_truncated)
        self.model, self.micro_batch_size, self.keep_hidden = ctx.actor, micro_batch_size, False
        if cache == "static" and _world() > 1:
            raise UserError(f"{self.label}: cache: static is for one process (under FSDP2 the "
                            f"actor's weights are gathered anew for each generate, and a compiled "
                            f"decoding step has not been run on them); use cache: dynamic")
        # prompt tokens rows share: prefilled once (not into a static cache, which starts empty)
        self.shared_prefix = ctx.shared_prefix and cache != "static"
        self.cache, self.eos_after_stop = cache, eos_after_stop
        if eos_after_stop and (min_new_tokens or top_k or top_p < 1 or not self.eos_ids):
            raise UserError(f"{self.label}: eos_after_stop appends EOS, which min_new_tokens, top_k "
                            f"and top_p can remove; leave those off (and use a tokenizer with EOS)")
        self.trainer_scoring = None  # (temperature, truncation) after record_actor_log_prob
        # The sampling warpers and the draw are ours (`_warpers`, `_Sampler`): generate runs its
        # greedy loop (do_sample=False adds no warpers) and takes the token our processor drew.
        self.generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens,
            num_beams=1, repetition_penalty=1.0, use_cache=True, pad_token_id=self.pad_id,
            cache_implementation="static" if cache == "static" else None,
            eos_token_id=self.eos_ids or None,
            bos_token_id=self.tokenizer.bos_token_id)

    def generate(self, rows, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> dict:
        """``n`` samples per prompt, ``micro_batch_size`` prompts per ``generate`` call."""
        prompt_ids = prompt_ids.repeat_interleave(self.n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(self.n, dim=0)
        size = self.micro_batch_size * self.n
        parts = [self._generate(prompt_ids[i:i + size], prompt_mask[i:i + size])
                 for i in range(0, len(prompt_ids), size)]
        width = max(part[schema.RESPONSE_IDS].shape[1] for part in parts)
        fill = {schema.RESPONSE_IDS: self.pad_id, schema.RESPONSE_MASK: False}
        out = {}
        for key in parts[0]:  # right-pad the response positions (dim 1) to the longest part
            out[key] = torch.cat([x if x.ndim < 2 else F.pad(x.movedim(1, -1), (0, width - x.shape[1]),
                                                             value=fill.get(key, 0)).movedim(-1, 1)
                                  for x in (part[key] for part in parts)])
        return out

    def record_hidden(self, on: bool = True) -> None:
        """Also write ``engine_hidden`` (see the module docstring) from the next `collect` on."""
        if on and self.cache == "static":   # a compiled step's outputs are reused buffers
            raise UserError(f"{self.label}: cache: static does not record hidden states, which "
                            f"rollout_correction.mode: bypass with a shared-backbone critic "
                            f"reads; use cache: dynamic")
        self.keep_hidden = on

    def record_actor_log_prob(self, temperature: float, truncation=None) -> None:
        """Also write ``actor_log_prob`` (see the module docstring) from the next `collect` on:
        log-probs under ``softmax(logits / temperature)``, restricted to ``truncation`` (a
        `rlpipe.core.base.truncation.Truncation`) when it is not None."""
        self.trainer_scoring = (temperature, truncation)

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

    def _min_new_tokens(self, prompt_width: int) -> list:
        """EOS suppressed until ``min_new_tokens`` tokens, before the warpers as in ``generate``'s
        own order (which would clone the scores and rebuild a vocabulary mask every token)."""
        if not self.min_new_tokens or not self.eos_ids:
            return []
        return [_SuppressEnd(prompt_width + self.min_new_tokens, self.eos_ids)]

    def sync_weights(self, model) -> None:
        """No-op: this collector generates with the actor itself, so it always has its weights."""

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """One micro-batch: response ids [b, r] right-padded, mask [b, r], finished [b],
        engine log-probs [b, r] (and hidden states [b, r, H]), 0 on padding."""
        width = int(prompt_mask.sum(dim=1).max())       # drop columns that are padding in every row
        if self.cache == "static":   # widths in steps of STATIC_WIDTH: few cache shapes to compile
            width = -(-width // STATIC_WIDTH) * STATIC_WIDTH
            extra = max(0, width - prompt_ids.shape[1])
            prompt_ids = F.pad(prompt_ids, (extra, 0), value=self.pad_id)
            prompt_mask = F.pad(prompt_mask, (extra, 0), value=False)
        prompt_ids, prompt_mask = prompt_ids[:, -width:], prompt_mask[:, -width:]
        sampled, hidden = _Sampler(self.temperature > 0, self.eos_ids[:1]), []
        scored = [] if self.trainer_scoring is None else [_TrainerLogProb(*self.trainer_scoring)]
        # no_grad, not inference_mode: under FSDP2 the gathered parameters would become
        # inference tensors that the trainer's next all-gather cannot write into. `unsharded`
        # gathers the actor once, so ranks that stop after different numbers of tokens run no
        # collective (a no-op for an unsharded model). A LoRA actor runs on merged weights.
        with torch.no_grad(), unsharded(self.model), merged_weights(self.model), \
                _generation_mode(self.model, self.generation_config):
            cached = {}
            if self.shared_prefix:  # shared prompt tokens prefilled once; generate runs the rest
                prompt_ids, prompt_mask, cached = generation_cache(self.model, prompt_ids,
                                                                   prompt_mask)
                width = prompt_ids.shape[1]
            tracker = _EndTracker(width, len(prompt_ids), self.eos_ids, self.stop_strings,
                                  self.tokenizer, prompt_ids.device, [sampled, *scored],
                                  self.eos_after_stop)
            if self.eos_after_stop:
                sampled.force = tracker.ending
            with _head_inputs(self.model, hidden if self.keep_hidden else None):
                out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(),
                                          generation_config=self.generation_config,
                                          logits_processor=LogitsProcessorList(
                                              [*scored, *self._min_new_tokens(width),
                                               *self._warpers(), sampled]),
                                          stopping_criteria=StoppingCriteriaList([tracker]),
                                          **cached)
        new = out[:, width:]
        ends = torch.where(tracker.lengths >= 0, tracker.lengths, tracker.at_stop)  # no room: stop
        finished = ends >= 0
        lengths = torch.where(finished, ends, new.shape[1])
        mask = torch.arange(new.shape[1], device=new.device) < lengths[:, None]
        r = int(lengths.max())
        part = {schema.RESPONSE_IDS: new.masked_fill(~mask, self.pad_id)[:, :r],
                schema.RESPONSE_MASK: mask[:, :r], schema.FINISHED: finished,
                schema.ENGINE_LOG_PROB: _per_token(sampled.taken, mask)[:, :r]}
        if scored:
            part[schema.ACTOR_LOG_PROB] = _per_token(scored[0].taken, mask)[:, :r]
        if hidden:  # one LM-head call per drawn token: prefill, then each decode step
            states = torch.stack(hidden, dim=1)[:, :r]
            part[schema.ENGINE_HIDDEN] = states * mask[:, :r, None]
        return part


def _per_token(taken: list, mask: torch.Tensor) -> torch.Tensor:
    """The per-step [b] log-probs ``taken`` as one [b, r] float tensor, 0 where ``mask`` is not."""
    if not taken:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return torch.where(mask, torch.stack(taken, dim=1)[:, :mask.shape[1]], 0.0)


def sample_from_scores(scores: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row drawn from ``softmax(scores)`` by inverse CDF, one uniform per row from
    torch's global CPU generator (on every device: a CUDA run draws what a CPU run draws, and a
    checkpoint's CPU RNG state covers it), and its log-prob. The search runs in two levels: over
    the running sums of blocks of ``block`` entries, then inside the chosen block (both in
    float64), so that no [rows, vocab] cumulative sum is built. A token whose score is -inf (masked by top-k /
    top-p / min_new_tokens) is never drawn.

    >>> _ = torch.manual_seed(0)
    >>> tokens, logp = sample_from_scores(torch.tensor([[0.0, -float("inf"), 0.0], [5.0, 5.0, -9.0]]))
    >>> tokens.tolist(), [round(x, 4) for x in logp.tolist()]
    ([2, 1], [-0.6931, -0.6931])
    """
    scores = scores.float()
    rows, vocab = scores.shape
    top = scores.max(dim=-1, keepdim=True).values
    weights = torch.exp(scores - top)                        # in (0, 1]; 0 where masked
    if vocab % block:
        weights = F.pad(weights, (0, block - vocab % block))
    weights = weights.view(rows, -1, block)
    cum = weights.sum(-1).double().cumsum(-1)                # [rows, blocks] running mass
    total = cum[:, -1:]
    u = torch.rand(rows, 1, dtype=torch.float64).to(scores.device) * total
    b = _last_positive(torch.searchsorted(cum, u, right=True), cum.diff(dim=-1, prepend=cum[:, :1] * 0))
    inside = weights[torch.arange(rows, device=scores.device), b.squeeze(1)].double()
    ends = inside.cumsum(-1)
    before = torch.where(b > 0, cum.gather(-1, (b - 1).clamp(min=0)), 0.0)
    u = (u - before) * ends[:, -1:] / cum.gather(-1, b).sub(before).clamp(min=1e-300)
    j = _last_positive(torch.searchsorted(ends, u, right=True), inside)
    tokens = (b * block + j).squeeze(1)
    log_prob = scores.gather(-1, tokens[:, None]) - top - total.log().float()
    return tokens, log_prob.squeeze(-1)


def _last_positive(index: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``index`` [rows, 1], lowered to the last entry of ``mass`` [rows, n] above 0 where it is
    past it (a uniform that rounded up to the total; a search never stops on a zero entry else)."""
    last = mass.shape[1] - 1 - (mass > 0).flip(-1).int().argmax(-1, keepdim=True)
    return torch.minimum(index, last)


class _Sampler(LogitsProcessor):
    """The last logits processor. ``draw``: draws each row's token from the processed scores
    (`sample_from_scores`) and returns a row that is -inf but at that token, so that greedy
    ``generate`` takes it; otherwise (greedy) keeps ``log_softmax`` of the scores. `take` then
    records the log-prob of the tokens ``generate`` appended. ``force`` (set: a callable giving
    a [b] bool mask) makes the rows it marks take ``end`` instead, with its log-prob there."""

    def __init__(self, draw: bool, end: list[int] = ()):
        self.draw, self.log_probs, self.taken, self.end, self.force = draw, None, [], list(end), None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = None if self.force is None else self.force()
        if not self.draw:
            self.log_probs = torch.log_softmax(scores.float(), dim=-1)
            if rows is not None and rows.any():
                scores = scores.masked_fill(rows[:, None], -torch.inf)
                scores[rows, self.end[0]] = 0.0
            return scores
        tokens, self.log_probs = sample_from_scores(scores)
        if rows is not None and rows.any():  # the unforced log-prob of the forced token
            tokens[rows] = self.end[0]
            self.log_probs[rows] = torch.log_softmax(scores[rows].float(), -1)[:, self.end[0]]
        return torch.full_like(scores, -torch.inf).scatter_(1, tokens[:, None], 0.0)

    def take(self, tokens: torch.LongTensor) -> None:
        """Record the log-prob of ``tokens`` [b], the tokens just appended (finished rows get pad,
        whose entry is masked out later)."""
        if self.draw:
            self.taken.append(self.log_probs)
        else:
            self.taken.append(self.log_probs.gather(-1, tokens[:, None]).squeeze(-1))


class _TrainerLogProb(LogitsProcessor):
    """The first logits processor: keeps the logits divided by the trainer's ``temperature``
    (temperature 0, greedy, scores at 1) before any processor changes them, and `take` records
    the appended tokens' log-probs under the trainer's distribution: ``log_softmax``, or
    ``truncation.log_prob`` (a `rlpipe.core.base.truncation.Truncation`), as `response_logprobs`."""

    def __init__(self, temperature: float, truncation=None):
        self.scale, self.truncation = temperature if temperature > 0 else 1.0, truncation
        self.scaled, self.taken = None, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.scaled = scores.float() / self.scale   # a new tensor: later in-place edits miss it
        return scores

    def take(self, tokens: torch.LongTensor) -> None:
        """Record the log-prob of ``tokens`` [b], the tokens just appended."""
        if self.truncation is not None:
            self.taken.append(self.truncation.log_prob(self.scaled, tokens))
        else:
            picked = self.scaled.gather(-1, tokens[:, None]).squeeze(-1)
            self.taken.append(picked - torch.logsumexp(self.scaled, dim=-1))
        self.scaled = None


class _SuppressEnd(LogitsProcessor):
    """Sets the EOS scores to -inf, in place, while the sequences are shorter than ``until``."""

    def __init__(self, until: int, eos_ids: list[int]):
        self.until, self.eos_ids = until, list(eos_ids)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] < self.until:
            scores[:, self.eos_ids] = -torch.inf
        return scores


class _EndTracker(StoppingCriteria):
    """Stops a row at its first EOS token or stop string and records ``lengths``: how many new
    tokens the row had then (EOS / stop tokens included), -1 while it runs; ``at_stop``: the
    same when a stop string ended the text. Called after each token is drawn, it also hands the
    drawn tokens to each of ``takers`` (`_Sampler`, `_TrainerLogProb`: their log-probs). With
    ``then_eos`` a stop string does not stop the row: it is `ending` until its EOS comes."""

    def __init__(self, prompt_width, batch_size, eos_ids, stop_strings, tokenizer, device,
                 takers: list, then_eos: bool = False):
        self.prompt_width, self.stop_strings, self.tokenizer = prompt_width, stop_strings, tokenizer
        self.takers = takers
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.lengths = torch.full((batch_size,), -1, dtype=torch.long, device=device)
        self.at_stop, self.then_eos = self.lengths.clone(), then_eos
        # A stop string of L characters spans at most 4 L tokens (byte-level tokens: 4 per char).
        self.window = 4 * max(map(len, stop_strings), default=0)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_width:]
        for taker in self.takers:
            taker.take(new[:, -1])
        done = torch.isin(new[:, -1], self.eos_ids)
        if self.stop_strings:
            running = ((self.lengths < 0) & (self.at_stop < 0)).nonzero().flatten().tolist()
            texts = self.tokenizer.batch_decode(new[running, -self.window:].tolist(),
                                                skip_special_tokens=True)
            hits = torch.tensor([t.endswith(self.stop_strings) for t in texts], dtype=torch.bool)
            self.at_stop[running] = torch.where(hits.to(done.device), new.shape[1], -1)
            if not self.then_eos:
                done |= self.at_stop >= 0
        self.lengths = torch.where(done & (self.lengths < 0), new.shape[1], self.lengths)
        return self.lengths >= 0

    def ending(self) -> torch.Tensor:
        """[b] bool: the rows whose text ended on a stop string, still waiting for their EOS."""
        return (self.at_stop >= 0) & (self.lengths < 0)


def _world() -> int:
    """Processes in this job (1 without torch.distributed)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextmanager
def _head_inputs(model, into: list | None):
    """Append the LM head's input at the last position of each call to ``into`` ([b, H]; the
    position whose logits ``generate`` draws from), while the block runs; None: nothing."""
    if into is None:
        yield
        return
    head = unwrap(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: into.append(args[0][:, -1]))
    try:
        yield
    finally:
        handle.remove()


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
