"""Generalized advantage estimation (Schulman et al. 2015) on right-padded token data.

Each response is one episode that terminates at its last valid token: the bootstrap value
after it is 0, and critic values at padding positions are masked before use, so garbage there
cannot leak into valid tokens.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core import schema
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

from rlpipe.core.errors import UserError
from rlpipe.core.ops import masked_whiten
from rlpipe.core.schema import ADVANTAGE, RESPONSE_MASK, REWARD, VALUE, VALUE_TARGET


@functools.lru_cache(maxsize=64)
def _discount_matrix(discount: float, n: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """[n, n] matrix ``D[k, t] = discount ** (k - t)`` for ``k >= t``, else 0, computed in
    float64. Cached (no rebuild and no host-to-device copy per call): never modify it."""
    k = torch.arange(n, dtype=torch.float64)
    matrix = (discount ** (k.unsqueeze(1) - k).clamp_min(0)).tril()
    return matrix.to(dtype=dtype, device=device)


def discounted_cumsum(x: torch.Tensor, discount: float, block: int = 32) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last dim of a [B, T] tensor:
    ``out[:, t] = sum_{k >= t} discount ** (k - t) * x[:, k]``.

    The same sums as the backward loop ``out_t = x_t + discount * out_{t+1}``, in blocks of
    ``block`` steps: a [block, block] discount-matrix product gives the sums within each block,
    a [T/block, T/block] one carries the block heads backwards across blocks. Every power of
    ``discount`` is at most 1, so nothing overflows. On CUDA with TF32 matmuls enabled
    (``torch.backends.cuda.matmul.allow_tf32``) float32 inputs lose precision.

    >>> discounted_cumsum(torch.tensor([[1.0, 2.0, 4.0]]), 0.5, block=2).tolist()
    [[3.0, 4.0, 4.0]]
    """
    batch, steps = x.shape
    pad = -steps % block
    blocks = (steps + pad) // block
    x = (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(batch, blocks, block)
    matrix = _discount_matrix(discount, block, x.dtype, x.device)
    within = x @ matrix
    heads = within[..., 0] @ _discount_matrix(discount ** block, blocks, x.dtype, x.device)
    next_heads = torch.nn.functional.pad(heads[:, 1:], (0, 1))
    tail = matrix[-1] * discount  # discount ** (block - t): the next block head's weight
    out = within.addcmul_(next_heads.unsqueeze(-1), tail)
    return out.view(batch, blocks * block)[:, :steps]


def masked_gae(reward: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, gamma: float,
               lmbda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage and value target, both [B, R] and 0 on padding, from [B, R] ``reward`` and
    ``value`` with a right-padded bool ``mask``. Reward and value are read on valid tokens only;
    the episode ends at the last valid token (the value after it is 0). The backward recursion
    ``A_t = delta_t + gamma * lmbda * A_{t+1}`` runs as `discounted_cumsum` (no loop over R).

    >>> adv, target = masked_gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 7.0]]),
    ...                          torch.tensor([[True, False]]), gamma=1.0, lmbda=0.95)
    >>> adv.tolist(), target.tolist()
    ([[0.5, 0.0]], [[1.0, 0.0]])
    """
    value = torch.where(mask, value, 0)
    delta = torch.where(mask, reward, 0).sub_(value)
    delta[:, :-1].add_(value[:, 1:], alpha=gamma)  # + gamma * V(t+1); 0 after the last token
    advantage = discounted_cumsum(delta, gamma * lmbda)
    return advantage, value.add_(advantage)  # value is our masked copy: the target in place


class GAE(TensorDictModuleBase):
    """Advantage stage: reads ``reward``, ``value``, ``response_mask``; writes ``advantage``
    (whitened over all valid tokens of the batch when ``whiten``) and ``value_target``
    (from the advantage before whitening).

    >>> GAE(gamma=1.0, lmbda=0.95).out_keys
    ['advantage', 'value_target']
    """

    needs_critic = True
    in_keys = [REWARD, VALUE, RESPONSE_MASK]
    out_keys = [ADVANTAGE, VALUE_TARGET]

    def __init__(self, gamma: float = 1.0, lmbda: float = 0.95, whiten: bool = True):
        super().__init__()
        for name, x in (("gamma", gamma), ("lmbda", lmbda)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
                raise UserError(f"advantage 'gae': {name} must be a number in [0, 1], got {x!r}")
        if not isinstance(whiten, bool):
            raise UserError(f"advantage 'gae': whiten must be true or false, got {whiten!r}")
        self.gamma, self.lmbda, self.whiten = float(gamma), float(lmbda), whiten

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        mask = td.get(RESPONSE_MASK)
        advantage, value_target = masked_gae(td.get(REWARD), td.get(VALUE), mask,
                                             self.gamma, self.lmbda)
        if self.whiten:
            advantage = masked_whiten(advantage, mask)
        td.set(ADVANTAGE, advantage)
        td.set(VALUE_TARGET, value_target)
        return td
