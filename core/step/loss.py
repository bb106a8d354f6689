"""The contract between a loss plugin and the trainer (`rlpipe.core.step.update`), declared by the loss.

A loss plugin (a ``torchrl.objectives.LossModule``) declares in a class attribute ``contract``, a
`LossContract`, what the trainer computes for it in every micro-batch, who adds the KL penalty
with ``kl.in: loss``, which metric ``train.target_kl`` reads, and how each metric reduces over
micro-batches, minibatches and processes. What it leaves out takes the defaults of
`LossContract`; a loss without ``contract`` gets all of them (`contract_of`, the one place core
reads a loss plugin's attributes). `PipelineLoss` is an optional base class with the shared KL
term. Reductions:

- ``"token"`` (default): the entry is a mean over the micro-batch's valid tokens; reported as the
  token-weighted mean over all micro-batches of the stepped minibatches, on every process.
- ``"seq"``: a mean over the micro-batch's sequences, reported sequence-weighted likewise.
- ``"explained_var"``: ``1 - Var(target - pred) / Var(target)`` pooled over all those tokens,
  from the sums ``[sum r^2, sum r, sum y^2, sum y, n]`` (`explained_var_sums`) that the loss
  writes under ``<name>_sums`` next to the entry; the reported value does not depend on how the
  batch is split into micro-batches or processes.

``loss_*`` entries are parts of the minibatch's loss (normalised by minibatch-wide counts): they
are summed over micro-batches and processes and averaged over the stepped minibatches.

>>> c = LossContract(entropy="detached", metrics={"policy/kl": "seq"})
>>> c.reduction("policy/kl"), c.reduction("policy/clipfrac")
('seq', 'token')
>>> contract_of(torch.nn.Identity()) == LossContract()
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase
from torchrl.objectives import LossModule

from rlpipe.core.step import kl
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.kinds import EXPLAINED_VAR, TOKEN, LossContract  # re-exported
from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError
from rlpipe.core.observe.metrics import to_float

SUMS = "_sums"  # suffix of the entry that holds an "explained_var" metric's sums


def contract_of(loss) -> LossContract:
    """The loss's declared `LossContract` (its ``contract`` attribute), or the defaults. The one
    adapter through which core reads a loss plugin's attributes."""
    contract = registry.declared("losses", loss, "contract")
    if contract is None:
        return LossContract()
    if not isinstance(contract, LossContract):
        raise UserError(f"{registry.label_of(loss)}: contract must be a "
                        f"rlpipe.core.step.loss.LossContract, got {type(contract).__name__}")
    if contract.kl_term and not callable(registry.declared("losses", loss, "set_kl")):
        raise UserError(f"{registry.label_of(loss)} declares kl_term but has no set_kl(penalty) "
                        f"(subclass rlpipe.core.step.loss.PipelineLoss)")
    return contract


def global_count(td: TensorDictBase, key: NestedKey, local: torch.Tensor) -> torch.Tensor:
    """The minibatch-wide count stored under ``key`` (every entry holds it), else ``local``."""
    count = td.get(key, None)
    return local if count is None or count.numel() == 0 else count.reshape(-1)[0]


