"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024), for
``n > 1`` samples per prompt.

A sample's score is the sum of its token rewards over valid tokens (the sequence score on the
last valid token, plus -beta * KL per token when the trainer shapes the reward with KL). Its
baseline is the mean score of the *other* samples of its group (same ``group_id``); the
advantage, score minus baseline, is spread over its valid tokens. No critic.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.REWARD: torch.tensor([[1.0, 0.0], [0.0, 4.0], [7.0, 0.0]]),
...                  schema.RESPONSE_MASK: torch.tensor([[True, False], [True, True],
...                                                      [True, True]]),
...                  schema.GROUP_ID: torch.tensor([0, 0, 0])}, batch_size=[3])
>>> RLOO()(td)[schema.ADVANTAGE].tolist()
[[-4.5, 0.0], [0.0, 0.0], [4.5, 4.5]]
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlpipe.plugin import (ADVANTAGE, GROUP_ID, RESPONSE_MASK, REWARD, VALUE_TARGET,
                           AdvantageContract, UserError, masked_whiten)


def rloo_advantage(reward: torch.Tensor, mask: torch.Tensor,
                   group_id: torch.Tensor) -> torch.Tensor:
    """[B, R] advantage ``s_i - mean_{j != i} s_j`` over the samples ``j`` of i's group, 0 on
    padding, from [B, R] ``reward``, a right-padded bool ``mask`` and [B] ``group_id`` (any
    integers, in any order). A group of one sample gets advantage 0. A row with no valid token
    has no score and takes no part in its group's baseline.

    >>> rloo_advantage(torch.tensor([[1.0], [2.0], [6.0], [5.0]]),
    ...                torch.ones(4, 1, dtype=torch.bool), torch.tensor([3, 3, 3, 8])).tolist()
    [[-3.0], [-1.5], [4.5], [0.0]]
    """
    valid = mask.any(-1)
    score = torch.where(mask, reward, 0).sum(-1)
    groups, member = torch.unique(group_id, return_inverse=True)
    count = score.new_zeros(len(groups)).index_add_(0, member, valid.to(score.dtype))[member]
    total = score.new_zeros(len(groups)).index_add_(0, member, torch.where(valid, score, 0))
    baseline = (total[member] - score) / (count - 1).clamp_min(1)
    advantage = torch.where(valid & (count > 1), score - baseline, 0)
    return torch.where(mask, advantage.unsqueeze(-1), 0)


class RLOO(TensorDictModuleBase):
    """A leave-one-out baseline within each group, no critic. Advantage stage: reads
    ``reward``, ``response_mask``, ``group_id``; writes ``advantage`` (see `rloo_advantage`;
    whitened over all valid tokens of the batch when ``whiten``) and ``value_target``, a copy
    of the advantage: there is no critic, so nothing reads it.

    Args:
        whiten: normalise advantages over the batch's valid tokens

    It needs groups (``collector.n >= 2``); the KL penalty goes in the loss unless ``kl.in``
    says otherwise (in the reward it is allowed: no group std divides the scores).

    >>> c = RLOO.contract(whiten=True)
    >>> RLOO(whiten=True).in_keys, c.needs_critic, c.needs_groups, c.kl_in, c.group_normalised
    (['reward', 'response_mask', 'group_id'], False, True, 'loss', False)
    """

    in_keys = [REWARD, RESPONSE_MASK, GROUP_ID]
    out_keys = [ADVANTAGE, VALUE_TARGET]

    @classmethod
    def contract(cls, **args) -> AdvantageContract:
        """Groups, no critic, the KL in the loss (in the reward allowed: no std divides)."""
        return AdvantageContract(needs_critic=False, needs_groups=True, kl_in="loss")

    def __init__(self, whiten: bool = False):
        super().__init__()
        if not isinstance(whiten, bool):
            raise UserError(f"advantage 'rloo': whiten must be true or false, got {whiten!r}")
        self.whiten = whiten

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        mask = td.get(RESPONSE_MASK)
        advantage = rloo_advantage(td.get(REWARD), mask, td.get(GROUP_ID))
        if self.whiten:
            advantage = masked_whiten(advantage, mask)
        td.set(ADVANTAGE, advantage)
        td.set(VALUE_TARGET, advantage.clone())
        return td
