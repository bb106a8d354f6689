"""The policy's tokens in a row that also holds the world's: advantages that cannot see a hole.

A multi-turn row interleaves action tokens (sampled by the policy, ``action_mask`` true) with
observation tokens (a tool's or an environment's answer). Advantage estimators assume one
contiguous, right-padded response, so core never hands them a hole: `compact` moves each row's
action tokens to the left, in order, the estimator runs on that, and `scatter_back` puts its
answer back on the action tokens (0 elsewhere). `run_advantage` does the three for any estimator,
built-in or third-party. Rewards are placed on action tokens too: a row's score on its last
action token (also when the row ends in an observation), a turn's reward on that turn's last one.

>>> x = torch.tensor([[1.0, 2.0, 8.0, 9.0, 3.0, 0.0]])
>>> actions = torch.tensor([[True, True, False, False, True, False]])
>>> compact_x, compact_mask, index = compact(x, actions)
>>> compact_x.tolist(), compact_mask.tolist()
([[1.0, 2.0, 3.0, 0.0, 0.0, 0.0]], [[True, True, True, False, False, False]])
>>> scatter_back(compact_x * 10, index, actions).tolist()
[[10.0, 20.0, 0.0, 0.0, 30.0, 0.0]]
>>> place_score(torch.tensor([5.0]), actions).tolist()
[[0.0, 0.0, 0.0, 0.0, 5.0, 0.0]]
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlpipe.core.base.schema import ACTION_MASK, ADVANTAGE, RESPONSE_MASK, TURN_REWARD, VALUE_TARGET


def compact(x: torch.Tensor, action_mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(compact_x, compact_mask, index)``: each row of [B, R] ``x`` with its action tokens moved
    to the left in order, the rest zeroed (False for bool); ``compact_mask`` is right-padded, true
    on the row's first ``action_mask.sum(-1)`` places; ``index`` [B, R] is the permutation
    (``compact_x[b, j] = x[b, index[b, j]]`` where ``compact_mask``). A row without holes comes
    back unchanged.

    >>> compact(torch.tensor([[4, 5, 6]]), torch.tensor([[False, True, True]]))[0].tolist()
    [[5, 6, 0]]
    """
    index = torch.argsort((~action_mask).to(torch.int8), dim=-1, stable=True)
    count = action_mask.sum(-1, keepdim=True)
    compact_mask = torch.arange(x.shape[-1], device=x.device) < count
    compact_x = torch.where(compact_mask, x.gather(-1, index), torch.zeros((), dtype=x.dtype))
    return compact_x, compact_mask, index