def explained_var_sums(pred: torch.Tensor, target: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """float64 ``[sum r^2, sum r, sum y^2, sum y, n]`` over the true entries of ``mask``, with
    ``r = target - pred`` and ``y = target``: additive over any split of the tokens.

    >>> explained_var_sums(torch.tensor([2.0, 3.0, 7.0]), torch.tensor([1.0, 5.0, 9.0]),
    ...                    torch.tensor([True, True, False])).tolist()
    [5.0, 1.0, 26.0, 6.0, 2.0]
    """
    y = torch.where(mask, target.detach().double(), 0)
    r = torch.where(mask, y - pred.detach().double(), 0)
    return torch.stack([(r * r).sum(), r.sum(), (y * y).sum(), y.sum(), mask.sum().double()])


def explained_var(sums) -> torch.Tensor:
    """``1 - Var(r) / Var(y)`` (population variances, ``Var(y)`` at least 1e-8) from
    `explained_var_sums`, or from their sum over parts of a batch; 1 for no token.

    >>> explained_var(torch.tensor([5.0, 1.0, 26.0, 6.0, 2.0])).item()  # 1 - 2.25 / 4
    0.4375
    """
    r2, r, y2, y, n = torch.as_tensor(sums, dtype=torch.float64).unbind()
    n = n.clamp_min(1)
    var_r = (r2 / n - (r / n) ** 2).clamp_min(0)
    var_y = (y2 / n - (y / n) ** 2).clamp_min(1e-8)
    return 1 - var_r / var_y


def _entries(td, prefix: str = "") -> dict:
    """Nested TensorDict -> ``{"a/b": value}``, in the order of `rlpipe.core.observe.metrics.flatten`."""
    out = {}
    for key, value in td.items():
        if hasattr(value, "items"):
            out.update(_entries(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def micro_parts(out: TensorDictBase, contract: LossContract, tokens: float, seqs: float,
                who: str = "loss") -> tuple[dict[str, float], dict[str, list[float]]]:
    """One micro-batch's loss output as ``loss_*`` floats and additive metric parts: ``[w * v,
    w]`` for a weighted metric (``w``: this micro-batch's ``tokens`` or ``seqs``), the five sums
    for an "explained_var" one. Parts add over micro-batches, minibatches and processes."""
    losses: dict[str, float] = {}
    parts: dict[str, list[float] | None] = {}
    for name, value in _entries(out).items():
        if name.startswith("loss_"):
            losses[name] = to_float(value)
        elif name.endswith(SUMS) and contract.reduction(name[:-len(SUMS)]) == EXPLAINED_VAR:
            parts[name[:-len(SUMS)]] = value.detach().double().reshape(-1).tolist()
        elif contract.reduction(name) == EXPLAINED_VAR:
            parts.setdefault(name, None)  # keeps its place; the sums fill it
        else:
            w = tokens if contract.reduction(name) == TOKEN else seqs
            parts[name] = [w * to_float(value), w]
    missing = [k for k, v in parts.items() if v is None]
    if missing:
        raise UserError(f"{who} declares {missing[0]!r} as explained_var but wrote no "
                        f"{missing[0] + SUMS!r} entry (explained_var_sums)")
    return losses, parts


def add_parts(total: dict[str, list[float]], part: dict[str, list[float]]) -> None:
    """``total += part``, entry by entry, in place (new names are appended)."""
    for k, v in part.items():
        total[k] = [a + b for a, b in zip(total.get(k, [0.0] * len(v)), v)]


def finish(parts: dict[str, list[float]], contract: LossContract) -> dict[str, float]:
    """The reported metrics from summed parts (`micro_parts`); a weight of 0 reports 0.

    >>> finish({"a": [6.0, 3.0], "v": [5.0, 1.0, 26.0, 6.0, 2.0]},
    ...        LossContract(metrics={"v": "explained_var"}))
    {'a': 2.0, 'v': 0.4375}
    """
    out = {}
    for name, s in parts.items():
        if contract.reduction(name) == EXPLAINED_VAR:
            out[name] = float(explained_var(s))
        else:
            out[name] = s[0] / s[1] if s[1] > 0 else 0.0
    return out


def exceeds(parts: list[float], reduction: str, limit: float) -> bool:
    """Whether a metric's summed parts report more than ``limit`` (``train.target_kl``)."""
    if reduction == EXPLAINED_VAR:
        return float(explained_var(parts)) > limit
    return parts[0] > limit * parts[1]


class PipelineLoss(LossModule):
    """Optional base class of rlpipe losses: the `LossContract` defaults, and `kl_penalty`, the
    ``kl.in: loss`` term of the run's `rlpipe.core.step.kl.KLPenalty`, which the trainer hands
    over with `set_kl`. A subclass whose forward adds ``loss_kl = self.kl_penalty(td)``
    declares ``kl_term=True``.

    >>> from types import SimpleNamespace
    >>> loss = PipelineLoss()
    >>> loss.set_kl(kl.KLPenalty(SimpleNamespace(estimator="k3", clamp=10.0, in_="loss",
    ...                                          coef=0.1, target=None, horizon=1)))
    >>> loss.kl.estimator, loss.kl.loss_coef, loss.contract.kl_term
    ('k3', 0.1, False)
    """

    contract = LossContract()
    kl: kl.KLPenalty | None = None

    @dataclass
    class _AcceptedKeys:
        log_prob: NestedKey = schema.LOG_PROB
        ref_log_prob: NestedKey = schema.REF_LOG_PROB
        response_mask: NestedKey = schema.RESPONSE_MASK
        action_mask: NestedKey = schema.ACTION_MASK
        num_tokens: NestedKey = schema.NUM_TOKENS

    default_keys = _AcceptedKeys

    def mask(self, td: TensorDictBase) -> torch.Tensor:
        """The tokens the loss trains on: the policy's own (``action_mask``; a single-turn batch
        without one: ``response_mask``), never an environment's observation tokens."""
        keys = self.tensor_keys
        return td.get(keys.action_mask if keys.action_mask in td.keys(True) else keys.response_mask)

    def set_kl(self, penalty: kl.KLPenalty) -> None:
        """Use the run's KL penalty in `kl_penalty` (the trainer calls this once, at build)."""
        self.kl = penalty

    def kl_penalty(self, td: TensorDictBase) -> torch.Tensor | None:
        """The penalty's loss term on this micro-batch; None without one, with ``kl.in:
        reward`` or a coefficient of 0."""
        if self.kl is None:
            return None
        keys = self.tensor_keys
        mask = self.mask(td)
        return self.kl.loss_term(td.get(keys.log_prob), td.get(keys.ref_log_prob), mask,
                                 global_count(td, keys.num_tokens, mask.sum()))
