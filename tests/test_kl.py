"""KL estimators, where the penalty acts, reward shaping, the loss term and the KL controllers
against plain-Python formulas."""

import math

import pytest
import torch

from rlpipe.core.base.errors import UserError
from rlpipe.core.step.kl import (ESTIMATORS, AdaptiveKLController, FixedKLController, estimate,
                            kl_per_token, loss_term, shape_reward, split_coef)

FORMULAS = {
    "k1": lambda lp, ref: lp - ref,
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1,
}


@pytest.mark.parametrize("estimator", sorted(FORMULAS))
def test_estimators_match_formulas(estimator):
    gen = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    expected = [[FORMULAS[estimator](a, b) for a, b in zip(row_lp, row_ref)]
                for row_lp, row_ref in zip(log_prob.tolist(), ref.tolist())]
    got = kl_per_token(log_prob, ref, estimator)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)


def test_k3_is_unbiased_for_sampled_tokens():
    """E_pi[k3] = KL(pi || ref) over a small categorical (exact expectation, no sampling)."""
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    k3 = kl_per_token(pi.log(), ref.log(), "k3")
    exact = sum(p * math.log(p / q) for p, q in zip(pi.tolist(), ref.tolist()))
    assert abs((pi * k3).sum().item() - exact) < 1e-12


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_estimate_of_log_q_over_p_is_kl_q_p(estimator):
    """``estimate(log q - log p)`` over x ~ q has expectation KL(q || p) (k1, k3 unbiased), and
    k2 is Schulman's 1/2 E_q[(log q/p)^2], all exact over a small categorical."""
    q = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    p = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    exact = sum(a * math.log(a / b) for a, b in zip(q.tolist(), p.tolist()))
    got = (q * estimate(q.log() - p.log(), estimator)).sum().item()
    assert got == pytest.approx(exact, rel=1e-12)
    k2 = sum(a * 0.5 * math.log(a / b) ** 2 for a, b in zip(q.tolist(), p.tolist()))
    assert (q * estimate(q.log() - p.log(), "k2")).sum().item() == pytest.approx(k2, rel=1e-12)


def test_split_coef_puts_beta_where_the_penalty_acts():
    assert split_coef("reward", 0.3) == (0.3, 0.0)
    assert split_coef("loss", 0.3) == (0.0, 0.3)
    with pytest.raises(UserError, match="kl.in"):
        split_coef("advantage", 0.3)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_loss_term_matches_a_float64_loop_and_adds_up_over_micro_batches(estimator):
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 0, 2, 5, 1, 3]
    mask = torch.arange(5) < torch.tensor(lengths).unsqueeze(-1)
    logp = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 2
    ref = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 2
    logp, ref = torch.where(mask, logp, 1e4), torch.where(mask, ref, -1e4)  # garbage on padding
    coef, n = 0.7, sum(lengths)
    expected = coef * sum(FORMULAS[estimator](logp[b, t].item(), ref[b, t].item())
                          for b in range(6) for t in range(lengths[b])) / n
    whole = loss_term(logp, ref, mask, coef, n, estimator)
    assert whole.item() == pytest.approx(expected, rel=1e-12)
    parts = [loss_term(a, b, m, torch.tensor(coef, dtype=torch.float64), torch.tensor(float(n)),
                       estimator) for a, b, m in zip(logp.split(2), ref.split(2), mask.split(2))]
    assert sum(parts).item() == pytest.approx(expected, rel=1e-12)
    leaf = logp.clone().requires_grad_()
    loss_term(leaf, ref, mask, coef, n, estimator).backward()
    assert (leaf.grad[~mask] == 0).all() and leaf.grad[mask].abs().sum() > 0
    assert loss_term(logp, ref, torch.zeros_like(mask), coef, 0, estimator).item() == 0.0


def test_unknown_estimator_raises_user_error():
    with pytest.raises(UserError, match="k4"):
        kl_per_token(torch.zeros(1), torch.zeros(1), "k4")


def test_score_on_last_valid_token_never_on_padding():
    # rows: truncated (full length), EOS at position 2, zero-length, single token
    lengths = [5, 3, 0, 1]
    mask = torch.arange(5) < torch.tensor(lengths).unsqueeze(-1)
    kl = torch.where(mask, torch.rand(4, 5, dtype=torch.float64), 1e9)  # garbage on padding
    score = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    coef = 0.3
    reward = shape_reward(score, kl, mask, coef)
    for b, n in enumerate(lengths):
        for t in range(5):
            expected = 0.0
            if t < n:
                expected = -coef * kl[b, t].item() + (score[b].item() if t == n - 1 else 0.0)
            assert reward[b, t].item() == pytest.approx(expected, abs=1e-12), (b, t)
    assert (reward[2] == 0).all() and torch.isfinite(reward).all()


def test_score_dtype_and_tensor_coef():
    mask = torch.tensor([[True, True, False]])
    reward = shape_reward(torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3),
                          mask, torch.tensor(0.5))
    assert reward.dtype == torch.float32
    assert reward.tolist() == [[-0.5, 0.5, 0.0]]


def paper_coefs(init, target, horizon, kls, n_steps):
    coef, out = init, []
    for kl in kls:
        error = min(max((kl - target) / target, -0.2), 0.2)
        coef = coef * (1 + error * n_steps / horizon)
        out.append(coef)
    return out


def test_adaptive_controller_follows_paper_with_clipping():
    kls = [6.0, 30.0, 0.0, 6.6, 5.7, 100.0]  # on target, clipped up, clipped down, inside
    ctl = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10_000)
    got = []
    for kl in kls:
        ctl.update(torch.tensor(kl, dtype=torch.float64), n_steps=256)
        got.append(ctl.value)
    assert got == pytest.approx(paper_coefs(0.2, 6.0, 10_000, kls, 256), rel=1e-12)
    assert got[1] == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000), rel=1e-12)
    assert got[2] == pytest.approx(got[1] * (1 - 0.2 * 256 / 10_000), rel=1e-12)


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    for kl in [0.0, 1.0, 1e6]:
        ctl.update(kl, n_steps=512)
    assert ctl.value == 0.05


def test_state_dict_round_trip():
    ctl = AdaptiveKLController(init_coef=0.1, target=3.0, horizon=1000)
    ctl.update(9.0, n_steps=100)
    fresh = AdaptiveKLController(init_coef=0.1, target=3.0, horizon=1000)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value != 0.1
    fixed = FixedKLController(0.7)
    fixed.load_state_dict(FixedKLController(0.3).state_dict())
    assert fixed.value == 0.3


@pytest.mark.parametrize("make", [lambda: FixedKLController(-1.0),
                                  lambda: AdaptiveKLController(0.1, target=0.0, horizon=10),
                                  lambda: AdaptiveKLController(0.1, target=1.0, horizon=-5),
                                  lambda: AdaptiveKLController(float("nan"), 1.0, 10)])
def test_bad_controller_arguments_raise_user_error(make):
    with pytest.raises(UserError):
        make()
