"""masked_gae and the GAE stage against torchrl's GAE and a float64 plain loop."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.value.functional import generalized_advantage_estimate

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.schema import ADVANTAGE, RESPONSE_MASK, REWARD, VALUE, VALUE_TARGET
from rlpipe.plugins.advantages.gae import GAE, masked_gae

LENGTHS = [0, 7, 3, 7, 1, 5, 0, 6]  # includes zero-length and full-length (R = 7) rows
R = 7


def make_batch(lengths=LENGTHS, seed=0, garbage=0.0):
    """Random float64 reward/value with a right-padded mask; ``garbage`` fills padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(R) < torch.tensor(lengths).unsqueeze(-1)
    reward = torch.randn(len(lengths), R, generator=gen, dtype=torch.float64)
    value = torch.randn(len(lengths), R, generator=gen, dtype=torch.float64)
    return (torch.where(mask, reward, garbage), torch.where(mask, value, garbage), mask)


def gae_loop(reward, value, mask, gamma, lmbda):
    """Plain-Python float64 GAE, one episode per row ending at its last valid token."""
    advantage = [[0.0] * R for _ in range(len(mask))]
    target = [[0.0] * R for _ in range(len(mask))]
    for b, row_mask in enumerate(mask.tolist()):
        n, running = sum(row_mask), 0.0
        for t in reversed(range(n)):
            next_value = value[b, t + 1].item() if t + 1 < n else 0.0
            delta = reward[b, t].item() + gamma * next_value - value[b, t].item()
            running = delta + gamma * lmbda * running
            advantage[b][t] = running
            target[b][t] = running + value[b, t].item()
    return torch.tensor(advantage, dtype=torch.float64), torch.tensor(target, dtype=torch.float64)


@pytest.mark.parametrize("gamma,lmbda", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0), (1.0, 1.0)])
def test_matches_float64_loop(gamma, lmbda):
    reward, value, mask = make_batch()
    advantage, target = masked_gae(reward, value, mask, gamma, lmbda)
    expected_adv, expected_target = gae_loop(reward, value, mask, gamma, lmbda)
    torch.testing.assert_close(advantage, expected_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(target, expected_target, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma,lmbda", [(1.0, 0.95), (0.95, 0.9)])
def test_matches_torchrl_with_done_at_last_valid_token(gamma, lmbda):
    reward, value, mask = make_batch(seed=1)
    next_value = torch.nn.functional.pad((value * mask)[:, 1:], (0, 1))
    last = torch.arange(R) == (mask.sum(-1, keepdim=True) - 1)
    done = (last & mask).unsqueeze(-1)
    expected, expected_target = generalized_advantage_estimate(
        gamma, lmbda, (value * mask).unsqueeze(-1), next_value.unsqueeze(-1),
        (reward * mask).unsqueeze(-1), done=done, terminated=done)
    advantage, target = masked_gae(reward, value, mask, gamma, lmbda)
    torch.testing.assert_close(advantage, expected.squeeze(-1) * mask)
    torch.testing.assert_close(target, expected_target.squeeze(-1) * mask)


def test_garbage_at_padding_changes_nothing():
    clean = masked_gae(*make_batch(seed=2), 1.0, 0.95)
    dirty = masked_gae(*make_batch(seed=2, garbage=1e6), 1.0, 0.95)
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def test_zero_on_padding():
    reward, value, mask = make_batch(seed=3, garbage=5.0)
    advantage, target = masked_gae(reward, value, mask, 1.0, 0.95)
    assert (advantage[~mask] == 0).all() and (target[~mask] == 0).all()


def gae_td(reward, value, mask):
    return TensorDict({REWARD: reward, VALUE: value, RESPONSE_MASK: mask}, batch_size=[len(mask)])


def test_module_reads_and_writes_schema_keys():
    reward, value, mask = make_batch(seed=4)
    td = GAE(gamma=0.9, lmbda=0.8, whiten=False)(gae_td(reward, value, mask))
    advantage, target = masked_gae(reward, value, mask, 0.9, 0.8)
    torch.testing.assert_close(td[ADVANTAGE], advantage, rtol=0, atol=0)
    torch.testing.assert_close(td[VALUE_TARGET], target, rtol=0, atol=0)
    assert GAE.needs_critic
    assert GAE().in_keys == [REWARD, VALUE, RESPONSE_MASK]
    assert GAE().out_keys == [ADVANTAGE, VALUE_TARGET]


def test_whitening_over_whole_batch_and_target_unwhitened():
    reward, value, mask = make_batch(seed=5, garbage=3.0)
    td = GAE(gamma=1.0, lmbda=0.95, whiten=True)(gae_td(reward, value, mask))
    raw, expected_target = gae_loop(reward, value, mask, 1.0, 0.95)
    valid = td[ADVANTAGE][mask].tolist()
    mean = sum(valid) / len(valid)
    std = (sum((a - mean) ** 2 for a in valid) / len(valid)) ** 0.5
    assert abs(mean) < 1e-12 and abs(std - 1) < 1e-6
    assert (td[ADVANTAGE][~mask] == 0).all()
    raw_valid = raw[mask]
    expected = (raw_valid - raw_valid.mean()) / raw_valid.std(unbiased=False)
    torch.testing.assert_close(td[ADVANTAGE][mask], expected)
    torch.testing.assert_close(td[VALUE_TARGET], expected_target)


@pytest.mark.parametrize("lengths", [[R] * 4, [0] * 4, [0, R, 0, 1]])
def test_truncated_and_empty_batches_are_finite(lengths):
    reward, value, mask = make_batch(lengths=lengths, seed=6, garbage=1e6)
    td = GAE()(gae_td(reward, value, mask))
    assert torch.isfinite(td[ADVANTAGE]).all() and torch.isfinite(td[VALUE_TARGET]).all()
    assert (td[ADVANTAGE][~mask] == 0).all()
    if not mask.any():
        assert (td[ADVANTAGE] == 0).all() and (td[VALUE_TARGET] == 0).all()


@pytest.mark.parametrize("kwargs", [{"gamma": 1.5}, {"gamma": -0.1}, {"lmbda": 2.0},
                                    {"lmbda": float("nan")}, {"gamma": "1"}, {"whiten": "yes"}])
def test_bad_arguments_raise_user_error(kwargs):
    with pytest.raises(UserError, match=next(iter(kwargs))):
        GAE(**kwargs)
