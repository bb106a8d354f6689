"""Generalized advantage estimation (Schulman et al. 2015) on right-padded token data.

Each response is one episode that terminates at its last valid token: the bootstrap value
after it is 0, and critic values at padding positions are masked before use, so garbage there
cannot leak into valid tokens.

VAPO's variants (Yuan et al. 2025, arXiv 2504.05118; VC-PPO, arXiv 2503.01491), both off by
default: ``lmbda_critic`` decouples the value targets (GAE with their own lambda, 1.0 in VAPO)
from the policy's advantages, and ``length_adaptive_alpha`` gives each response its own policy
lambda ``1 - 1 / (alpha * length)`` (`length_adaptive_lambda`).

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.REWARD: torch.tensor([[0.0, 1.0, 0.0]]),
...                  schema.VALUE: torch.tensor([[0.5, 0.5, 9.0]]),
...                  schema.RESPONSE_MASK: torch.tensor([[True, True, False]])}, batch_size=[1])
>>> GAE(gamma=1.0, lmbda=1.0, whiten=False)(td)[schema.ADVANTAGE].tolist()
[[0.5, 0.5, 0.0]]
"""

from __future__ import annotations

import functools

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlpipe.plugin import (ADVANTAGE, RESPONSE_MASK, REWARD, VALUE, VALUE_TARGET,
                           AdvantageContract, UserError, masked_whiten)


