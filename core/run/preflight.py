"""The mismatch preflight (``rlpipe check CONFIG``, or ``run.preflight: true`` before step 1):
sample one batch with the run's collector, score it with the trainer's forward (weights untouched,
as at learning rate 0), and compare the engine's log-probs with the trainer's.

It catches, before a run is spent on them: an engine with stale or wrongly synced weights, a
dtype or kernel mismatch, a wrong temperature, top-k/top-p sampling scored without
``collector.score_truncated``. It prints the mean and max per-token |Δ log-prob|, the per-token
mismatch KL(π_engine || π_trainer) (k3) and the sequence-level importance weights
``π_trainer / π_engine``, and fails on one line (`PreflightFailed`) when the KL exceeds
``run.preflight_max_kl`` or the mean |Δ| exceeds ``run.preflight_max_gap``. The data order and
the RNG streams are restored afterwards, so a run with the preflight trains exactly as one
without it (an engine's own sampler state, e.g. vLLM's, moves on).

>>> mask = torch.tensor([[True, True, False]])
>>> m = measure(torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.0, -1.5, 0.0]]), mask)
>>> m.gap_mean, m.gap_max, m.tokens, m.sequences
(0.25, 0.5, 2, 1)
>>> m.failure(max_kl=0.01, max_gap=0.1)
'mean |Δ log-prob| 0.25 > run.preflight_max_gap=0.1, mismatch KL 0.0744 per token > run.preflight_max_kl=0.01'
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import torch

from rlpipe.core.contracts import guards, registry
from rlpipe.core.step import kl
from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError
from rlpipe.core.models.lm import response_logprobs

S = schema
_INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)


class PreflightFailed(UserError):
    """The engine's and the trainer's log-probs differ beyond the configured thresholds."""


@dataclass(frozen=True)
class Mismatch:
    """Engine vs trainer log-probs over one batch (`measure`)."""

    tokens: int
    sequences: int
    gap_mean: float      # mean |log π_engine - log π_trainer| per valid token
    gap_max: float
    kl: float            # mean per-token k3 estimate of KL(π_engine || π_trainer)
    seq_weight_min: float  # π_trainer(sequence) / π_engine(sequence) over non-empty sequences
    seq_weight_mean: float
    seq_weight_max: float

    def lines(self) -> list[str]:
        return [f"preflight: {self.sequences} sequences, {self.tokens} response tokens",
                f"  |Δ log-prob| per token: mean {self.gap_mean:.3g}, max {self.gap_max:.3g}",
                f"  mismatch KL(engine || trainer) per token: {self.kl:.3g}",
                f"  sequence IS weight π_trainer/π_engine: min {self.seq_weight_min:.4g}, "
                f"mean {self.seq_weight_mean:.4g}, max {self.seq_weight_max:.4g}"]

    def failure(self, max_kl: float, max_gap: float) -> str | None:
        """What exceeds its threshold, or None."""
        over = []
        if not self.gap_mean <= max_gap:
            over.append(f"mean |Δ log-prob| {self.gap_mean:.3g} > run.preflight_max_gap={max_gap:g}")
        if not self.kl <= max_kl:
            over.append(f"mismatch KL {self.kl:.3g} per token > run.preflight_max_kl={max_kl:g}")
        return ", ".join(over) or None


def measure(engine_log_prob: torch.Tensor, trainer_log_prob: torch.Tensor,
            mask: torch.Tensor) -> Mismatch:
    """`Mismatch` of two [B, R] log-prob tensors over the true entries of ``mask`` (float64)."""
    delta = torch.where(mask, trainer_log_prob.double() - engine_log_prob.double(), 0.0)
    gap = delta[mask].abs()
    per_token_kl = kl.estimate(-delta[mask].clamp(-700, 700), "k3")
    seq = torch.exp(delta.sum(-1)[mask.any(-1)].clamp(-700, 700))
    n = max(int(mask.sum()), 1)
    empty = seq.numel() == 0
    return Mismatch(tokens=int(mask.sum()), sequences=int(mask.any(-1).sum()),
                    gap_mean=float(gap.sum()) / n, gap_max=float(gap.max()) if gap.numel() else 0.0,
                    kl=float(per_token_kl.sum()) / n,
                    seq_weight_min=1.0 if empty else float(seq.min()),
                    seq_weight_mean=1.0 if empty else float(seq.mean()),
                    seq_weight_max=1.0 if empty else float(seq.max()))


@contextlib.contextmanager
def _restored(pipe):
    """The prompt stream's position and the torch / Python RNG states, as they were."""
    p = pipe.prompts
    saved = (p.generator.get_state(), list(p.order), p.position, torch.get_rng_state(),
             random.getstate())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        p.generator.set_state(saved[0])
        p.order, p.position = saved[1], saved[2]
        torch.set_rng_state(saved[3])
        random.setstate(saved[4])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@torch.no_grad()
def sample_and_score(pipe) -> Mismatch:
    """One batch from ``pipe``'s collector (this rank's share), the actor's log-probs of it
    (``forward_batch_size`` chunks, the run's temperature and truncation), gathered over ranks."""
    collector = pipe.plugins.collector
    with _restored(pipe), pipe.models.compute():
        pipe.models.actor.eval()
        rows = pipe.dist.share(pipe.prompts.next_batch())
        batch = guards.check_output(registry.call(collector.collect, pipe.data.texts(rows)),
                                    collector, required=(*_INPUTS, S.GROUP_ID, S.FINISHED,
                                                         S.ENGINE_LOG_PROB))
    batch = batch.to(pipe.device)
    chunks = [[c[k] for k in _INPUTS] for c in batch.split(pipe.cfg.train.forward_batch_size)]
    with pipe.models.compute():
        batch[S.OLD_LOG_PROB] = torch.cat([
            response_logprobs(pipe.models.actor, *c, pipe.temperature, truncation=pipe.truncation,
                              shared_prefix=pipe.models.shared_prefix,
                              packed=pipe.models.packed,
                              compiled=pipe.models.compile_logprobs)[0]
            for c in chunks])
    batch = pipe.dist.gather(batch)
    return measure(batch[S.ENGINE_LOG_PROB], batch[S.OLD_LOG_PROB], batch[S.RESPONSE_MASK])


def _hint(pipe) -> str:
    """The likeliest cause worth naming: truncated sampling scored untruncated."""
    top_k, top_p = pipe.sampling.top_k, pipe.sampling.top_p
    if pipe.temperature > 0 and (top_k > 0 or top_p < 1) and pipe.truncation is None:
        return (f"; sampling is truncated (top_k={top_k}, top_p={top_p}) but the trainer scores "
                f"the full distribution: set collector.score_truncated: true")
    return ("; check the engine's weights (sync), dtype and sampling settings against the "
            "trainer's")


def check(pipe, echo=print) -> Mismatch:
    """Run the preflight on ``pipe``: report on the main rank through ``echo``; raise
    `PreflightFailed` (one line) above ``run.preflight_max_kl`` / ``run.preflight_max_gap``."""
    mismatch = sample_and_score(pipe)
    if pipe.dist.is_main:
        for line in mismatch.lines():
            echo(line)
    run = pipe.cfg.run
    failure = mismatch.failure(run.preflight_max_kl, run.preflight_max_gap)
    if failure:
        raise PreflightFailed(f"preflight: the engine and the trainer disagree: {failure}"
                              f"{_hint(pipe)}")
    if pipe.dist.is_main:
        echo(f"preflight passed (run.preflight_max_kl={run.preflight_max_kl:g}, "
             f"run.preflight_max_gap={run.preflight_max_gap:g})")
    return mismatch
