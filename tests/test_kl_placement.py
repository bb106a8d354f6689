"""Where the KL penalty acts, by advantage kind, and which estimator it uses there: the expected
gradient of the loss term against the analytic gradient of the KL on a categorical policy
(float64), flat rewards that leave a group-relative run exactly where it started, and the
refusals (k1 in the loss, KL in a group-normalised score, a group estimator without groups)."""

import json

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase

from rlpipe.core.config.kl_placement import DEFAULT_ESTIMATOR
from rlpipe.core.config.plan import plan_run
from rlpipe.core.step import kl
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.kinds import AdvantageContract, advantage_contract
from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline
from tests.test_trainer import tiny

GROUP_ESTIMATORS = sorted(  # single-turn runs below: estimators of turns need an environment
    name for name in registry.find("advantages")
    if (c := advantage_contract(registry.load("advantages", name))).needs_groups and not c.needs_turns)


def categorical(seed=0, k=7):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(k, generator=g, dtype=torch.float64).requires_grad_()
    ref = torch.randn(k, generator=g, dtype=torch.float64).log_softmax(-1)
    return theta, ref


def expected_grad(estimator, theta, ref):
    """grad_theta of E_{x ~ pi}[k(log pi(x) - log ref(x))], the sampling distribution held fixed
    (what the loss term's gradient is in expectation over on-policy tokens): exact, by summing
    over every category with weight pi(x)."""
    logp = theta.log_softmax(-1)
    est = kl.kl_per_token(logp, ref, estimator, clamp=None)
    (grad,) = torch.autograd.grad((logp.exp().detach() * est).sum(), theta)
    return grad


def reverse_kl_grad(theta, ref):
    """Analytic grad_theta KL(pi || ref) for pi = softmax(theta): pi * (log(pi/ref) - KL)."""
    p = theta.detach().softmax(-1)
    log_ratio = p.log() - ref
    return p * (log_ratio - (p * log_ratio).sum())


