"""Per-turn credit for multi-turn runs: each turn's return-to-go minus a leave-one-out baseline
from the other samples of its prompt, at the same turn index; no critic (docs/turn-credit.md).

Row ``i`` of a group of ``n`` rows (samples of one prompt with at least one action token) took
turns ``0 .. T_i - 1``. With ``r[i, t]`` the sum of its token rewards on turn ``t``'s action
tokens (the environment's turn reward, the outcome score on the last turn it took, and -beta * KL
per token when the trainer shapes the reward with KL; 0 for a turn it never took)::

    G[i, t] = sum_{k >= t} gamma ** (k - t) * r[i, k]      # 0 after row i stopped
    b[i, t] = mean_{j != i} G[j, t]                         # rows that stopped count with 0
    A[i, t] = G[i, t] - b[i, t]                             # on every action token of turn t

No std divides anything. Unbiased: ``b[i, t]`` is made of the other rows alone, independent of
row ``i``'s actions, and whether row ``i`` reaches turn ``t`` is settled before it acts there, so
``E[1{t < T_i} grad log pi(a_it | s_it) b[i, t]] = E[b[i, t]] E[1{t < T_i} E[grad log pi | s_it]]
= 0``. Normalising turn ``k``'s rewards over the rows that reached ``k`` (MT-GRPO, verl RFC
#7244) subtracts ``sum_{k=t}^{T_i - 1} mu_k`` instead: a baseline with as many terms as row ``i``
took turns, so it depends on row ``i``'s own decision to stop, and its gradient is biased by
``-E[mu_k]`` on every decision to take turn ``k`` (tests/test_turn_advantage.py, by exact
enumeration).

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.REWARD: torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 3.0, 0.0, 0.0]]),
...                  schema.RESPONSE_MASK: torch.tensor([[True] * 4, [True, True, False, False]]),
...                  schema.TURN_ID: torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]]),
...                  schema.TURN_REWARD: torch.zeros(2, 2),
...                  schema.GROUP_ID: torch.tensor([5, 5])}, batch_size=[2])
>>> TurnCredit()(td)[schema.ADVANTAGE].tolist()  # G = [3, 2] and [3, 0]
[[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]]
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlpipe.plugin import (ADVANTAGE, GROUP_ID, RESPONSE_MASK, REWARD, TURN_ID, TURN_REWARD,
                           VALUE_TARGET, AdvantageContract, UserError)
from rlpipe.plugins.advantages.gae import discounted_cumsum


def turn_returns(reward: torch.Tensor, mask: torch.Tensor, turn_id: torch.Tensor, turns: int,
                 gamma: float = 1.0) -> torch.Tensor:
    """[B, turns] ``G[i, t]``: each row's discounted return-to-go from turn ``t`` over its turn
    rewards ``r[i, k]``, the sums of [B, R] ``reward`` over the valid (``mask``) tokens of turn
    ``k`` (``turn_id`` [B, R]); a token whose turn is outside ``[0, turns)`` counts nowhere.

    >>> turn_returns(torch.tensor([[1.0, 2.0, 4.0]]), torch.ones(1, 3, dtype=torch.bool),
    ...              torch.tensor([[0, 0, 1]]), 3, gamma=0.5).tolist()
    [[5.0, 4.0, 0.0]]
    """
    valid = mask & (turn_id >= 0) & (turn_id < turns)
    index = torch.where(valid, turn_id, 0).long()
    per_turn = reward.new_zeros(reward.shape[0], turns).scatter_add_(
        -1, index, torch.where(valid, reward, torch.zeros((), dtype=reward.dtype)))
    return discounted_cumsum(per_turn, gamma)


def turn_advantage(reward: torch.Tensor, mask: torch.Tensor, turn_id: torch.Tensor,
                   group_id: torch.Tensor, turns: int, gamma: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantage, returns)``, both [B, R] and 0 off the valid tokens: ``G[i, t] - mean_{j != i}
    G[j, t]`` over the other rows ``j`` of i's group (`turn_returns`; a row that stopped before
    turn ``t`` counts with ``G[j, t] = 0``), and ``G[i, t]``, on each token of turn ``t``. A group
    of one row gets advantage 0; a row with no valid token takes no part in its group.

    >>> mask = torch.ones(3, 2, dtype=torch.bool)
    >>> adv, ret = turn_advantage(torch.tensor([[1.0, 1.0], [0.0, 4.0], [2.0, 0.0]]), mask,
    ...     torch.tensor([[0, 1], [0, 1], [0, 0]]), torch.tensor([0, 0, 0]), turns=2)
    >>> ret.tolist()  # G: [2, 1], [4, 4], [2, 0]
    [[2.0, 1.0], [4.0, 4.0], [2.0, 2.0]]
    >>> adv.tolist()  # turn 0's baselines 3, 2, 3; turn 1's 2, 0.5, 2.5
    [[-1.0, -1.0], [2.0, 3.5], [-1.0, -1.0]]
    """
    valid_row = mask.any(-1)
    returns = turn_returns(reward, mask, turn_id, turns, gamma)   # 0 on a row without tokens
    groups, member = torch.unique(group_id, return_inverse=True)
    count = returns.new_zeros(len(groups)).index_add_(0, member, valid_row.to(returns.dtype))
    total = returns.new_zeros(len(groups), turns).index_add_(0, member, returns)
    count = count[member].unsqueeze(-1)
    baseline = (total[member] - returns) / (count - 1).clamp_min(1)
    per_turn = torch.where(valid_row.unsqueeze(-1) & (count > 1), returns - baseline, 0)
    on_turn = mask & (turn_id >= 0) & (turn_id < turns)
    index = torch.where(on_turn, turn_id, 0).long()
    zero = torch.zeros((), dtype=returns.dtype)
    return (torch.where(on_turn, per_turn.gather(-1, index), zero),
            torch.where(on_turn, returns.gather(-1, index), zero))


