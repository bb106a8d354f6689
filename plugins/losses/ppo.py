"""PPO loss for token-level RLHF: clipped surrogate (asymmetric and dual clip), clipped value
loss, entropy bonus, all masked to valid response tokens.

The loss holds no networks: the trainer writes the current policy's ``log_prob``, ``entropy``
and ``value_pred`` into the micro-batch, as the loss's `LossContract` asks (entropy with a graph
only when ``entropy_coef > 0``). Losses are sums over the micro-batch divided by the
minibatch-wide counts ``num_tokens``/``num_seqs``, so the losses of the micro-batches of a
minibatch add up to the loss of the whole minibatch. With ``kl.in: loss`` it adds ``loss_kl``
itself (`rlpipe.core.step.kl.loss_term`, the run's estimator). A micro-batch that carries
``rollout_is_weight`` (``rollout_correction.mode`` tis or mis) weights each token's clipped
surrogate by it (`rlpipe.core.step.rollout_correction`).

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.LOG_PROB: torch.zeros(1, 2), schema.OLD_LOG_PROB: torch.zeros(1, 2),
...                  schema.ADVANTAGE: torch.tensor([[1.0, 3.0]]),
...                  schema.RESPONSE_MASK: torch.tensor([[True, True]])}, batch_size=[1])
>>> PPOLoss()(td)["loss_objective"].item()
-2.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from rlpipe.plugin import (EXPLAINED_VAR, LossContract, PipelineLoss, UserError, explained_var,
                           explained_var_sums, global_count, kl, masked_mean, schema)

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
VALUE_LOSSES = ("mse", "huber")


def ppo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantage: torch.Tensor,
                    *, clip_low: float, clip_high: float, dual_clip: float | None = None,
                    log_ratio_clamp: float = 20.0):
    """Per-token clipped surrogate loss ``max(-A r, -A clip(r, 1-clip_low, 1+clip_high))``, and
    for ``A < 0`` with ``dual_clip=c`` capped at ``-c A`` (Ye et al. 2020). Returns
    ``(loss, clipped, clipped_lower, log_ratio)``: the clip indicators are bool, ``log_ratio``
    is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before ``exp``.

    >>> loss, clipped, _, _ = ppo_policy_loss(torch.tensor([0.5]), torch.tensor([0.0]),
    ...                                       torch.tensor([1.0]), clip_low=0.2, clip_high=0.2)
    >>> round(loss.item(), 4), clipped.item()
    (-1.2, True)
    """
    log_ratio = (log_prob - old_log_prob).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantage * ratio
    clipped_loss = -advantage * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is None:
        return loss, clipped, torch.zeros_like(clipped), log_ratio
    cap = -dual_clip * advantage
    clipped_lower = (advantage < 0) & (loss > cap)
    return torch.where(clipped_lower, cap, loss), clipped, clipped_lower, log_ratio


def ppo_value_loss(value_pred: torch.Tensor, old_value: torch.Tensor, value_target: torch.Tensor,
                   *, value_clip: float | None = 0.2, kind: str = "mse"):
    """Per-token critic loss, ``max(f(v - target), f(v_clipped - target))`` with
    ``v_clipped = old + clamp(v - old, -value_clip, value_clip)`` (PPO2/TRL), or ``f(v - target)``
    when ``value_clip`` is None. ``f`` is ``x^2 / 2`` ("mse") or Huber with delta 1 ("huber").
    Returns ``(loss, clipped)``, ``clipped`` true where ``|v - old| > value_clip`` and the clipped
    term is the larger. Inside the clip range ``old + (v - old)`` is ``v`` only up to float32
    round-off, which must not count as clipping (it made ``value/clipfrac`` depend on the CPU):

    >>> loss, clipped = ppo_value_loss(torch.tensor([1.0]), torch.tensor([0.0]),
    ...                                torch.tensor([1.0]), value_clip=0.5)
    >>> loss.item(), clipped.item()
    (0.125, True)
    >>> v, old = torch.tensor([-0.10615216940641403]), torch.tensor([0.08358846604824066])
    >>> (old + (v - old)).item() == v.item()   # one ulp apart: the clipped term is larger
    False
    >>> ppo_value_loss(v, old, torch.tensor([-0.3]), value_clip=0.2)[1].item()
    False
    """
    def f(pred):
        if kind == "huber":
            return torch.nn.functional.huber_loss(pred, value_target, reduction="none")
        return 0.5 * (pred - value_target) ** 2

    loss = f(value_pred)
    if value_clip is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    delta = value_pred - old_value
    clipped_loss = f(old_value + delta.clamp(-value_clip, value_clip))
    return torch.maximum(loss, clipped_loss), (clipped_loss > loss) & (delta.abs() > value_clip)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str,
                   num_tokens: torch.Tensor | float, num_seqs: torch.Tensor | float):
    """Reduce a [B, R] per-token loss to a scalar over valid tokens: "token-mean" is the sum over
    valid tokens / ``num_tokens``; "seq-mean-token-mean" the sum of per-sequence masked token
    means / ``num_seqs``; "seq-mean-token-sum" the sum of per-sequence token sums / ``num_seqs``.
    ``num_seqs`` counts the non-empty sequences (as verl and OpenRLHF do): a zero-length response
    adds 0 and does not dilute the mean. Counts below 1 count as 1.

    >>> mask = torch.tensor([[True, True], [True, False], [False, False]])
    >>> loss = torch.tensor([[1.0, 3.0], [5.0, 0.0], [9.0, 9.0]])
    >>> aggregate_loss(loss, mask, "seq-mean-token-mean", num_tokens=3, num_seqs=2).item()
    3.5
    """
    per_seq = torch.where(mask, loss, 0).sum(-1)
    if mode == "token-mean":
        return per_seq.sum() / torch.as_tensor(num_tokens).clamp_min(1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    return per_seq.sum() / torch.as_tensor(num_seqs).clamp_min(1)


def check_args(loss: str, rules: dict) -> None:
    """One `UserError` line for the first argument of loss ``loss`` that breaks its rule:
    ``rules`` maps a name to ``(value, expected, ok)``; an ``expected`` that starts with "null"
    admits None.

    >>> check_args("ppo", {"clip_low": (0.2, "a number in (0, 1)", lambda x: 0 < x < 1)})
    >>> check_args("ppo", {"vf_coef": (True, "a number >= 0", lambda x: x >= 0)})
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: loss 'ppo': vf_coef must be a number >= 0, got True
    """
    for name, (x, expected, ok) in rules.items():
        if x is None and expected.startswith("null"):
            continue
        number = not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
        if not (number and ok(x)):
            raise UserError(f"loss {loss!r}: {name} must be {expected}, got {x!r}")


class PolicyGradientLoss(PipelineLoss):
    """What rlpipe's policy losses share (`PPOLoss`, ``gspo``, ``cispo``): the clipped critic
    loss, the entropy bonus, the ``kl.in: loss`` term, ``rollout_is_weight`` and the metrics. A
    subclass sets ``NAME`` (for error lines), ``contract`` and ``out_keys``, checks its own
    arguments and calls `setup` with the shared ones, and implements `policy_objective`.
    """

    NAME = "policy"
    APPROX_KL_ESTIMATOR = "k2"

    @dataclass
    class _AcceptedKeys(PipelineLoss._AcceptedKeys):
        old_log_prob: NestedKey = schema.OLD_LOG_PROB
        advantage: NestedKey = schema.ADVANTAGE
        entropy: NestedKey = schema.ENTROPY
        value_pred: NestedKey = schema.VALUE_PRED
        value: NestedKey = schema.VALUE
        value_target: NestedKey = schema.VALUE_TARGET
        num_seqs: NestedKey = schema.NUM_SEQS
        rollout_is_weight: NestedKey = schema.ROLLOUT_IS_WEIGHT

    default_keys = _AcceptedKeys

    def setup(self, *, log_ratio_clamp: float, vf_coef: float, value_clip: float | None,
              value_loss: str, entropy_coef: float, agg: str) -> None:
        """Check and keep the arguments every policy loss takes."""
        check_args(self.NAME, {
            "log_ratio_clamp": (log_ratio_clamp, "a number > 0", lambda x: x > 0),
            "vf_coef": (vf_coef, "a number >= 0", lambda x: x >= 0),
            "value_clip": (value_clip, "null or a number > 0", lambda x: x > 0),
            "entropy_coef": (entropy_coef, "a number >= 0", lambda x: x >= 0)})
        if value_loss not in VALUE_LOSSES:
            raise UserError(f"loss {self.NAME!r}: value_loss must be one of {VALUE_LOSSES}, "
                            f"got {value_loss!r}")
        if agg not in AGG_MODES:
            raise UserError(f"loss {self.NAME!r}: agg must be one of {AGG_MODES}, got {agg!r}")
        self.log_ratio_clamp, self.vf_coef, self.value_clip = log_ratio_clamp, vf_coef, value_clip
        self.value_loss, self.entropy_coef, self.agg = value_loss, entropy_coef, agg
        # the entropy needs a graph only when it is in the loss; otherwise it is a metric
        self.contract = dataclasses.replace(self.contract,
                                            entropy="grad" if entropy_coef > 0 else "detached")

    @property
    def in_keys(self) -> list[NestedKey]:
        """Every key the loss reads; ``entropy``, ``value_pred``, ``value``, ``ref_log_prob``,
        ``rollout_is_weight`` and the counts are optional."""
        return list(vars(self.tensor_keys).values())

    def policy_objective(self, td: TensorDictBase, mask: torch.Tensor, agg, weight):
        """``(loss_objective, metrics)``: the policy-gradient term, reduced by ``agg``
        (`aggregate_loss` with the minibatch's counts), with each token's part times ``weight``
        (``rollout_is_weight``) unless None; ``metrics`` maps nested keys to detached scalars."""
        raise NotImplementedError

    def token_objective(self, loss, clipped, clipped_lower, log_ratio, mask, agg, weight):
        """`policy_objective`'s result from per-token terms: ``loss`` times ``weight`` (rollout
        correction: tis, mis) reduced by ``agg``, and the token means of ``policy/loss``,
        ``clipfrac``, ``clipfrac_lower`` and ``approx_kl`` (from ``log_ratio``)."""
        if weight is not None:
            loss = loss * weight
        metrics = {"loss": loss, "clipfrac": clipped, "clipfrac_lower": clipped_lower,
                   "approx_kl": kl.estimate(-log_ratio, self.APPROX_KL_ESTIMATOR)}
        return agg(loss), {("policy", k): masked_mean(x.detach().to(log_ratio.dtype), mask)
                           for k, x in metrics.items()}

    def forward(self, td: TensorDictBase) -> TensorDict:
        keys = self.tensor_keys
        mask = self.mask(td)
        agg = functools.partial(
            aggregate_loss, mask=mask, mode=self.agg,
            num_tokens=global_count(td, keys.num_tokens, mask.sum()),
            num_seqs=global_count(td, keys.num_seqs, mask.any(-1).sum()))
        objective, metrics = self.policy_objective(td, mask, agg,
                                                   td.get(keys.rollout_is_weight, None))
        out = TensorDict({"loss_objective": objective, **metrics}, batch_size=[])
        dtype = td.get(keys.log_prob).dtype
        entropy = td.get(keys.entropy, None)
        if entropy is not None:
            out.set(("policy", "entropy"), masked_mean(entropy.detach().to(dtype), mask))
            if self.entropy_coef > 0:
                out.set("loss_entropy", -self.entropy_coef * agg(entropy))
        value_pred = td.get(keys.value_pred, None)
        if value_pred is not None:
            target = td.get(keys.value_target)
            old_value = td.get(keys.value) if self.value_clip is not None else None
            value_loss, value_clipped = ppo_value_loss(value_pred, old_value, target,
                                                       value_clip=self.value_clip,
                                                       kind=self.value_loss)
            out.set("loss_critic", self.vf_coef * agg(value_loss))
            for name, x in (("loss", value_loss), ("clipfrac", value_clipped)):
                out.set(("value", name), masked_mean(x.detach().to(dtype), mask))
            sums = explained_var_sums(value_pred, target, mask)
            out.set(("value", "explained_var"), explained_var(sums).to(value_pred.dtype))
            out.set(("value", "explained_var_sums"), sums)
        kl_loss = self.kl_penalty(td)  # kl.in: loss
        if kl_loss is not None:
            out.set("loss_kl", kl_loss)
        return out


VALUE_METRICS = {"value/loss": "token", "value/clipfrac": "token",
                 "value/explained_var": EXPLAINED_VAR}
VALUE_KEYS = ["loss_critic", "loss_entropy", "loss_kl", ("policy", "entropy"), ("value", "loss"),
              ("value", "clipfrac"), ("value", "explained_var"), ("value", "explained_var_sums")]


class PPOLoss(PolicyGradientLoss):
    """PPO loss over a micro-batch (see the module docstring). Emits ``loss_objective``,
    ``loss_critic`` (when ``value_pred`` is present, times ``vf_coef``), ``loss_entropy`` (when
    ``entropy`` is present and ``entropy_coef > 0``), ``loss_kl`` (with ``kl.in: loss``: the run's
    penalty, `PipelineLoss.kl_penalty`) and detached metrics under ``policy`` and ``value``: each a masked token mean
    over this micro-batch, except ``explained_var`` (``1 - Var(target - pred) / Var(target)``
    over its valid tokens; its sums, under ``explained_var_sums``, let the trainer pool it over
    micro-batches and processes). ``approx_kl`` is the k2 estimator ``(log_ratio)^2 / 2`` of
    KL(pi_old || pi) (`rlpipe.core.step.kl.estimate`), the metric ``train.target_kl`` reads.

    Args:
        clip_low: PPO clip range below 1: ratio >= 1 - clip_low
        clip_high: clip range above 1 (null: clip_low; DAPO's clip-higher: larger)
        dual_clip: dual-clip bound c > 1 on negative advantages (null: off)
        log_ratio_clamp: bound on log(pi / pi_old) before exp
        vf_coef: weight of the critic loss
        value_clip: clip the new value to old +- value_clip (null: off; a fresh value head: off)
        value_loss: mse or huber
        entropy_coef: entropy bonus (0: off)
        agg: token-mean, seq-mean-token-mean or seq-mean-token-sum (seq-mean-*: divided by the minibatch's non-empty responses, as verl and OpenRLHF)

    >>> PPOLoss(clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean").clip_high
    0.28
    >>> PPOLoss().contract.entropy, PPOLoss(entropy_coef=0.01).contract.entropy
    ('detached', 'grad')
    """

    NAME = "ppo"
    contract = LossContract(
        entropy="grad", values=True, kl_term=True, approx_kl_metric="policy/approx_kl",
        rollout_weights=True, critic_terms=("loss_critic",),
        metrics={"policy/loss": "token", "policy/clipfrac": "token",
                 "policy/clipfrac_lower": "token", "policy/approx_kl": "token",
                 "policy/entropy": "token", **VALUE_METRICS})
    out_keys = ["loss_objective", ("policy", "loss"), ("policy", "clipfrac"),
                ("policy", "clipfrac_lower"), ("policy", "approx_kl"), *VALUE_KEYS]

    def __init__(self, *, clip_low: float = 0.2, clip_high: float | None = None,
                 dual_clip: float | None = None, log_ratio_clamp: float = 20.0,
                 vf_coef: float = 0.5, value_clip: float | None = 0.2, value_loss: str = "mse",
                 entropy_coef: float = 0.0, agg: str = "token-mean"):
        super().__init__()
        clip_high = clip_low if clip_high is None else clip_high
        check_args(self.NAME, {
            "clip_low": (clip_low, "a number in (0, 1)", lambda x: 0 < x < 1),
            "clip_high": (clip_high, "a number > 0", lambda x: x > 0),
            "dual_clip": (dual_clip, "null or a number > 1", lambda x: x > 1)})
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip
        self.setup(log_ratio_clamp=log_ratio_clamp, vf_coef=vf_coef, value_clip=value_clip,
                   value_loss=value_loss, entropy_coef=entropy_coef, agg=agg)

    def policy_objective(self, td: TensorDictBase, mask: torch.Tensor, agg, weight):
        """The clipped surrogate (`ppo_policy_loss`) and its token-mean metrics."""
        keys = self.tensor_keys
        loss, clipped, clipped_lower, log_ratio = ppo_policy_loss(
            td.get(keys.log_prob), td.get(keys.old_log_prob), td.get(keys.advantage),
            clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
            log_ratio_clamp=self.log_ratio_clamp)
        return self.token_objective(loss, clipped, clipped_lower, log_ratio, mask, agg, weight)
