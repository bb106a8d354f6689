"""KL to the reference policy: per-token estimators, reward shaping, and the KL coefficient.

The shaped token reward is ``-coef * KL`` on every valid response token, plus the sequence
``score`` on the last valid token (DESIGN.md, correctness rules).

>>> import torch
>>> logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
>>> kl = kl_per_token(logp, ref)
>>> shape_reward(torch.tensor([1.0]), kl, torch.tensor([[True, True]]), coef=0.1).tolist()
[[-0.05000000074505806, 1.0]]
"""

from __future__ import annotations

import torch

from rlpipe.core.errors import UserError
from rlpipe.core.ops import last_token_index

ESTIMATORS = ("k1", "k2", "k3")


def kl_per_token(log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                 estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman,
    "Approximating KL divergence"): k1 = logp - ref, k2 = (logp - ref)^2 / 2,
    k3 = exp(ref - logp) - (ref - logp) - 1.

    >>> kl_per_token(torch.tensor([0.0]), torch.tensor([-1.0]), "k2").item()
    0.5
    """
    log_ratio = log_prob - ref_log_prob
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise UserError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def shape_reward(score: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                 coef: float | torch.Tensor) -> torch.Tensor:
    """[B, R] token reward: ``-coef * kl`` on valid tokens, 0 on padding, plus ``score[b]`` on the
    last valid token of row ``b`` (EOS, or the last token of a truncated response). A row with
    no valid token (zero-length response) gets no score: it is all 0.

    >>> shape_reward(torch.tensor([2.0, 3.0]), torch.ones(2, 3),
    ...              torch.tensor([[True, False, False], [False, False, False]]), 0.5).tolist()
    [[1.5, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    reward = torch.where(mask, -coef * kl, 0)
    last = last_token_index(mask)
    bonus = torch.where(last >= 0, score.to(reward.dtype), 0)
    return reward.scatter_add(-1, last.clamp_min(0).unsqueeze(-1), bonus.unsqueeze(-1))


class FixedKLController:
    """A constant KL coefficient.

    >>> ctl = FixedKLController(0.05)
    >>> ctl.update(current_kl=3.0, n_steps=64)
    >>> ctl.value
    0.05
    """

    def __init__(self, coef: float):
        if not coef >= 0:
            raise UserError(f"KL coefficient must be >= 0, got {coef!r}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient as it is."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered towards ``target`` (Ziegler et al. 2019, arXiv 1909.08593):
    ``e = clip(kl / target - 1, -0.2, 0.2)``, then ``coef *= 1 + e * n_steps / horizon``.

    >>> ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    >>> ctl.update(current_kl=12.0, n_steps=1_000)
    >>> round(ctl.value, 6)
    0.102
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if not (init_coef >= 0 and target > 0 and horizon > 0):
            raise UserError("adaptive KL controller needs init_coef >= 0, target > 0 and "
                            f"horizon > 0, got {init_coef!r}, {target!r}, {horizon!r}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
