"""KL to the reference policy, in one place: the per-token estimators, where the penalty acts
(`split_coef`: the reward or the loss), reward shaping, the loss term, and the coefficient's
controllers. Loss plugins use the same estimators for their own KL metrics.

The shaped token reward is ``-coef * KL`` on every valid response token, plus the sequence
``score`` on the last valid token (DESIGN.md, correctness rules); with ``kl.in: loss`` the reward
carries the score alone and `loss_term` adds ``coef * KL`` (a masked token mean) to the loss.

>>> import torch
>>> logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
>>> kl = kl_per_token(logp, ref)
>>> shape_reward(torch.tensor([1.0]), kl, torch.tensor([[True, True]]), coef=0.1).tolist()
[[-0.05000000074505806, 1.0]]
"""

from __future__ import annotations

import torch

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.ops import last_token_index

ESTIMATORS = ("k1", "k2", "k3")
WHERE = ("reward", "loss")
def estimate(log_ratio: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(q || p) from ``log_ratio = log q(x) - log p(x)`` at tokens ``x``
    sampled from q (Schulman, "Approximating KL divergence"): k1 = log_ratio (unbiased, may be
    negative), k2 = log_ratio^2 / 2 (biased, >= 0), k3 = exp(-log_ratio) - 1 + log_ratio
    (unbiased, >= 0).

    >>> [round(estimate(torch.tensor([0.5]), e).item(), 4) for e in ESTIMATORS]
    [0.5, 0.125, 0.1065]
    """
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise UserError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def kl_per_token(log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                 estimator: str = "k1", clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi: `estimate` of
    ``log_prob - ref_log_prob``; k1 = logp - ref, k2 = (logp - ref)^2 / 2,
    k3 = exp(ref - logp) - (ref - logp) - 1.

    ``clamp`` (``kl.clamp``) bounds the log-ratio to ``[-clamp, clamp]`` before the estimator,
    so that no estimate and no gradient overflows (k3 at a log-ratio of -100 is
    ``exp(100)``, inf in float32); log-ratios inside the bounds are left exactly as they are.
    NaN stays NaN (a broken model is an error, `rlpipe.core.contracts.guards.check_kl`).

    >>> kl_per_token(torch.tensor([0.0]), torch.tensor([-1.0]), "k2").item()
    0.5
    >>> kl_per_token(torch.tensor([-100.0]), torch.tensor([0.0]), "k3").item()  # float32: inf
    inf
    >>> kl_per_token(torch.tensor([-100.0]), torch.tensor([0.0]), "k3", clamp=10).item()
    22015.46484375
    """
    log_ratio = log_prob - ref_log_prob
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return estimate(log_ratio, estimator)


def split_coef(where: str, coef: float) -> tuple[float, float]:
    """``(reward_coef, loss_coef)``: the coefficient goes where the penalty acts (``kl.in``),
    0 to the other place.

    >>> split_coef("reward", 0.05), split_coef("loss", 0.05)
    ((0.05, 0.0), (0.0, 0.05))
    """
    if where not in WHERE:
        raise UserError(f"kl.in must be one of {', '.join(WHERE)}, got {where!r}")
    return (coef, 0.0) if where == "reward" else (0.0, coef)


def loss_term(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor,
              coef: float | torch.Tensor, num_tokens: torch.Tensor | float,
              estimator: str = "k1", clamp: float | None = None) -> torch.Tensor:
    """The ``kl.in: loss`` term: ``coef * sum of kl_per_token over valid tokens / num_tokens``
    (``num_tokens`` is the minibatch-wide count, so the terms of a minibatch's micro-batches add
    up to its token mean; a count below 1 counts as 1). Differentiable in ``log_prob``;
    ``clamp`` as in `kl_per_token` (a clamped token has no gradient).

    >>> loss_term(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, 5.0]]),
    ...           torch.tensor([[True, False]]), coef=0.5, num_tokens=1.0, estimator="k2").item()
    0.25
    """
    kl_sum = torch.where(mask, kl_per_token(log_prob, ref_log_prob, estimator, clamp), 0.0).sum()
    return coef * kl_sum / torch.as_tensor(num_tokens).clamp(min=1)


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
        """A coefficient of 0 is refused: the controller multiplies it, so it would stay 0 (no
        KL penalty at all, whatever the KL).

        >>> AdaptiveKLController(init_coef=0.0, target=0.1, horizon=10_000)
        Traceback (most recent call last):
        rlpipe.core.base.errors.UserError: kl.coef: 0 with kl.target: 0.1: the adaptive controller multiplies the coefficient, so it would stay 0 and the KL never be penalised; set kl.coef > 0 (the starting value, e.g. 0.05), or kl.target: null for no KL penalty
        """
        if init_coef == 0 and target is not None and target > 0:
            raise UserError(f"kl.coef: 0 with kl.target: {target:g}: the adaptive controller "
                            f"multiplies the coefficient, so it would stay 0 and the KL never be "
                            f"penalised; set kl.coef > 0 (the starting value, e.g. 0.05), or "
                            f"kl.target: null for no KL penalty")
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


class KLPenalty:
    """A run's KL penalty in one object: its estimator and clamp, where it acts (``kl.in``) and
    its coefficient (fixed, or adaptive with ``kl.target``). The loop, the trainer and the samples
    writer all use it, so each term has one implementation.

    >>> from types import SimpleNamespace
    >>> penalty = KLPenalty(SimpleNamespace(estimator="k2", clamp=None, in_="loss", coef=0.1,
    ...                                     target=None, horizon=1))
    >>> penalty.coef, penalty.reward_coef, penalty.loss_coef
    (0.1, 0.0, 0.1)
    >>> penalty.per_token(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, 5.0]]),
    ...                   torch.tensor([[True, False]])).tolist()
    [[0.5, 0.0]]
    """

    def __init__(self, settings):
        self.estimator, self.clamp, self.where = settings.estimator, settings.clamp, settings.in_
        self.controller = (AdaptiveKLController(settings.coef, settings.target, settings.horizon)
                           if settings.target is not None else FixedKLController(settings.coef))

    @property
    def coef(self) -> float:
        return self.controller.value

    @property
    def reward_coef(self) -> float:
        return split_coef(self.where, self.coef)[0]

    @property
    def loss_coef(self) -> float:
        return split_coef(self.where, self.coef)[1]

    def per_token(self, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """[B, R] estimate of KL(pi || pi_ref) on valid tokens, 0 on padding."""
        return kl_per_token(log_prob, ref_log_prob, self.estimator, self.clamp) * mask

    def shape_reward(self, score: torch.Tensor, kl_tok: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """The token reward (`shape_reward`) with this step's reward coefficient."""
        return shape_reward(score, kl_tok, mask, self.reward_coef)

    def loss_term(self, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor,
                  num_tokens) -> torch.Tensor | None:
        """`loss_term` with this run's estimator, clamp and loss coefficient; None when the
        penalty acts in the reward (``kl.in: reward``) or its coefficient is 0."""
        if not self.loss_coef:
            return None
        return loss_term(log_prob, ref_log_prob, mask, self.loss_coef, num_tokens,
                         self.estimator, self.clamp)

    def update(self, seq_kl: float, n_samples: int) -> None:
        """After a step: the controller sees the step's mean sequence KL."""
        self.controller.update(seq_kl, n_samples)

    def state_dict(self) -> dict:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state)
