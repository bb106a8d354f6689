"""kl.clamp: the log-ratio bound before the KL estimator, against the formulas in float64; it
changes nothing inside the bound, keeps k3 and its gradient finite at a log-ratio of -100, and a
PPO step with such a token gives finite advantages (with the clamp) or one named error (without
it), never NaN advantages."""

import math

import pytest
import torch

from rlpipe.core.contracts import guards
from rlpipe.core.step import kl
from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline

from tests.test_trainer import TINY, tiny

FORMULAS = {"k1": lambda r: r, "k2": lambda r: r * r / 2, "k3": lambda r: math.exp(-r) - 1 + r}
LOG_RATIOS = [-100.0, -10.5, -10.0, -3.0, 0.0, 0.25, 9.99, 10.0, 50.0]


@pytest.mark.parametrize("estimator", kl.ESTIMATORS)
@pytest.mark.parametrize("clamp", [10.0, 3.0])
def test_clamped_estimate_matches_the_formula(estimator, clamp):
    ratios = torch.tensor(LOG_RATIOS, dtype=torch.float64)
    got = kl.kl_per_token(ratios - 1.0, torch.full_like(ratios, -1.0), estimator, clamp)
    expected = [FORMULAS[estimator](min(max(r, -clamp), clamp)) for r in LOG_RATIOS]
    assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("estimator", kl.ESTIMATORS)
def test_clamp_changes_nothing_inside_the_bound(estimator):
    gen = torch.Generator().manual_seed(0)
    logp, ref = -5 * torch.rand(4, 9, generator=gen), -5 * torch.rand(4, 9, generator=gen)
    assert (logp - ref).abs().max() < 10
    assert torch.equal(kl.kl_per_token(logp, ref, estimator, 10.0),
                       kl.kl_per_token(logp, ref, estimator))


def test_k3_overflows_float32_without_the_clamp_and_not_with_it():
    logp, ref = torch.tensor([[-100.0, -1.0]]), torch.tensor([[0.0, -1.0]])
    assert torch.isinf(kl.kl_per_token(logp, ref, "k3")).any()
    bounded = kl.kl_per_token(logp, ref, "k3", clamp=10.0)
    assert bounded[0].tolist() == pytest.approx([math.exp(10) - 11, 0.0], rel=1e-6)


def test_loss_term_gradient_is_finite_with_the_clamp():
    """kl.in: loss -- the clamped token gets no gradient, the others the usual one."""
    mask = torch.tensor([[True, True, False]])
    ref = torch.tensor([[0.0, -1.0, 0.0]])
    for clamp, finite in ((10.0, True), (None, False)):
        logp = torch.tensor([[-100.0, -0.5, 0.0]], requires_grad=True)
        kl.loss_term(logp, ref, mask, 1.0, 2.0, "k3", clamp).backward()
        assert bool(torch.isfinite(logp.grad).all()) is finite
    # d/dx (exp(-x) - 1 + x) / 2 at x = 0.5: (1 - exp(-0.5)) / 2; the clamped token: 0
    logp = torch.tensor([[-100.0, -0.5, 0.0]], requires_grad=True)
    kl.loss_term(logp, ref, mask, 1.0, 2.0, "k3", 10.0).backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, (1 - math.exp(-0.5)) / 2, 0.0])


def test_non_finite_log_probs_stay_an_error_under_the_clamp():
    mask = torch.tensor([[True, True]])
    td = {S.RESPONSE_MASK: mask, S.OLD_LOG_PROB: torch.tensor([[-1.0, -1.0]]),
          S.REF_LOG_PROB: torch.tensor([[-float("inf"), -1.0]])}
    kl_tok = kl.kl_per_token(td[S.OLD_LOG_PROB], td[S.REF_LOG_PROB], "k1", clamp=10.0)
    assert torch.isfinite(kl_tok).all()  # the clamp would hide it ...
    with pytest.raises(UserError, match=r"ref_log_prob \(reference\) at 1"):
        guards.check_kl(td, kl_tok, "k1")  # ... the check does not


def extreme_token(pipe, monkeypatch):
    """Make log pi - log pi_ref = -100 on the first valid response token of the first sample."""
    score = pipe._score_tokens

    def scored(td):
        score(td)
        row = int(td[S.RESPONSE_MASK].any(-1).nonzero()[0])
        td[S.REF_LOG_PROB][row, 0] = td[S.OLD_LOG_PROB][row, 0] + 100.0
    monkeypatch.setattr(pipe, "_score_tokens", scored)


def test_a_step_with_an_extreme_token_has_finite_advantages(tmp_path, monkeypatch):
    pipe = Pipeline(tiny(tmp_path, "kl.estimator=k3", "run.steps=1"), progress=False)
    extreme_token(pipe, monkeypatch)
    batch, metrics = pipe.step()
    assert torch.isfinite(batch[S.ADVANTAGE]).all() and torch.isfinite(batch[S.REWARD]).all()
    n = batch.batch_size[0]  # kl/ref: the mean over samples of each one's summed KL
    assert math.isfinite(metrics["kl/ref"])
    assert metrics["kl/ref"] == pytest.approx((math.exp(10) - 11) / n, rel=0.01)


def test_without_the_clamp_the_step_stops_with_a_named_error(tmp_path, monkeypatch):
    pipe = Pipeline(tiny(tmp_path, "kl.estimator=k3", "kl.clamp=null", "run.steps=1"),
                    progress=False)
    extreme_token(pipe, monkeypatch)
    with pytest.raises(UserError, match="k3 estimator overflowed.*set kl.clamp"):
        pipe.step()


@pytest.mark.parametrize("value,ok", [("0", False), ("-1", False), ("null", True), ("20", True)])
def test_clamp_range(value, ok):
    if ok:
        load_config(TINY, [f"kl.clamp={value}"])
    else:
        with pytest.raises(UserError, match="kl.clamp: must be > 0"):
            load_config(TINY, [f"kl.clamp={value}"])
