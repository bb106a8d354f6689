"""Rollout correction: the sampling engine and the trainer are two implementations of the policy
(another kernel, dtype, or weights one sync behind), so tokens come from π_engine while PPO's
ratio assumes π_old. The importance weight ``w = π_old / π_engine`` of each token (or of each
sequence: the product over its tokens) measures that gap; the ``rollout_correction`` section
chooses what to do with it:

- ``none``: nothing (plain PPO; the ``rollout/*`` metrics still measure the gap);
- ``tis``: truncated importance sampling: the policy-gradient term of each token is weighted
  by ``min(w, C)`` (Yao et al. 2025; verl ``token``/``sequence`` TIS);
- ``mis``: masked importance sampling: weighted by ``w`` where ``1/C <= w <= C``, by 0 outside
  (the token, or the whole sequence, then adds no policy gradient; it still counts in the
  loss's token count, as OpenRLHF's icepop does);
- ``bypass``: the engine's log-probs are π_old (no trainer recompute forward; `Pipeline`).

Pure tensor functions, plus `apply`, the pipeline's thin wrapper: it writes the weights under
``rollout_is_weight`` for a loss that declares ``LossContract.rollout_weights``. Weights are
computed from clamped log-weights in float64, so no sequence-level product overflows.

>>> old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
>>> engine = torch.log(torch.tensor([[0.25, 0.4, 0.9]]))
>>> mask = torch.tensor([[True, True, False]])
>>> correction_weights(log_weights(old, engine, mask), mask, "tis", 1.5).round(decimals=4).tolist()
[[1.5, 0.5, 0.0]]
>>> correction_weights(log_weights(old, engine, mask), mask, "mis", 1.5).tolist()   # 2 and 0.5
[[0.0, 0.0, 0.0]]
>>> w = correction_weights(log_weights(old, engine, mask, "sequence"), mask, "mis", 1.5)
>>> w.round(decimals=4).tolist()   # the sequence's weight is 2 x 0.5
[[1.0, 1.0, 0.0]]
"""

from __future__ import annotations

import math

import torch

from rlpipe.core.step import kl
from rlpipe.core.base import schema
from rlpipe.core.contracts import registry
from rlpipe.core.base.errors import UserError

WEIGHTED = ("tis", "mis")  # the modes whose weights the loss applies
LEVELS = ("token", "sequence")
_MAX_LOG = 700.0  # exp(700) is finite in float64


def log_weights(old_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor,
                level: str = "token") -> torch.Tensor:
    """[B, R] float64 ``log w``: ``log π_old - log π_engine`` per token, or with
    ``level="sequence"`` the sum over the sequence's tokens on each of them; 0 on padding.

    >>> log_weights(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]),
    ...             torch.tensor([[True, True]]), "sequence").tolist()
    [[-0.5, -0.5]]
    """
    if level not in LEVELS:
        raise UserError(f"rollout_correction.level must be one of {', '.join(LEVELS)}, got {level!r}")
    log_w = torch.where(mask, old_log_prob.double() - engine_log_prob.double(), 0.0)
    if level == "sequence":
        log_w = torch.where(mask, log_w.sum(-1, keepdim=True), 0.0)
    return log_w


def correction_weights(log_w: torch.Tensor, mask: torch.Tensor, mode: str,
                       threshold: float) -> torch.Tensor:
    """[B, R] float32 weight of each token's policy-gradient term from `log_weights`: ``tis``
    ``min(w, C)``, ``mis`` ``w`` inside ``[1/C, C]`` else 0, with ``C = threshold``; 0 on
    padding."""
    if mode not in WEIGHTED:
        raise ValueError(f"correction_weights: mode must be one of {WEIGHTED}, got {mode!r}")
    bound = math.log(threshold)
    if mode == "tis":
        weight = torch.exp(log_w.clamp(max=bound))
    else:
        weight = torch.where(log_w.abs() <= bound, torch.exp(log_w.clamp(-bound, bound)), 0.0)
    return torch.where(mask, weight, 0.0).float()


