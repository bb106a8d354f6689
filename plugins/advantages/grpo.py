"""GRPO's group-relative advantage (Shao et al. 2024), and Dr. GRPO's variant without the std
division (Liu et al. 2025), for ``n > 1`` samples per prompt.

A sample's score is the sum of its token rewards over valid tokens: the sequence score on the
last valid token plus, when the trainer shapes the reward with KL, -beta * KL of every token.
Samples of one prompt share a ``group_id``; each sample's advantage is its score minus the
group mean, divided by the group std + ``eps`` when ``scale_std``, and spread over its valid
tokens. No critic.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.REWARD: torch.tensor([[0.0, 1.0], [3.0, 0.0]]),
...                  schema.RESPONSE_MASK: torch.tensor([[True, True], [True, False]]),
...                  schema.GROUP_ID: torch.tensor([7, 7])}, batch_size=[2])
>>> GRPO(scale_std=False)(td)[schema.ADVANTAGE].tolist()
[[-1.0, -1.0], [1.0, 0.0]]
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlpipe.plugin import (ADVANTAGE, GROUP_ID, RESPONSE_MASK, REWARD, VALUE_TARGET,
                           AdvantageContract, UserError)


def grpo_advantage(reward: torch.Tensor, mask: torch.Tensor, group_id: torch.Tensor,
                   scale_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """[B, R] advantage, 0 on padding, from [B, R] ``reward``, a right-padded bool ``mask`` and
    [B] ``group_id`` (any integers, in any order). The group std is the unbiased one (divides by
    n - 1), as ``torch.std`` in TRL's ``GRPOTrainer``, whose ``eps`` of 1e-4 is the default here.
    A group of one sample gets advantage 0. A row with no valid token has no score and takes no
    part in its group's statistics.

    >>> adv = grpo_advantage(torch.tensor([[1.0], [2.0], [3.0], [5.0]]),
    ...                      torch.ones(4, 1, dtype=torch.bool), torch.tensor([4, 4, 4, 9]))
    >>> [round(a, 3) for a in adv[:, 0].tolist()]  # group 4: mean 2, std 1; group 9: alone
    [-1.0, 0.0, 1.0, 0.0]
    """
    valid = mask.any(-1)
    score = torch.where(mask, reward, 0).sum(-1)
    groups, member = torch.unique(group_id, return_inverse=True)
    count = score.new_zeros(len(groups)).index_add_(0, member, valid.to(score.dtype))
    total = score.new_zeros(len(groups)).index_add_(0, member, torch.where(valid, score, 0))
    centred = torch.where(valid, score - (total / count.clamp_min(1))[member], 0)
    if scale_std:
        square = score.new_zeros(len(groups)).index_add_(0, member, centred * centred)
        std = (square / (count - 1).clamp_min(1)).sqrt()
        centred = centred / (std[member] + eps)
    return torch.where(mask, centred.unsqueeze(-1), 0)


class GRPO(TensorDictModuleBase):
    """Group-normalised sequence scores, no critic. Advantage stage: reads ``reward``,
    ``response_mask``, ``group_id``; writes ``advantage`` (see `grpo_advantage`) and
    ``value_target``, a copy of the advantage: there is no critic, so nothing reads it.

    Args:
        scale_std: divide by the group's std (false: Dr. GRPO, mean-centred only)
        eps: added to the std before dividing

    It needs groups (``collector.n >= 2``); the KL penalty goes in the loss unless ``kl.in``
    says otherwise, and ``kl.in: reward`` is refused while it divides by the group std
    (``group_normalised``): the std scaling would turn the scores' KL noise into signal.

    >>> c = GRPO.contract()
    >>> GRPO().in_keys, c.needs_critic, c.needs_groups, c.kl_in
    (['reward', 'response_mask', 'group_id'], False, True, 'loss')
    >>> c.group_normalised, GRPO.contract(scale_std=False).group_normalised
    (True, False)
    """

    in_keys = [REWARD, RESPONSE_MASK, GROUP_ID]
    out_keys = [ADVANTAGE, VALUE_TARGET]

    @classmethod
    def contract(cls, scale_std: bool = True, **args) -> AdvantageContract:
        """Groups, no critic, the KL in the loss; group-normalised while it divides by the std
        (any ``scale_std`` but False counts: a wrong value is refused when it is built)."""
        return AdvantageContract(needs_critic=False, needs_groups=True, kl_in="loss",
                                 group_normalised=scale_std is not False)

    def __init__(self, scale_std: bool = True, eps: float = 1e-4):
        super().__init__()
        if not isinstance(scale_std, bool):
            raise UserError(f"advantage 'grpo': scale_std must be true or false, got {scale_std!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise UserError(f"advantage 'grpo': eps must be a number > 0, got {eps!r}")
        self.scale_std, self.eps = scale_std, float(eps)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        advantage = grpo_advantage(td.get(REWARD), td.get(RESPONSE_MASK), td.get(GROUP_ID),
                                   self.scale_std, self.eps)
        td.set(ADVANTAGE, advantage)
        td.set(VALUE_TARGET, advantage.clone())
        return td
