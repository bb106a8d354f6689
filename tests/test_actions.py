"""Hole-safe advantages (issue 51): compact the action tokens, run the estimator, scatter back.

Oracles: a float64 plain-loop GAE over the action tokens alone; a compact batch built by hand
(a Python loop over each row's action positions) fed to the estimator directly; loops that put
each turn's reward on its last action token."""

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase

from rlpipe.core.base.schema import (ACTION_MASK, ADVANTAGE, GROUP_ID, RESPONSE_MASK, REWARD,
                                     VALUE, VALUE_TARGET)
from rlpipe.core.step.actions import (compact, place_score, place_turn_rewards,
                                      run_advantage, scatter_back)
from rlpipe.plugins.advantages.gae import GAE, masked_gae
from rlpipe.plugins.advantages.grpo import GRPO
from rlpipe.plugins.advantages.reinforce_pp import ReinforcePP
from rlpipe.plugins.advantages.rloo import RLOO

BONUS = "bonus"


class ThirdParty(TensorDictModuleBase):
    """A third-party estimator that assumes a contiguous response and declares no ``in_keys``:
    an undiscounted reward-to-go plus a [B, R] key of its own, minus the row's first reward."""

    def forward(self, td):
        mask = td[RESPONSE_MASK]
        reward = torch.where(mask, td[REWARD] + td[BONUS], 0)
        togo = reward.flip(-1).cumsum(-1).flip(-1)
        advantage = torch.where(mask, togo - reward[:, :1], 0)
        td[ADVANTAGE], td[VALUE_TARGET] = advantage, togo
        return td


ESTIMATORS = [GAE(), GAE(gamma=0.9, lmbda=0.8, whiten=False),
              GAE(lmbda_critic=1.0, length_adaptive_alpha=0.05), GRPO(), GRPO(scale_std=False),
              RLOO(), RLOO(whiten=True), ReinforcePP(gamma=0.9), ThirdParty()]
IDS = ["gae", "gae_nowhiten", "gae_vapo", "grpo", "drgrpo", "rloo", "rloo_whiten",
       "reinforce_pp", "third_party"]


def gae_loop(rewards, values, gamma, lmbda):
    """Plain float64 GAE over one contiguous episode (value 0 after its end)."""
    advantage, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lmbda * running
        advantage[t] = running
    return advantage