def _units(log_w: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The weights' units: every valid token, or one entry per non-empty sequence."""
    if level == "sequence":
        return log_w[:, 0][mask.any(-1)]
    return log_w[mask]


def diagnostics(old_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor,
                level: str = "token", weights: torch.Tensor | None = None) -> dict[str, float]:
    """The ``rollout/*`` metrics of a batch, from the raw (uncorrected) weights at ``level``:
    their mean and max over tokens (or non-empty sequences), the normalised effective sample
    size ``(sum w)^2 / (n sum w^2)`` (1: no mismatch), the per-token mismatch KL(π_engine ||
    π_old) (k3 estimator, >= 0) and the fraction of valid tokens that ``weights`` (the applied
    `correction_weights`, if any) zero out.

    >>> m = torch.tensor([[True, True]])
    >>> d = diagnostics(torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.5]])), m)
    >>> [round(d[f"rollout/{k}"], 4) for k in ("is_weight_mean", "is_weight_max", "ess")]
    [1.5, 2.0, 0.9]
    """
    units = _units(log_weights(old_log_prob, engine_log_prob, mask, level), mask, level)
    w = torch.exp(units.clamp(-_MAX_LOG, _MAX_LOG))
    scaled = torch.exp(units - units.max()) if units.numel() else units  # ESS without overflow
    n = max(w.numel(), 1)
    token_log_w = log_weights(old_log_prob, engine_log_prob, mask)[mask].clamp(-_MAX_LOG, _MAX_LOG)
    mismatch = kl.estimate(-token_log_w, "k3")  # log π_engine - log π_old at engine samples
    masked = 0.0
    if weights is not None:
        masked = float(((weights == 0) & mask).sum()) / max(int(mask.sum()), 1)
    return {"rollout/is_weight_mean": float(w.sum()) / n,
            "rollout/is_weight_max": float(w.max()) if w.numel() else 0.0,
            "rollout/ess": float(scaled.sum() ** 2 / (n * (scaled * scaled).sum())) if w.numel() else 1.0,
            "rollout/mismatch_kl": float(mismatch.sum()) / max(mismatch.numel(), 1),
            "rollout/masked_frac": masked}


def check_engine_log_prob(batch, mode: str, collector) -> None:
    """A mode other than ``none`` needs the engine's log-probs finite on every response token:
    one line naming the collector (the engine is the culprit, not the actor or the learning
    rate)."""
    if mode == "none":
        return
    who = registry.label_of(collector)
    mask = schema.action_mask(batch)
    bad = int((~torch.isfinite(batch[schema.ENGINE_LOG_PROB]) & mask).sum())
    if bad:
        raise UserError(f"the engine's log-probs ({schema.ENGINE_LOG_PROB!r} of the {who}) are NaN "
                        f"or inf on {bad} of {int(mask.sum())} response tokens, which "
                        f"rollout_correction.mode: {mode} uses; the engine is at fault (its "
                        f"sampling dtype or processors), not the actor: fix it or use mode: none")


def check_masked(weights: torch.Tensor, mask: torch.Tensor, settings) -> None:
    """``mis`` that masks more than ``max_masked_frac`` of the valid tokens trains on almost
    nothing: one line instead of a run that silently learns nothing."""
    total = int(mask.sum())
    masked = int(((weights == 0) & mask).sum())
    if total and masked / total > settings.max_masked_frac:
        raise UserError(f"rollout_correction.mode: {settings.mode} masked {masked} of {total} "
                        f"response tokens ({masked / total:.0%} > max_masked_frac "
                        f"{settings.max_masked_frac}): the engine's log-probs and the actor's "
                        f"differ by more than threshold {settings.threshold} (level "
                        f"{settings.level}) on most tokens; compare them with `rlpipe check "
                        f"CONFIG`, fix the engine, or raise the threshold")


def apply(batch, settings) -> dict[str, float]:
    """Stage 4 of the loop, on the gathered batch: with ``tis``/``mis`` write
    ``rollout_is_weight``; return the ``rollout/*`` metrics (none with ``bypass``, where π_old is
    the engine's own and there is no gap to measure)."""
    if settings.mode == "bypass":
        return {}
    mask = schema.action_mask(batch)
    old, engine = batch[schema.OLD_LOG_PROB], batch[schema.ENGINE_LOG_PROB]
    weights = None
    if settings.mode in WEIGHTED:
        log_w = log_weights(old, engine, mask, settings.level)
        weights = correction_weights(log_w, mask, settings.mode, settings.threshold)
        check_masked(weights, mask, settings)
        batch[schema.ROLLOUT_IS_WEIGHT] = weights
    return diagnostics(old, engine, mask, settings.level, weights)
