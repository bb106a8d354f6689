"""CISPO (MiniMax 2025, "MiniMax-M1", clipped IS-weight policy optimization): clip the
importance-sampling weight, not the update, so that every token keeps its gradient.

Each token's loss is ``-sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi(a_t)`` with
``r_t = pi(a_t) / pi_old(a_t)`` and ``sg`` the stop-gradient: its gradient is the weighted
REINFORCE term ``-w_t A_t grad log pi(a_t)``, also on tokens whose ratio left the clip range
(which PPO's clip would silence). ``clip_low: null`` (the default, as in the paper) leaves the
weight without a lower bound; ``clip_high`` bounds it above (the paper tunes only this one; 0.2
is verl's example). The default ``agg: token-mean`` is the paper's normalisation by all the
tokens of the minibatch. Critic, entropy bonus, ``kl.in: loss`` and ``rollout_is_weight`` (a
second factor on each token's term) are `rlpipe.plugins.losses.ppo.PolicyGradientLoss`'s.
``policy/clipfrac`` counts tokens whose weight was cut at ``1 + clip_high``,
``policy/clipfrac_lower`` at ``1 - clip_low``.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.LOG_PROB: torch.tensor([[-1.0, -2.0]]),
...                  schema.OLD_LOG_PROB: torch.tensor([[-1.0, -2.0]]),
...                  schema.ADVANTAGE: torch.tensor([[1.0, 1.0]]),
...                  schema.RESPONSE_MASK: torch.tensor([[True, True]])}, batch_size=[1])
>>> CISPOLoss()(td)["loss_objective"].item()  # -(1 * 1 * -1 + 1 * 1 * -2) / 2
1.5
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlpipe.plugin import UserError
from rlpipe.plugins.losses.ppo import PolicyGradientLoss, PPOLoss, check_args


def cispo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                      advantage: torch.Tensor, *, clip_low: float | None, clip_high: float,
                      log_ratio_clamp: float = 20.0):
    """Per-token CISPO loss ``-sg(w) * A * log_prob``, ``w = clip(r, 1 - clip_low, 1 +
    clip_high)`` (no lower bound for ``clip_low=None``). Returns ``(loss, clipped,
    clipped_lower, log_ratio)``: ``clipped`` where ``w < r``, ``clipped_lower`` where ``w > r``;
    ``log_ratio`` is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before ``exp``.

    >>> lp = torch.tensor([0.0], requires_grad=True)
    >>> loss, clipped, _, _ = cispo_policy_loss(lp, torch.tensor([-1.0]), torch.tensor([2.0]),
    ...                                         clip_low=None, clip_high=0.5)
    >>> loss.backward()
    >>> loss.item(), clipped.item(), lp.grad.item()  # w = 1.5, not e: -1.5 * 2 * d log_prob
    (-0.0, True, -3.0)
    """
    log_ratio = (log_prob - old_log_prob).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(None if clip_low is None else 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantage * log_prob
    return loss, weight < ratio, weight > ratio, log_ratio


class CISPOLoss(PolicyGradientLoss):
    """CISPO loss over a micro-batch (module docstring); the same entries as
    `rlpipe.plugins.losses.ppo.PPOLoss`, token means all.

    Args:
        clip_low: the IS weight is raised to at least 1 - clip_low (null: no lower bound, the paper)
        clip_high: the IS weight is cut to at most 1 + clip_high (verl's example: 0.2)
        log_ratio_clamp: bound on log(pi / pi_old) before exp
        vf_coef: weight of the critic loss
        value_clip: clip the new value to old +- value_clip (null: off; a fresh value head: off)
        value_loss: mse or huber
        entropy_coef: entropy bonus (0: off)
        agg: token-mean (the paper), seq-mean-token-mean or seq-mean-token-sum
        lower_bound: allow a clip_low (a floor the paper does not have); false: refused

    >>> CISPOLoss().clip_low, CISPOLoss().clip_high, CISPOLoss(clip_low=0.5, lower_bound=True).clip_low
    (None, 0.2, 0.5)
    """

    NAME = "cispo"
    contract, out_keys = PPOLoss.contract, PPOLoss.out_keys  # the same entries, token means all

    def __init__(self, *, clip_low: float | None = None, clip_high: float = 0.2,
                 log_ratio_clamp: float = 20.0, vf_coef: float = 0.5,
                 value_clip: float | None = 0.2, value_loss: str = "mse",
                 entropy_coef: float = 0.0, agg: str = "token-mean", lower_bound: bool = False):
        super().__init__()
        check_args(self.NAME, {"clip_low": (clip_low, "null or a number > 0", lambda x: x > 0),
                               "clip_high": (clip_high, "a number > 0", lambda x: x > 0)})
        if clip_low is not None and lower_bound is not True:
            raise UserError(f"loss 'cispo': clip_low={clip_low:g} puts a floor under the IS weight, "
                            f"which CISPO (the paper) does not have (PPO's clip_low, kept from a PPO "
                            f"config?); set lower_bound: true to keep it, or clip_low: null")
        self.clip_low, self.clip_high = clip_low, clip_high
        self.setup(log_ratio_clamp=log_ratio_clamp, vf_coef=vf_coef, value_clip=value_clip,
                   value_loss=value_loss, entropy_coef=entropy_coef, agg=agg)

    def policy_objective(self, td: TensorDictBase, mask: torch.Tensor, agg, weight):
        """The weighted log-likelihood terms (`cispo_policy_loss`) and their token means."""
        keys = self.tensor_keys
        loss, clipped, clipped_lower, log_ratio = cispo_policy_loss(
            td.get(keys.log_prob), td.get(keys.old_log_prob), td.get(keys.advantage),
            clip_low=self.clip_low, clip_high=self.clip_high,
            log_ratio_clamp=self.log_ratio_clamp)
        return self.token_objective(loss, clipped, clipped_lower, log_ratio, mask, agg, weight)