def scatter_back(compact_y: torch.Tensor, index: torch.Tensor,
                 action_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] ``y`` with ``y[b, index[b, j]] = compact_y[b, j]`` on the action tokens, 0 elsewhere:
    the inverse of `compact` (``index`` from it).

    >>> y = scatter_back(torch.tensor([[7.0, 9.0, 1.0]]), torch.tensor([[1, 2, 0]]),
    ...                  torch.tensor([[False, True, True]]))
    >>> y.tolist()
    [[0.0, 7.0, 9.0]]
    """
    y = torch.empty_like(compact_y).scatter_(-1, index, compact_y)
    return torch.where(action_mask, y, torch.zeros((), dtype=y.dtype))


def _response_keys(td: TensorDictBase, estimator) -> list:
    """The [B, R] tensors to compact: those among the estimator's ``in_keys`` when it declares
    them, else every [B, R] tensor of ``td``; ``turn_reward`` is [B, max_turns], never per token,
    even when max_turns happens to equal R."""
    shape = td.get(RESPONSE_MASK).shape
    keys = getattr(estimator, "in_keys", None) or td.keys(include_nested=True, leaves_only=True)
    return [key for key in keys if key not in (RESPONSE_MASK, TURN_REWARD)
            and key in td.keys(include_nested=True)
            and isinstance(td.get(key), torch.Tensor) and td.get(key).shape == shape]


def run_advantage(estimator, td: TensorDictBase,
                  action_mask_key: str = ACTION_MASK) -> TensorDictBase:
    """Run ``estimator`` (TensorDict in, TensorDict out) on the compact action tokens of ``td``
    and write its ``advantage`` and ``value_target`` back into ``td`` on the action tokens (0
    elsewhere); returns ``td``. The estimator gets a shallow copy of ``td`` whose [B, R] inputs
    (`_response_keys`) are compacted and whose ``response_mask`` is the compact mask; [B] entries
    pass through. Without ``action_mask_key`` in ``td`` the mask is ``response_mask``, and a
    right-padded batch compacts to itself, so single-turn results are bit for bit the same.

    >>> from tensordict import TensorDict
    >>> class Returns(torch.nn.Module):   # reward-to-go: it would sum across a hole
    ...     def forward(self, td):
    ...         td[ADVANTAGE] = td["reward"].flip(-1).cumsum(-1).flip(-1) * td[RESPONSE_MASK]
    ...         td[VALUE_TARGET] = td[ADVANTAGE]
    ...         return td
    >>> td = TensorDict({"reward": torch.tensor([[0.0, 5.0, 0.0, 1.0]]),
    ...                  RESPONSE_MASK: torch.ones(1, 4, dtype=torch.bool),
    ...                  ACTION_MASK: torch.tensor([[True, False, True, True]])}, batch_size=[1])
    >>> run_advantage(Returns(), td)[ADVANTAGE].tolist()   # the observation's 5.0 is not seen
    [[1.0, 0.0, 1.0, 1.0]]
    """
    mask = td.get(action_mask_key) if action_mask_key in td.keys() else td.get(RESPONSE_MASK)
    small = td.copy()   # shallow: entries are shared, the estimator's writes stay in the copy
    for key in _response_keys(td, estimator):
        small.set(key, compact(td.get(key), mask)[0])
    _, compact_mask, index = compact(mask, mask)
    small.set(RESPONSE_MASK, compact_mask)
    out = estimator(small)
    for key in (ADVANTAGE, VALUE_TARGET):
        td.set(key, scatter_back(out.get(key), index, mask))
    return td


def place_turn_rewards(turn_reward: torch.Tensor, turn_id: torch.Tensor,
                       action_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] token rewards: ``turn_reward[b, k]`` ([B, T]) on the last action token of turn ``k``
    (``turn_id`` [B, R], negative off the turns), 0 elsewhere; a turn without an action token
    drops its reward.

    >>> place_turn_rewards(torch.tensor([[1.0, 2.0]]), torch.tensor([[0, 0, 0, 1, 1, -1]]),
    ...                    torch.tensor([[True, True, False, True, True, False]])).tolist()
    [[0.0, 1.0, 0.0, 0.0, 2.0, 0.0]]
    """
    rows, width = action_mask.shape
    turns = turn_reward.shape[-1]
    valid = action_mask & (turn_id >= 0) & (turn_id < turns)
    position = torch.arange(width, device=action_mask.device).expand(rows, width)
    last = torch.full((rows, turns), -1, dtype=torch.long, device=action_mask.device)
    last.scatter_reduce_(-1, turn_id.long().clamp(0, turns - 1), torch.where(valid, position, -1),
                         "amax")
    out = turn_reward.new_zeros(rows, width + 1)   # column ``width``: where dropped rewards go
    return out.scatter_add_(-1, torch.where(last >= 0, last, width), turn_reward)[:, :width]


def place_score(score: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] token rewards: each row's ``score`` ([B]) on its last action token, even when the
    row ends in an observation; a row without action tokens gets none.

    >>> place_score(torch.tensor([1.0, 2.0]), torch.tensor([[True, False], [False, False]])).tolist()
    [[1.0, 0.0], [0.0, 0.0]]
    """
    return place_turn_rewards(score.unsqueeze(-1), torch.zeros_like(action_mask, dtype=torch.long),
                              action_mask)