def _row_discount_matrices(discount: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, n, n] matrices ``D[b, k, t] = discount[b] ** (k - t)`` for ``k >= t``, else 0: one
    `_discount_matrix` per row, as ``exp(lag * log(discount))`` in float64 (a log clamped at
    -1e4 makes ``0 ** lag`` exact: 1 at lag 0, else 0)."""
    k = torch.arange(n, dtype=torch.float64, device=discount.device)
    lag = k.unsqueeze(1) - k
    log_discount = discount.double().log().clamp_min(-1e4).view(-1, 1, 1)
    powers = torch.exp(lag.clamp_min(0) * log_discount)
    return torch.where(lag >= 0, powers, 0).to(dtype)


@functools.lru_cache(maxsize=64)
def _discount_matrix(discount: float, n: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """[n, n] matrix ``D[k, t] = discount ** (k - t)`` for ``k >= t``, else 0, computed in
    float64. Cached (no rebuild and no host-to-device copy per call): never modify it."""
    k = torch.arange(n, dtype=torch.float64)
    matrix = (discount ** (k.unsqueeze(1) - k).clamp_min(0)).tril()
    return matrix.to(dtype=dtype, device=device)


def discounted_cumsum(x: torch.Tensor, discount: float | torch.Tensor,
                      block: int = 32) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last dim of a [B, T] tensor:
    ``out[:, t] = sum_{k >= t} discount ** (k - t) * x[:, k]``.

    The same sums as the backward loop ``out_t = x_t + discount * out_{t+1}``, in blocks of
    ``block`` steps: a [block, block] discount-matrix product gives the sums within each block,
    a [T/block, T/block] one carries the block heads backwards across blocks. Every power of
    ``discount`` is at most 1, so nothing overflows. On CUDA with TF32 matmuls enabled
    (``torch.backends.cuda.matmul.allow_tf32``) float32 inputs lose precision.

    ``discount`` may also be a [B] tensor, one discount per row (then the matrices are per row).

    >>> discounted_cumsum(torch.tensor([[1.0, 2.0, 4.0]]), 0.5, block=2).tolist()
    [[3.0, 4.0, 4.0]]
    >>> discounted_cumsum(torch.tensor([[1.0, 2.0, 4.0]] * 2), torch.tensor([0.5, 0.0])).tolist()
    [[3.0, 4.0, 4.0], [1.0, 2.0, 4.0]]
    """
    batch, steps = x.shape
    pad = -steps % block
    blocks = (steps + pad) // block
    x = (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(batch, blocks, block)
    if isinstance(discount, torch.Tensor):  # per row: batched [B, n, n] matrices
        matrix = _row_discount_matrices(discount, block, x.dtype)
        within = x @ matrix
        heads_matrix = _row_discount_matrices(discount.double() ** block, blocks, x.dtype)
        heads = (within[..., :1] * heads_matrix).sum(1)  # a [1, n] @ [n, n] product per row
        tail = (matrix[:, -1] * discount.to(x.dtype).unsqueeze(-1)).unsqueeze(1)
    else:
        matrix = _discount_matrix(discount, block, x.dtype, x.device)
        within = x @ matrix
        heads = within[..., 0] @ _discount_matrix(discount ** block, blocks, x.dtype, x.device)
        tail = matrix[-1] * discount  # discount ** (block - t): the next block head's weight
    next_heads = torch.nn.functional.pad(heads[:, 1:], (0, 1))
    out = within.addcmul_(next_heads.unsqueeze(-1), tail)
    return out.view(batch, blocks * block)[:, :steps]


def masked_gae(reward: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, gamma: float,
               lmbda: float | torch.Tensor, lmbda_critic: float | torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage and value target, both [B, R] and 0 on padding, from [B, R] ``reward`` and
    ``value`` with a right-padded bool ``mask``. Reward and value are read on valid tokens only;
    the episode ends at the last valid token (the value after it is 0). The backward recursion
    ``A_t = delta_t + gamma * lmbda * A_{t+1}`` runs as `discounted_cumsum` (no loop over R).

    ``lmbda`` is a number or a [B] tensor (one per row). The value target is ``V + A`` with the
    advantage computed with ``lmbda_critic`` (None: ``lmbda``, one pass; VAPO's decoupled GAE
    sets 1.0, which makes the target the plain return ``sum_{k >= t} gamma^(k-t) r_k``).

    >>> adv, target = masked_gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 7.0]]),
    ...                          torch.tensor([[True, False]]), gamma=1.0, lmbda=0.95)
    >>> adv.tolist(), target.tolist()
    ([[0.5, 0.0]], [[1.0, 0.0]])
    >>> masked_gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]),
    ...            torch.tensor([[True, True]]), 1.0, lmbda=0.0, lmbda_critic=1.0)[1].tolist()
    [[1.0, 1.0]]
    """
    value = torch.where(mask, value, 0)
    delta = torch.where(mask, reward, 0).sub_(value)
    delta[:, :-1].add_(value[:, 1:], alpha=gamma)  # + gamma * V(t+1); 0 after the last token
    advantage = discounted_cumsum(delta, _times(gamma, lmbda))
    if lmbda_critic is not None:
        advantage_critic = discounted_cumsum(delta, _times(gamma, lmbda_critic))
        return advantage, value.add_(advantage_critic)
    return advantage, value.add_(advantage)  # value is our masked copy: the target in place


def _times(gamma: float, lmbda: float | torch.Tensor) -> float | torch.Tensor:
    """``gamma * lmbda``, in float64 for a per-row tensor."""
    return gamma * lmbda.double() if isinstance(lmbda, torch.Tensor) else gamma * lmbda


def length_adaptive_lambda(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """[B] float64 per-row policy lambda ``1 - 1 / (alpha * length)`` (VAPO), ``length`` being
    the row's valid tokens; 0 where ``alpha * length <= 1`` (short rows: one-step TD, as in
    NeMo-RL). Long responses get lambda near 1, so the advantage of an early token still sees
    the final reward.

    >>> mask = torch.arange(100) < torch.tensor([[0], [10], [20], [100]])
    >>> length_adaptive_lambda(mask, alpha=0.05).tolist()
    [0.0, 0.0, 0.0, 0.8]
    """
    scaled = mask.sum(-1).double() * alpha
    return 1.0 - 1.0 / scaled.clamp_min(1.0)


def _check_unit(name: str, x, allow_none: bool = False) -> None:
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
        expected = "null or a number in [0, 1]" if allow_none else "a number in [0, 1]"
        raise UserError(f"advantage 'gae': {name} must be {expected}, got {x!r}")


class GAE(TensorDictModuleBase):
    """Advantage stage: reads ``reward``, ``value``, ``response_mask``; writes ``advantage``
    (whitened over all valid tokens of the batch when ``whiten``) and ``value_target``
    (from the advantage before whitening).

    ``lmbda_critic`` (null: ``lmbda``) is the lambda of the value targets, ``lmbda`` that of
    the advantages; ``length_adaptive_alpha`` (null: off) replaces ``lmbda`` for the advantages
    by `length_adaptive_lambda`, per response. VAPO: ``lmbda_critic=1.0``,
    ``length_adaptive_alpha=0.05``.

    Args:
        gamma: discount
        lmbda: GAE lambda of the advantages
        whiten: normalise advantages to mean 0, std 1 over the batch's valid tokens
        lmbda_critic: lambda of the value targets (null: lmbda; VAPO: 1.0; algorithms.md)
        length_adaptive_alpha: per-response lambda = 1 - 1/(alpha * length) (null: off; VAPO: 0.05)

    >>> GAE(gamma=1.0, lmbda=0.95).out_keys
    ['advantage', 'value_target']
    >>> GAE(lmbda_critic=1.0, length_adaptive_alpha=0.05).lmbda_critic
    1.0
    >>> GAE.contract(gamma=0.99)
    AdvantageContract(needs_critic=True, needs_groups=False, kl_in='reward', group_normalised=False, declared=True, needs_turns=False)
    """

    in_keys = [REWARD, VALUE, RESPONSE_MASK]
    out_keys = [ADVANTAGE, VALUE_TARGET]

    @classmethod
    def contract(cls, **args) -> AdvantageContract:
        """A critic's values, per-sample returns: the KL penalty fits in the reward."""
        return AdvantageContract(needs_critic=True, kl_in="reward")

    def __init__(self, gamma: float = 1.0, lmbda: float = 0.95, whiten: bool = True,
                 lmbda_critic: float | None = None, length_adaptive_alpha: float | None = None):
        super().__init__()
        _check_unit("gamma", gamma)
        _check_unit("lmbda", lmbda)
        _check_unit("lmbda_critic", lmbda_critic, allow_none=True)
        alpha = length_adaptive_alpha
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                                  or not 0 < alpha < float("inf")):
            raise UserError(f"advantage 'gae': length_adaptive_alpha must be null or a number "
                            f"> 0, got {alpha!r}")
        if not isinstance(whiten, bool):
            raise UserError(f"advantage 'gae': whiten must be true or false, got {whiten!r}")
        self.gamma, self.lmbda, self.whiten = float(gamma), float(lmbda), whiten
        self.lmbda_critic = None if lmbda_critic is None else float(lmbda_critic)
        self.length_adaptive_alpha = None if alpha is None else float(alpha)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        mask = td.get(RESPONSE_MASK)
        lmbda, lmbda_critic = self.lmbda, self.lmbda_critic
        if self.length_adaptive_alpha is not None:
            lmbda = length_adaptive_lambda(mask, self.length_adaptive_alpha)
            lmbda_critic = self.lmbda if lmbda_critic is None else lmbda_critic
        advantage, value_target = masked_gae(td.get(REWARD), td.get(VALUE), mask,
                                             self.gamma, lmbda, lmbda_critic)
        if self.whiten:
            advantage = masked_whiten(advantage, mask)
        td.set(ADVANTAGE, advantage)
        td.set(VALUE_TARGET, value_target)
        return td
