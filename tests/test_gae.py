"""masked_gae and the GAE stage against torchrl's GAE and a float64 plain loop; VAPO's variants
(decoupled lambda_critic, length-adaptive policy lambda) against the same loop, with garbage on
padding; their defaults change nothing."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.value.functional import generalized_advantage_estimate

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.schema import ADVANTAGE, RESPONSE_MASK, REWARD, VALUE, VALUE_TARGET
from rlpipe.plugins.advantages.gae import (GAE, discounted_cumsum, length_adaptive_lambda,
                                           masked_gae)

LENGTHS = [0, 7, 3, 7, 1, 5, 0, 6]  # includes zero-length and full-length (R = 7) rows
R = 7
VAPO_LENGTHS = [0, 70, 3, 45, 1, 20, 0, 69, 21, 33]  # empty, full (width 70) and alpha*l around 1


def make_batch(lengths=LENGTHS, seed=0, garbage=0.0, dtype=torch.float64, width=R):
    """Random reward/value with a right-padded mask; ``garbage`` fills padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)
    reward = torch.randn(len(lengths), width, generator=gen, dtype=dtype)
    value = torch.randn(len(lengths), width, generator=gen, dtype=dtype)
    return (torch.where(mask, reward, garbage), torch.where(mask, value, garbage), mask)


def vapo_batch(**kwargs):
    return make_batch(VAPO_LENGTHS, width=70, **kwargs)


def gae_loop(reward, value, mask, gamma, lmbda):
    """Plain-Python float64 GAE, one episode per row ending at its last valid token; ``lmbda``
    is a number or one per row. Returns advantages and V + A."""
    rows, width = mask.shape
    lambdas = lmbda if isinstance(lmbda, list) else [lmbda] * rows
    advantage = [[0.0] * width for _ in range(rows)]
    target = [[0.0] * width for _ in range(rows)]
    for b, row_mask in enumerate(mask.tolist()):
        n, running = sum(row_mask), 0.0
        for t in reversed(range(n)):
            next_value = value[b, t + 1].item() if t + 1 < n else 0.0
            delta = reward[b, t].item() + gamma * next_value - value[b, t].item()
            running = delta + gamma * lambdas[b] * running
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
    assert GAE.contract().needs_critic
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


def vapo_lambda_loop(lengths, alpha):
    """The paper's formula, row by row: 1 - 1/(alpha l), 0 where alpha l <= 1."""
    return [1 - 1 / (alpha * n) if alpha * n > 1 else 0.0 for n in lengths]


