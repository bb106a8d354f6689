"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", Qwen team): the importance
ratio and its clip are per sequence, not per token.

``s_i = exp((1/|y_i|) sum_t (log pi(y_it) - log pi_old(y_it)))`` is the length-normalised
sequence ratio, and sequence ``i`` has the loss ``max(-A_i s_i, -A_i clip(s_i, 1 - clip_low,
1 + clip_high))``, with ``A_i`` its sequence advantage (the mean of its tokens' advantages: the
advantage itself for grpo, rloo and reinforce_pp, which give every token of a response the same
one). This is the paper's sequence form: the gradient of ``s_i`` reaches every token of the
sequence as ``s_i / |y_i| * grad log pi(y_it)``. With a per-sequence advantage it is also
GSPO-token's gradient (``s_it = sg[s_i] pi(y_it) / sg[pi(y_it)]``, verl's ``gspo``), term for
term (tests/test_gspo_cispo.py). Every token of the sequence carries the sequence's loss, so
the default ``agg: seq-mean-token-mean`` is the paper's mean over sequences; the clip range is
small (the paper: 3e-4 / 4e-4) because a sequence ratio moves far less than a token's.

Critic, entropy bonus, ``kl.in: loss`` and ``rollout_is_weight`` (each token's copy of the
sequence loss times its weight) are `rlpipe.plugins.losses.ppo.PolicyGradientLoss`'s.
``policy/loss`` and ``policy/clipfrac`` (the fraction of sequences clipped) are means over
sequences (``"seq"`` in the contract); ``policy/approx_kl`` is PPO's token-level k2.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.LOG_PROB: torch.tensor([[0.1, 0.1, 0.0]]),
...                  schema.OLD_LOG_PROB: torch.zeros(1, 3), schema.ADVANTAGE: torch.ones(1, 3),
...                  schema.RESPONSE_MASK: torch.tensor([[True, True, False]])}, batch_size=[1])
>>> round(GSPOLoss(clip_low=0.2, clip_high=0.2, wide_clip=True)(td)["loss_objective"].item(), 4)  # -exp(0.1)
-1.1052
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlpipe.plugin import LossContract, UserError, kl, masked_mean
from rlpipe.plugins.losses.ppo import VALUE_KEYS, VALUE_METRICS, PolicyGradientLoss, check_args


