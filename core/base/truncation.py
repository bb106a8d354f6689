"""Truncation-aware log-probs: score a token under the top-k / top-p distribution it was sampled
from, renormalised over the kept tokens, as the sampler did.

With ``top_k > 0`` or ``top_p < 1`` a sampler draws from the truncated distribution
``p(a) / sum_{b in kept} p(b)`` over the kept set, while a trainer that scores with a plain
``log_softmax`` uses ``p(a)``: every ratio against the engine's log-probs is then off by the
kept mass ``log sum_{b in kept} p(b)``, a bias that grows as the policy sharpens. With
``collector.score_truncated: true`` the trainer's ``old_log_prob`` and the update's ``log_prob``
use `truncated_log_prob` instead, so both sides of every ratio score the sampled distribution.

The kept set follows Hugging Face ``generate`` (and vLLM, which filters the same way) on the
logits already divided by the temperature: top-k keeps every token at least as large as the k-th
largest (ties kept), then top-p, on what top-k kept, drops the smallest tokens whose cumulative
probability stays at or below ``1 - top_p`` (the largest is always kept). The token being scored
is always in the set: a sampler drew it, so when round-off moves it just outside the trainer's
set, the set is widened by it rather than scored as log 0 = -inf.

>>> logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
>>> keep_mask(logits, top_k=0, top_p=0.7).tolist()        # 0.5 + 0.3 covers 0.7
[[True, True, False, False]]
>>> round(truncated_log_prob(logits, torch.tensor([1]), top_p=0.7).exp().item(), 6)  # 0.3 / 0.8
0.375
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """The sampler's truncation: ``top_k`` (0: off) and ``top_p`` (1: off)."""

    top_k: int = 0
    top_p: float = 1.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def log_prob(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`truncated_log_prob` with these settings."""
        return truncated_log_prob(logits, tokens, top_k=self.top_k, top_p=self.top_p)


def keep_mask(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Bool mask over the last dim of ``logits`` (already divided by the temperature): the tokens
    that top-k and then top-p keep, as ``generate`` filters them.

    >>> keep_mask(torch.tensor([[3.0, 1.0, 2.0, 2.0]]), top_k=2).tolist()   # ties at the k-th kept
    [[True, False, True, True]]
    """
    logits = logits.detach()
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        keep = logits >= kth
    if top_p < 1.0:
        filtered = logits.masked_fill(~keep, float("-inf"))
        ascending, order = torch.sort(filtered, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False                            # the largest token is always kept
        keep = keep & ~drop.scatter(-1, order, drop)
    return keep


def truncated_log_prob(logits: torch.Tensor, tokens: torch.Tensor, top_k: int = 0,
                       top_p: float = 1.0) -> torch.Tensor:
    """log-prob of ``tokens`` (shape ``logits.shape[:-1]``) under ``softmax(logits)`` restricted to
    `keep_mask` and renormalised; the scored token always counts as kept. Differentiable in
    ``logits`` (the kept set itself is not: it is chosen from detached values). With neither
    filter on it equals ``log_softmax(logits)`` at ``tokens``.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0]])
    >>> round(truncated_log_prob(logits, torch.tensor([0]), top_k=1).item(), 6)   # alone: log 1
    0.0
    >>> round(truncated_log_prob(logits, torch.tensor([2]), top_k=1).exp().item(), 4)  # widened
    0.1192
    """
    keep = keep_mask(logits, top_k, top_p).scatter(-1, tokens.unsqueeze(-1), True)
    log_norm = torch.logsumexp(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
