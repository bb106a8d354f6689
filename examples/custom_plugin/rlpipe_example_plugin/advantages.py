"""A critic-free advantage: the discounted reward-to-go of each response token."""

import torch
from tensordict.nn import TensorDictModuleBase

from rlpipe.plugin import AdvantageContract, UserError, schema


def reward_to_go(reward: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over the valid tokens of each row, 0 on padding.

    >>> reward_to_go(torch.tensor([[0.0, 0.0, 1.0, 5.0]]), torch.tensor([[1, 1, 1, 0]]).bool())
    tensor([[1., 1., 1., 0.]])
    """
    reward = reward * mask
    returns = torch.zeros_like(reward)
    running = torch.zeros_like(reward[:, 0])
    for t in reversed(range(reward.shape[-1])):
        running = (reward[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


class RewardToGo(TensorDictModuleBase):
    """Writes ``advantage`` = ``value_target`` = the masked discounted reward-to-go.

    Config keys: ``gamma`` (1.0). Its contract: no critic, and the KL penalty in the reward
    (each token's return is a plain sum of its rewards; nothing divides a group by its spread).

    >>> from tensordict import TensorDict
    >>> td = TensorDict({schema.REWARD: torch.tensor([[0.0, 1.0, 0.0]]),
    ...                  schema.RESPONSE_MASK: torch.tensor([[1, 1, 0]]).bool()}, batch_size=[1])
    >>> RewardToGo(gamma=0.5)(td)[schema.ADVANTAGE]
    tensor([[0.5000, 1.0000, 0.0000]])
    >>> RewardToGo.contract(gamma=0.5).needs_critic
    False
    """

    in_keys = [schema.REWARD, schema.RESPONSE_MASK]
    out_keys = [schema.ADVANTAGE, schema.VALUE_TARGET]

    @classmethod
    def contract(cls, gamma: float = 1.0) -> AdvantageContract:
        """What rlpipe needs to know before building it (the same for every ``gamma``)."""
        return AdvantageContract(needs_critic=False, kl_in="reward")

    def __init__(self, gamma: float = 1.0):
        super().__init__()
        if not 0.0 <= gamma <= 1.0:
            raise UserError(f"reward_to_go: gamma must be in [0, 1], got {gamma}")
        self.gamma = gamma

    def forward(self, td):
        returns = reward_to_go(td[schema.REWARD], td[schema.RESPONSE_MASK], self.gamma)
        td[schema.ADVANTAGE] = returns
        td[schema.VALUE_TARGET] = returns.clone()  # its own storage: later stages may edit one
        return td