class TurnCredit(TensorDictModuleBase):
    """Per-turn returns with a leave-one-out baseline at each turn index, no critic (multi-turn
    runs only). Advantage stage: reads ``reward``, ``response_mask``, ``turn_id``, ``group_id``
    and the width of ``turn_reward`` (the run's ``max_turns``); writes ``advantage`` (see
    `turn_advantage`) and ``value_target``, each token's return ``G[i, t]``: there is no critic,
    so nothing reads it. Core runs it on each row's action tokens (`rlpipe.core.step.actions`).

    Args:
        gamma: discount of the returns, per turn

    It needs groups (``collector.n >= 2``) and a multi-turn batch: without ``turn_reward`` (no
    ``environment:``) it stops on one line at its first call. The KL penalty goes in the loss
    unless ``kl.in`` says otherwise (in the reward it is allowed: no std divides the returns).

    >>> c = TurnCredit.contract()
    >>> c.needs_critic, c.needs_groups, c.kl_in, c.group_normalised
    (False, True, 'loss', False)
    """

    in_keys = [REWARD, RESPONSE_MASK, TURN_ID, TURN_REWARD, GROUP_ID]
    out_keys = [ADVANTAGE, VALUE_TARGET]

    @classmethod
    def contract(cls, **args) -> AdvantageContract:
        """Groups and turns, no critic, the KL in the loss (in the reward allowed: no std
        divides); a run without an environment is refused when it is planned."""
        return AdvantageContract(needs_critic=False, needs_groups=True, kl_in="loss",
                                 group_normalised=False, needs_turns=True)

    def __init__(self, gamma: float = 1.0):
        super().__init__()
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
            raise UserError(f"advantage 'turn': gamma must be a number in [0, 1], got {gamma!r}")
        self.gamma = float(gamma)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if TURN_REWARD not in td.keys() or TURN_ID not in td.keys():
            raise UserError("advantage 'turn': the batch has no turn_reward: per-turn credit needs "
                            "a multi-turn run (an environment: section); for a single-turn run "
                            "use advantage.name: grpo")
        advantage, returns = turn_advantage(td.get(REWARD), td.get(RESPONSE_MASK), td.get(TURN_ID),
                                            td.get(GROUP_ID), td.get(TURN_REWARD).shape[-1],
                                            self.gamma)
        td.set(ADVANTAGE, advantage)
        td.set(VALUE_TARGET, returns)
        return td
