"""REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted token returns, normalised over the
whole batch; no critic and no groups.

The token reward holds the sequence score on the last valid token and, when the trainer shapes
it with KL, -beta * KL on every token. Each token's return is its discounted reward-to-go within
its response; the advantage is that return whitened with the mean and std of all valid tokens
of the batch.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.REWARD: torch.tensor([[0.0, 2.0], [1.0, 5.0]]),
...                  schema.RESPONSE_MASK: torch.tensor([[True, True], [True, False]])},
...                 batch_size=[2])
>>> out = ReinforcePP(gamma=0.5)(td)
>>> out[schema.VALUE_TARGET].tolist()
[[1.0, 2.0], [1.0, 0.0]]
>>> [round(a, 3) for a in out[schema.ADVANTAGE].flatten().tolist()]
[-0.707, 1.414, -0.707, 0.0]
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlpipe.plugin import (ADVANTAGE, RESPONSE_MASK, REWARD, VALUE_TARGET, AdvantageContract,
                           UserError, masked_whiten)
from rlpipe.plugins.advantages.gae import discounted_cumsum


def reinforce_pp_advantage(reward: torch.Tensor, mask: torch.Tensor,
                           gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage and return, both [B, R] and 0 on padding, from [B, R] ``reward`` and a
    right-padded bool ``mask``: ``G_t = sum_{k >= t} gamma ** (k - t) * r_k`` over valid tokens,
    and the advantage is ``G`` whitened over all valid tokens (population std, as
    `rlpipe.core.base.ops.masked_whiten`).

    >>> adv, ret = reinforce_pp_advantage(torch.tensor([[1.0, 1.0, 9.0]]),
    ...                                   torch.tensor([[True, True, False]]))
    >>> ret.tolist(), adv.tolist()
    ([[2.0, 1.0, 0.0]], [[1.0, -1.0, 0.0]])
    """
    returns = discounted_cumsum(torch.where(mask, reward, 0), gamma)
    return masked_whiten(returns, mask), returns


class ReinforcePP(TensorDictModuleBase):
    """REINFORCE++: discounted returns normalised over the batch, no critic. Advantage stage:
    reads ``reward``, ``response_mask``; writes ``advantage`` and ``value_target`` (the
    unwhitened returns), see `reinforce_pp_advantage`.

    Args:
        gamma: discount of the returns

    >>> ReinforcePP().in_keys, ReinforcePP.contract().needs_critic
    (['reward', 'response_mask'], False)
    """

    in_keys = [REWARD, RESPONSE_MASK]
    out_keys = [ADVANTAGE, VALUE_TARGET]

    @classmethod
    def contract(cls, **args) -> AdvantageContract:
        """No critic; the batch-normalised returns are per sample, so the KL fits in the reward
        (normalised over the whole batch, not per group)."""
        return AdvantageContract(needs_critic=False, kl_in="reward")

    def __init__(self, gamma: float = 1.0):
        super().__init__()
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
            raise UserError(f"advantage 'reinforce_pp': gamma must be a number in [0, 1], "
                            f"got {gamma!r}")
        self.gamma = float(gamma)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        advantage, returns = reinforce_pp_advantage(td.get(REWARD), td.get(RESPONSE_MASK),
                                                    self.gamma)
        td.set(ADVANTAGE, advantage)
        td.set(VALUE_TARGET, returns)
        return td