def test_the_issues_worked_example():
    """[a, a, o, o, a, a], reward 1 at the end, V = 0.5, gamma 1, lambda 0.95."""
    actions = torch.tensor([[True, True, False, False, True, True]])
    reward = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    value = torch.full((1, 6), 0.5, dtype=torch.float64)
    compact_oracle = gae_loop([0.0, 0.0, 0.0, 1.0], [0.5] * 4, 1.0, 0.95)
    # naive: the holed row as one episode whose observation steps read V = 0 and r = 0
    naive_oracle = gae_loop([0.0] * 5 + [1.0], [0.5, 0.5, 0.0, 0.0, 0.5, 0.5], 1.0, 0.95)
    naive, _ = masked_gae(reward, value, actions, 1.0, 0.95)
    torch.testing.assert_close(naive[0, :2], torch.tensor(naive_oracle[:2], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert [round(a, 2) for a in naive[0, :2].tolist()] == [0.34, 0.36]
    td = TensorDict({REWARD: reward, VALUE: value, ACTION_MASK: actions,
                     RESPONSE_MASK: torch.ones(1, 6, dtype=torch.bool)}, batch_size=[1])
    out = run_advantage(GAE(gamma=1.0, lmbda=0.95, whiten=False), td)[ADVANTAGE][0]
    expected = torch.tensor([compact_oracle[0], compact_oracle[1], 0.0, 0.0, *compact_oracle[2:]],
                            dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)   # float64 matmul round-off
    assert [round(a, 2) for a in out[:2].tolist()] == [0.43, 0.45]


def holed_batch(seed, rows=12, width=9):
    """Right-padded response_mask (lengths 0..width), a random action mask inside it whose last
    response token may be an observation, random reward/value/bonus with garbage off actions."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    lengths[:2] = torch.tensor([0, width])
    response = torch.arange(width) < lengths.unsqueeze(-1)
    actions = response & (torch.rand(rows, width, generator=gen) < 0.6)
    floats = [torch.randn(rows, width, generator=gen, dtype=torch.float64) for _ in range(3)]
    garbage = [torch.where(actions, f, 1e6 * (i + 1)) for i, f in enumerate(floats)]
    groups = torch.randint(0, 4, (rows,), generator=gen)
    return TensorDict({REWARD: garbage[0], VALUE: garbage[1], BONUS: garbage[2],
                       RESPONSE_MASK: response, ACTION_MASK: actions, GROUP_ID: groups},
                      batch_size=[rows])


def by_hand(td):
    """The compact batch built with a Python loop: each row's action-token values in order,
    zeros after; response_mask true on the first count places."""
    rows, width = td[ACTION_MASK].shape
    positions = [[t for t in range(width) if td[ACTION_MASK][b, t]] for b in range(rows)]
    small = td.clone()
    for key in (REWARD, VALUE, BONUS):
        small[key] = torch.tensor([[td[key][b, t].item() for t in p] + [0.0] * (width - len(p))
                                   for b, p in enumerate(positions)], dtype=torch.float64)
    small[RESPONSE_MASK] = torch.tensor([[j < len(p) for j in range(width)] for p in positions])
    return small, positions


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=IDS)
@pytest.mark.parametrize("seed", range(4))
def test_holed_rows_get_the_compact_rows_advantages(estimator, seed):
    td = holed_batch(seed)
    small, positions = by_hand(td)
    expected = estimator(small)
    out = run_advantage(estimator, td.clone())
    for key in (ADVANTAGE, VALUE_TARGET):
        scattered = torch.zeros_like(out[key])
        for b, p in enumerate(positions):
            for j, t in enumerate(p):
                scattered[b, t] = expected[key][b, j]
        assert torch.equal(out[key], scattered), key
        assert not out[key][~td[ACTION_MASK]].any()


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=IDS)
@pytest.mark.parametrize("with_key", [True, False])
def test_without_holes_it_is_the_estimator_bit_for_bit(estimator, with_key):
    td = holed_batch(5)
    td[ACTION_MASK] = td[RESPONSE_MASK].clone()
    for key in (REWARD, VALUE, BONUS):   # a single-turn batch: values on padding are not read
        td[key] = torch.where(td[RESPONSE_MASK], td[key], 0)
    if not with_key:
        del td[ACTION_MASK]
    direct = estimator(td.clone())
    out = run_advantage(estimator, td.clone())
    assert torch.equal(out[ADVANTAGE], direct[ADVANTAGE])
    assert torch.equal(out[VALUE_TARGET], direct[VALUE_TARGET])


def test_compact_and_scatter_back_are_inverse_on_action_tokens():
    td = holed_batch(9)
    actions = td[ACTION_MASK]
    for x in (td[REWARD], actions, torch.arange(actions.numel()).view(actions.shape)):
        compact_x, compact_mask, index = compact(x, actions)
        assert torch.equal(compact_mask.sum(-1), actions.sum(-1))
        assert not compact_x[~compact_mask].any()
        back = scatter_back(compact_x, index, actions)
        assert torch.equal(back, torch.where(actions, x, torch.zeros((), dtype=x.dtype)))


def test_the_score_lands_on_the_last_action_token_even_before_an_observation():
    actions = torch.tensor([[True, True, False, False],    # ends in an observation
                            [False, True, True, True],
                            [False, False, False, False]])  # no action: the score is dropped
    placed = place_score(torch.tensor([1.5, -2.0, 9.0]), actions)
    assert placed.tolist() == [[0.0, 1.5, 0.0, 0.0], [0.0, 0.0, 0.0, -2.0], [0.0] * 4]


@pytest.mark.parametrize("seed", range(3))
def test_turn_rewards_land_on_each_turns_last_action_token(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width, turns = 6, 12, 3
    turn_id = torch.sort(torch.randint(-1, turns, (rows, width), generator=gen), dim=-1).values
    actions = (turn_id >= 0) & (torch.rand(rows, width, generator=gen) < 0.5)
    turn_reward = torch.randn(rows, turns, generator=gen, dtype=torch.float64)
    expected = torch.zeros(rows, width, dtype=torch.float64)
    for b in range(rows):
        for k in range(turns):
            last = [t for t in range(width) if actions[b, t] and turn_id[b, t] == k]
            if last:
                expected[b, last[-1]] = turn_reward[b, k]
    assert torch.equal(place_turn_rewards(turn_reward, turn_id, actions), expected)


def test_turn_rewards_pass_through_uncompacted_when_max_turns_equals_the_width():
    """``turn_reward`` is [B, max_turns]: with max_turns == R its shape is a token tensor's, and a
    shape-only pick compacted it along the turns (a per-turn estimator then read scrambled
    rewards). It reaches the estimator as it is."""
    seen = {}

    class Reads(TensorDictModuleBase):
        in_keys, out_keys = [], [ADVANTAGE, VALUE_TARGET]

        def forward(self, td):
            seen["turn_reward"] = td["turn_reward"].clone()
            td[ADVANTAGE] = td[VALUE_TARGET] = torch.zeros(td[RESPONSE_MASK].shape)
            return td

    turns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    td = TensorDict({RESPONSE_MASK: torch.ones(1, 4, dtype=torch.bool), "turn_reward": turns,
                     ACTION_MASK: torch.tensor([[False, True, False, True]])}, batch_size=[1])
    run_advantage(Reads(), td)
    assert torch.equal(seen["turn_reward"], turns)