def gspo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                     advantage: torch.Tensor, mask: torch.Tensor, *, clip_low: float,
                     clip_high: float, log_ratio_clamp: float = 20.0):
    """Per-sequence GSPO loss ``max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))``
    from [B, R] token tensors (module docstring). Returns ``(loss, clipped, seq_log_ratio)``,
    each [B]: ``clipped`` is true where the clipped term is the larger, ``seq_log_ratio`` is
    ``log s_i`` clamped to ``[-log_ratio_clamp, log_ratio_clamp]``. A row with no valid token
    has ``s_i = 1`` and ``A_i = 0``; padding is never read.

    >>> loss, clipped, log_s = gspo_policy_loss(
    ...     torch.tensor([[0.3, 0.1]]), torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]),
    ...     torch.tensor([[True, True]]), clip_low=0.1, clip_high=0.1)
    >>> round(log_s.item(), 4), round(loss.item(), 4), clipped.item()  # s = e^0.2 = 1.2214
    (0.2, 1.2214, False)
    """
    lengths = mask.sum(-1).clamp_min(1)
    seq_log_ratio = (torch.where(mask, log_prob - old_log_prob, 0).sum(-1) / lengths).clamp(
        -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(seq_log_ratio)
    seq_advantage = torch.where(mask, advantage, 0).sum(-1) / lengths
    unclipped = -seq_advantage * ratio
    clipped_loss = -seq_advantage * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped, seq_log_ratio


class GSPOLoss(PolicyGradientLoss):
    """GSPO loss over a micro-batch (module docstring); the same entries as
    `rlpipe.plugins.losses.ppo.PPOLoss` but ``policy/clipfrac_lower``.

    Args:
        clip_low: sequence ratio clip below 1: s >= 1 - clip_low (the paper: 3e-4)
        clip_high: sequence ratio clip above 1: s <= 1 + clip_high (the paper: 4e-4)
        log_ratio_clamp: bound on log(pi / pi_old) before exp
        vf_coef: weight of the critic loss
        value_clip: clip the new value to old +- value_clip (null: off; a fresh value head: off)
        value_loss: mse or huber
        entropy_coef: entropy bonus (0: off)
        agg: seq-mean-token-mean (the paper's mean over sequences), token-mean or seq-mean-token-sum
        wide_clip: allow a clip above 0.01 (a sequence ratio, the geometric mean of its tokens'
            ratios, moves about 1e-3 per update: PPO's 0.2 would never clip); false: refused

    >>> GSPOLoss(clip_low=0.2)
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: loss 'gspo': clip_low=0.2: a per-token (PPO-scale) clip range; GSPO clips the sequence ratio, which moves about 1e-3 per update (the paper: clip_low 3e-4, clip_high 4e-4); set wide_clip: true to keep it
    >>> GSPOLoss().clip_low, GSPOLoss().clip_high, GSPOLoss().agg
    (0.0003, 0.0004, 'seq-mean-token-mean')
    >>> GSPOLoss().contract.reduction("policy/clipfrac")
    'seq'
    """

    NAME = "gspo"
    contract = LossContract(
        entropy="grad", values=True, kl_term=True, approx_kl_metric="policy/approx_kl",
        rollout_weights=True, critic_terms=("loss_critic",),
        metrics={"policy/loss": "seq", "policy/clipfrac": "seq", "policy/approx_kl": "token",
                 "policy/entropy": "token", **VALUE_METRICS})
    out_keys = ["loss_objective", ("policy", "loss"), ("policy", "clipfrac"),
                ("policy", "approx_kl"), *VALUE_KEYS]

    def __init__(self, *, clip_low: float = 3e-4, clip_high: float = 4e-4,
                 log_ratio_clamp: float = 20.0, vf_coef: float = 0.5,
                 value_clip: float | None = 0.2, value_loss: str = "mse",
                 entropy_coef: float = 0.0, agg: str = "seq-mean-token-mean",
                 wide_clip: bool = False):
        super().__init__()
        check_args(self.NAME, {"clip_low": (clip_low, "a number in (0, 1)", lambda x: 0 < x < 1),
                               "clip_high": (clip_high, "a number > 0", lambda x: x > 0)})
        wide = [f"{k}={v:g}" for k, v in (("clip_low", clip_low), ("clip_high", clip_high)) if v > 0.01]
        if wide and wide_clip is not True:
            raise UserError(f"loss 'gspo': {', '.join(wide)}: a per-token (PPO-scale) clip "
                            f"range; GSPO clips the sequence ratio, which moves about 1e-3 per "
                            f"update (the paper: clip_low 3e-4, clip_high 4e-4); set wide_clip: "
                            f"true to keep it")
        self.clip_low, self.clip_high = clip_low, clip_high
        self.setup(log_ratio_clamp=log_ratio_clamp, vf_coef=vf_coef, value_clip=value_clip,
                   value_loss=value_loss, entropy_coef=entropy_coef, agg=agg)

    def policy_objective(self, td: TensorDictBase, mask: torch.Tensor, agg, weight):
        """The sequence losses, one copy on each of the sequence's tokens, reduced by ``agg``;
        ``policy/loss`` and ``policy/clipfrac`` are means over the micro-batch's rows."""
        keys = self.tensor_keys
        log_prob, old_log_prob = td.get(keys.log_prob), td.get(keys.old_log_prob)
        seq_loss, clipped, _ = gspo_policy_loss(
            log_prob, old_log_prob, td.get(keys.advantage), mask, clip_low=self.clip_low,
            clip_high=self.clip_high, log_ratio_clamp=self.log_ratio_clamp)
        loss = seq_loss.unsqueeze(-1).expand(mask.shape)
        if weight is not None:  # rollout correction (tis, mis)
            loss = loss * weight
        dtype = log_prob.dtype
        log_ratio = (log_prob - old_log_prob).clamp(-self.log_ratio_clamp, self.log_ratio_clamp)
        return agg(loss), {
            ("policy", "loss"): masked_mean(loss.detach(), mask, dim=-1).mean().to(dtype),
            ("policy", "clipfrac"): clipped.to(dtype).mean(),
            ("policy", "approx_kl"): masked_mean(
                kl.estimate(-log_ratio.detach(), self.APPROX_KL_ESTIMATOR), mask)}
