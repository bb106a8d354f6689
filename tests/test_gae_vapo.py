"""VAPO-style GAE (decoupled lambda_critic, length-adaptive policy lambda) against a float64
plain loop, on right-padded responses with garbage on padding; the defaults change nothing."""

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.schema import ADVANTAGE, RESPONSE_MASK, REWARD, VALUE, VALUE_TARGET
from rlpipe.plugins.advantages.gae import (GAE, discounted_cumsum, length_adaptive_lambda,
                                           masked_gae)

LENGTHS = [0, 70, 3, 45, 1, 20, 0, 69, 21, 33]  # empty, full (R = 70) and alpha*l around 1
R = 70


def make_batch(lengths=LENGTHS, seed=0, garbage=0.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(R) < torch.tensor(lengths).unsqueeze(-1)
    reward = torch.randn(len(lengths), R, generator=gen, dtype=dtype)
    value = torch.randn(len(lengths), R, generator=gen, dtype=dtype)
    return torch.where(mask, reward, garbage), torch.where(mask, value, garbage), mask


def gae_loop(reward, value, mask, gamma, lambdas):
    """Plain-Python float64 GAE with one lambda per row; returns advantages and V + A."""
    adv = [[0.0] * R for _ in range(len(mask))]
    target = [[0.0] * R for _ in range(len(mask))]
    for b, row_mask in enumerate(mask.tolist()):
        n, running = sum(row_mask), 0.0
        for t in reversed(range(n)):
            next_value = value[b, t + 1].item() if t + 1 < n else 0.0
            delta = reward[b, t].item() + gamma * next_value - value[b, t].item()
            running = delta + gamma * lambdas[b] * running
            adv[b][t] = running
            target[b][t] = running + value[b, t].item()
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(target, dtype=torch.float64)


def vapo_lambda_loop(lengths, alpha):
    """The paper's formula, row by row: 1 - 1/(alpha l), 0 where alpha l <= 1."""
    return [1 - 1 / (alpha * n) if alpha * n > 1 else 0.0 for n in lengths]


@pytest.mark.parametrize("alpha", [0.05, 0.2, 1.0])
def test_length_adaptive_lambda_is_the_formula(alpha):
    _, _, mask = make_batch()
    expected = torch.tensor(vapo_lambda_loop(LENGTHS, alpha), dtype=torch.float64)
    torch.testing.assert_close(length_adaptive_lambda(mask, alpha), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("gamma,lmbda,lmbda_critic", [(1.0, 0.95, 1.0), (0.9, 0.0, 0.7),
                                                      (0.99, 1.0, 0.0)])
def test_decoupled_lambda_matches_float64_loop(gamma, lmbda, lmbda_critic):
    reward, value, mask = make_batch(seed=1)
    advantage, target = masked_gae(reward, value, mask, gamma, lmbda, lmbda_critic)
    expected_adv, _ = gae_loop(reward, value, mask, gamma, [lmbda] * len(mask))
    _, expected_target = gae_loop(reward, value, mask, gamma, [lmbda_critic] * len(mask))
    torch.testing.assert_close(advantage, expected_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(target, expected_target, rtol=1e-12, atol=1e-12)


def test_lambda_critic_one_gives_the_plain_return():
    """lmbda_critic = 1 (VAPO's and VC-PPO's choice): the target is the reward-to-go, whatever V."""
    reward, value, mask = make_batch(seed=2, garbage=1e6)
    gamma = 0.97
    _, target = masked_gae(reward, value, mask, gamma, 0.95, 1.0)
    expected = torch.zeros_like(target)
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            expected[b, t] = sum(gamma ** (k - t) * reward[b, k].item() for k in range(t, n))
    torch.testing.assert_close(target, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("alpha,lmbda_critic", [(0.05, None), (0.05, 1.0), (0.3, 0.9)])
def test_length_adaptive_module_matches_float64_loop(alpha, lmbda_critic):
    reward, value, mask = make_batch(seed=3, garbage=1e6)
    td = TensorDict({REWARD: reward, VALUE: value, RESPONSE_MASK: mask}, batch_size=[len(mask)])
    stage = GAE(gamma=0.99, lmbda=0.9, whiten=False, lmbda_critic=lmbda_critic,
                length_adaptive_alpha=alpha)
    out = stage(td)
    clean = make_batch(seed=3)  # the oracle never sees the garbage
    expected_adv, _ = gae_loop(*clean, 0.99, vapo_lambda_loop(LENGTHS, alpha))
    critic = 0.9 if lmbda_critic is None else lmbda_critic  # the policy lambda does not leak
    _, expected_target = gae_loop(*clean, 0.99, [critic] * len(mask))
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
    reward, value, mask = make_batch(seed=5, dtype=torch.float32)
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