@pytest.mark.parametrize("alpha", [0.05, 0.2, 1.0])
def test_length_adaptive_lambda_is_the_formula(alpha):
    _, _, mask = vapo_batch()
    expected = torch.tensor(vapo_lambda_loop(VAPO_LENGTHS, alpha), dtype=torch.float64)
    torch.testing.assert_close(length_adaptive_lambda(mask, alpha), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("gamma,lmbda,lmbda_critic", [(1.0, 0.95, 1.0), (0.9, 0.0, 0.7),
                                                      (0.99, 1.0, 0.0)])
def test_decoupled_lambda_matches_float64_loop(gamma, lmbda, lmbda_critic):
    reward, value, mask = vapo_batch(seed=1)
    advantage, target = masked_gae(reward, value, mask, gamma, lmbda, lmbda_critic)
    expected_adv, _ = gae_loop(reward, value, mask, gamma, lmbda)
    _, expected_target = gae_loop(reward, value, mask, gamma, lmbda_critic)
    torch.testing.assert_close(advantage, expected_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(target, expected_target, rtol=1e-12, atol=1e-12)


def test_lambda_critic_one_gives_the_plain_return():
    """lmbda_critic = 1 (VAPO's and VC-PPO's choice): the target is the reward-to-go, whatever V."""
    reward, value, mask = vapo_batch(seed=2, garbage=1e6)
    gamma = 0.97
    _, target = masked_gae(reward, value, mask, gamma, 0.95, 1.0)
    expected = torch.zeros_like(target)
    for b, n in enumerate(VAPO_LENGTHS):
        for t in range(n):
            expected[b, t] = sum(gamma ** (k - t) * reward[b, k].item() for k in range(t, n))
    torch.testing.assert_close(target, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("alpha,lmbda_critic", [(0.05, None), (0.05, 1.0), (0.3, 0.9)])
def test_length_adaptive_module_matches_float64_loop(alpha, lmbda_critic):
    reward, value, mask = vapo_batch(seed=3, garbage=1e6)
    td = TensorDict({REWARD: reward, VALUE: value, RESPONSE_MASK: mask}, batch_size=[len(mask)])
    stage = GAE(gamma=0.99, lmbda=0.9, whiten=False, lmbda_critic=lmbda_critic,
                length_adaptive_alpha=alpha)
    out = stage(td)
    clean = vapo_batch(seed=3)  # the oracle never sees the garbage
    expected_adv, _ = gae_loop(*clean, 0.99, vapo_lambda_loop(VAPO_LENGTHS, alpha))
    critic = 0.9 if lmbda_critic is None else lmbda_critic  # the policy lambda does not leak
    _, expected_target = gae_loop(*clean, 0.99, critic)
    torch.testing.assert_close(out[ADVANTAGE], expected_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[VALUE_TARGET], expected_target, rtol=1e-12, atol=1e-12)
    assert (out[ADVANTAGE][~mask] == 0).all() and (out[VALUE_TARGET][~mask] == 0).all()


@pytest.mark.parametrize("block", [1, 4, 32, 128])
def test_per_row_discounted_cumsum_matches_scalar_rows(block):
    """Each row of the per-row path equals the scalar path run on that row alone (float32)."""
    x = torch.randn(6, 70, generator=torch.Generator().manual_seed(4))
    discount = torch.tensor([0.0, 0.5, 0.9, 0.99, 1.0, 0.3])
    got = discounted_cumsum(x, discount, block=block)
    for b in range(6):
        want = discounted_cumsum(x[b:b + 1], float(discount[b]), block=block)
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-5, atol=1e-5)


def test_defaults_are_bit_identical_to_plain_gae():
    """lmbda_critic and length_adaptive_alpha unset: the same numbers as before, bit for bit
    (one pass, the scalar kernel)."""
    reward, value, mask = vapo_batch(seed=5, dtype=torch.float32)
    td = TensorDict({REWARD: reward, VALUE: value, RESPONSE_MASK: mask}, batch_size=[len(mask)])
    out = GAE(gamma=1.0, lmbda=0.95)(td.clone())
    advantage, target = masked_gae(reward, value, mask, 1.0, 0.95)
    same = GAE(gamma=1.0, lmbda=0.95, lmbda_critic=None, length_adaptive_alpha=None)(td.clone())
    assert torch.equal(out[VALUE_TARGET], target) and torch.equal(same[ADVANTAGE], out[ADVANTAGE])
    # an explicit lmbda_critic equal to lmbda computes the same target in a second pass
    twice = masked_gae(reward, value, mask, 1.0, 0.95, 0.95)
    assert torch.equal(twice[0], advantage) and torch.equal(twice[1], target)


@pytest.mark.parametrize("kwargs,name", [({"lmbda_critic": 1.5}, "lmbda_critic"),
                                         ({"lmbda_critic": "1"}, "lmbda_critic"),
                                         ({"length_adaptive_alpha": 0.0}, "length_adaptive_alpha"),
                                         ({"length_adaptive_alpha": -1}, "length_adaptive_alpha"),
                                         ({"length_adaptive_alpha": True}, "length_adaptive_alpha")])
def test_bad_vapo_arguments_raise_user_error(kwargs, name):
    with pytest.raises(UserError, match=name):
        GAE(**kwargs)