@pytest.mark.parametrize("seed", range(5))
def test_k2_loss_gradient_is_the_exact_reverse_kl_gradient(seed):
    theta, ref = categorical(seed)
    torch.testing.assert_close(expected_grad("k2", theta, ref), reverse_kl_grad(theta, ref),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seed", range(5))
def test_k3_loss_gradient_is_the_forward_kl_gradient(seed):
    theta, ref = categorical(seed)  # grad_theta KL(ref || pi) = pi - ref
    forward = theta.detach().softmax(-1) - ref.exp()
    torch.testing.assert_close(expected_grad("k3", theta, ref), forward, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seed", range(5))
def test_k1_loss_gradient_is_zero_in_expectation(seed):
    theta, ref = categorical(seed)
    assert expected_grad("k1", theta, ref).abs().max() < 1e-15
    assert reverse_kl_grad(theta, ref).abs().max() > 1e-2  # while the KL itself has a gradient


def test_the_loss_default_estimator_follows_the_reverse_kl_through_loss_term():
    """Monte Carlo through `kl.loss_term` itself (tokens drawn from pi, a [1, N] row): its
    gradient estimates the reverse-KL gradient; k1's estimates 0."""
    theta, ref = categorical(3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.multinomial(theta.detach().softmax(-1), 400_000, True, generator=g)[None]
    mask = torch.ones_like(tokens, dtype=torch.bool)

    def grad(estimator):
        logp = theta.log_softmax(-1)
        term = kl.loss_term(logp[tokens], ref[tokens], mask, 1.0, tokens.numel(), estimator)
        return torch.autograd.grad(term, theta)[0]

    target = reverse_kl_grad(theta, ref)
    assert DEFAULT_ESTIMATOR["loss"] == "k2"
    assert (grad("k2") - target).abs().max() < 0.05 * target.abs().max()
    assert grad("k1").abs().max() < 0.05 * target.abs().max()


def zero(prompts, responses, **batch):
    return [0.0] * len(prompts)


@pytest.mark.parametrize("advantage", GROUP_ESTIMATORS)
def test_flat_rewards_leave_a_group_run_where_it_started(tmp_path, advantage):
    """Every score equal: the policy-gradient term is exactly 0, and the KL term (in the loss by
    default, k2) has no gradient at pi = pi_ref beyond round-off, so the KL stays at round-off.
    One optimizer step per PPO step: with several, Adam's normalised step turns the first
    minibatch's round-off gradient into lr-sized moves (k2/k3 then hold the sequence KL near
    0.045 on this example, k1 lets it climb to 0.9; the issue notes, tests/README).
    Random weights: their round-off gradient here is exactly 0; the example's warm-started
    weights give 4e-8 at step 1, which Adam's first (normalised) step turns into lr-sized moves.
    On the CPU: on CUDA the reference's scoring pass and the actor's update pass run other
    kernels for their other batch shapes, so pi and pi_ref differ by ~1e-6 in log-prob before
    any update (kl/ref 1e-12 at step 1 on an H200, 2026-11-28), and Adam's first step moves
    every weight by lr whatever that gradient's size: this test's exact-zero premise is the CPU's."""
    cfg = tiny(tmp_path, f"advantage.name={advantage}", "collector.n=2", "kl.coef=0.5",
               "run.steps=3", "train.epochs=1", "train.minibatches=1", "models.actor.init=random",
               "run.device=cpu")
    pipe = Pipeline(cfg, progress=False, rewards=[zero])
    assert (pipe.plan.kl.in_, pipe.plan.kl.estimator) == ("loss", "k2")
    assert (pipe.kl.where, pipe.kl.estimator) == ("loss", "k2")  # the run's one penalty
    assert (pipe.cfg.kl.in_, pipe.cfg.kl.estimator) == (None, None)  # never written back
    batch, first = pipe.step()
    assert batch[S.ADVANTAGE].abs().max() == 0 and first["policy/loss"] == 0
    run_dir = pipe.train()
    rows = [first] + [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/grad_norm"] < 1e-5 and abs(r["kl/ref"]) < 1e-6 for r in rows), rows
    # the same run with k1 in the loss (what the refusal prevents) moves at once
    cfg = tiny(tmp_path / "k1", f"advantage.name={advantage}", "collector.n=2", "kl.coef=0.5",
               "run.steps=1", "train.epochs=1", "train.minibatches=1", "models.actor.init=random")
    cfg.kl.estimator = "k3"
    pipe = Pipeline(cfg, progress=False, rewards=[zero])
    pipe.kl.estimator = "k1"  # the run's one penalty: the loop's, the trainer's and the loss's
    assert pipe.step()[1]["train/grad_norm"] > 1e-2


def test_k1_in_the_loss_moves_the_policy_on_flat_rewards():
    """The pathology the refusal prevents (the k1 loss term's gradient is a sum of grad log pi,
    0 only in expectation): on a sampled batch it is not 0."""
    theta, ref = categorical(0)
    tokens = torch.tensor([[0, 0, 3]])
    logp = theta.log_softmax(-1)
    term = kl.loss_term(logp[tokens], ref[tokens], torch.ones(1, 3, dtype=torch.bool), 1.0, 3,
                        "k1")
    assert torch.autograd.grad(term, theta)[0].abs().max() > 1e-3


@pytest.mark.parametrize("advantage", ["gae", "reinforce_pp"])
def test_estimators_with_their_own_baseline_keep_the_kl_in_the_reward(tmp_path, advantage):
    plan = plan_run(tiny(tmp_path, f"advantage.name={advantage}"))
    assert (plan.kl.in_, plan.kl.estimator, plan.kl.chosen) == ("reward", "k1",
                                                                 ("kl.in", "kl.estimator"))


def test_k1_in_the_loss_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"^kl.estimator: k1 in the loss regularises nothing"):
        tiny(tmp_path, "advantage.name=grpo", "collector.n=2", "kl.estimator=k1")
    plan = plan_run(tiny(tmp_path, "advantage.name=grpo", "collector.n=2", "kl.estimator=k3"))
    assert (plan.kl.in_, plan.kl.estimator, plan.kl.chosen) == ("loss", "k3", ("kl.in",))


def test_kl_in_a_group_normalised_score_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"^kl.in: reward puts -coef \* KL into each sample's "
                                        r"score, and advantage .*grpo .* set kl.in: loss"):
        tiny(tmp_path, "advantage.name=grpo", "collector.n=2", "kl.in=reward")
    # no std scaling (Dr. GRPO), a leave-one-out baseline, or no KL at all: allowed
    for extra in (["advantage.scale_std=false"], [], ["kl.coef=0"]):
        name = "rloo" if extra == [] else "grpo"
        cfg = tiny(tmp_path, f"advantage.name={name}", "collector.n=2", "kl.in=reward", *extra)
        assert plan_run(cfg).kl.in_ == "reward"


class GroupedBaseline(TensorDictModuleBase):
    """A third-party estimator that declares it compares the samples of a prompt."""

    contract = staticmethod(lambda: AdvantageContract(needs_critic=False, needs_groups=True))
    in_keys, out_keys = [S.REWARD, S.RESPONSE_MASK, S.GROUP_ID], [S.ADVANTAGE, S.VALUE_TARGET]

    def forward(self, td: TensorDict) -> TensorDict:
        td[S.ADVANTAGE] = td[S.VALUE_TARGET] = torch.zeros_like(td[S.REWARD])
        return td


@pytest.mark.parametrize("name", [*GROUP_ESTIMATORS, f"{__name__}:GroupedBaseline"])
def test_group_estimators_refuse_one_sample_per_prompt(tmp_path, name):
    with pytest.raises(UserError, match=r"^collector.n: advantage .* needs collector.n >= 2 "
                                        r"\(got 1\)"):
        tiny(tmp_path, f"advantage={{name: {name}}}", "collector.n=1")
    tiny(tmp_path, f"advantage={{name: {name}}}", "collector.n=2")  # two samples: accepted


def test_a_python_stage_gets_its_own_placement_and_refusals(tmp_path):
    """A stage given from Python is checked like a configured one, and kl.in left to the
    advantage follows the one that runs."""
    from rlpipe.plugins.advantages import GRPO

    cfg = tiny(tmp_path, "collector.n=1")
    assert plan_run(cfg).kl.in_ == "reward"  # gae
    with pytest.raises(UserError, match=r"^collector.n: .* needs collector.n >= 2"):
        Pipeline(cfg, progress=False, advantage=GRPO())
    cfg = tiny(tmp_path, "collector.n=2")
    pipe = Pipeline(cfg, progress=False, advantage=GRPO())
    assert (pipe.plan.kl.in_, pipe.plan.kl.estimator) == ("loss", "k2")
    assert plan_run(cfg).kl.in_ == "reward"  # the config itself is unchanged: gae's
