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

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlpipe.core.errors import UserError
from rlpipe.core.ops import masked_whiten
from rlpipe.core.schema import ADVANTAGE, RESPONSE_MASK, REWARD, VALUE, VALUE_TARGET


def masked_gae(reward: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, gamma: float,
               lmbda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage and value target, both [B, R] and 0 on padding, from [B, R] ``reward`` and
    ``value`` with a right-padded bool ``mask``. Reward and value are read on valid tokens only;
    the episode ends at the last valid token (the value after it is 0).

    >>> adv, target = masked_gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 7.0]]),
    ...                          torch.tensor([[True, False]]), gamma=1.0, lmbda=0.95)
    >>> adv.tolist(), target.tolist()
    ([[0.5, 0.0]], [[1.0, 0.0]])
    """
    value = torch.where(mask, value, 0)
    next_value = torch.nn.functional.pad(value[:, 1:], (0, 1))
    delta = torch.where(mask, reward + gamma * next_value - value, 0)
    advantage = torch.empty_like(delta)
    running = delta.new_zeros(delta.shape[0])
    for t in reversed(range(delta.shape[1])):
        running = delta[:, t] + gamma * lmbda * running
        advantage[:, t] = running
    return advantage, advantage + value


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
