"""The PPO update (core/step/update.py): critic warm-up, NaN guard, target KL, KL as a loss term,
schedules, ptx, and the loss contract -- what the trainer computes for a loss, who adds the KL
term, which metric stops the epochs, and metrics that do not depend on the micro-batch split."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives import LossModule

from rlpipe.core.base import schema as S
from rlpipe.core.config.plan import plan_run
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.step import kl
from rlpipe.core.step.loss import LossContract
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.update import TrainingDiverged, Updater
from rlpipe.plugins.losses.ppo import PPOLoss

from tests import clip_edges
from tests.test_trainer import TINY, params, same, tiny  # the tiny-run helpers, shared


def test_critic_warmup_leaves_the_actor_unchanged(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "train.critic_warmup_steps=1", "run.steps=1"), progress=False)
    actor0, critic0 = params(pipe.models.actor), params(pipe.models.critic)
    pipe.train()
    assert same(actor0, params(pipe.models.actor))
    assert not same(critic0, params(pipe.models.critic))


class NaNLoss(torch.nn.Module):
    """Wraps a loss and makes its objective NaN in the first ``n`` micro-batches (the calls whose
    ``value_pred`` has a graph: one per micro-batch, also where PPO's ``critic_terms`` make two
    calls)."""

    def __init__(self, loss, n):
        super().__init__()
        self.loss, self.n = loss, n

    def forward(self, td: TensorDict):
        out = self.loss(td)
        if self.n > 0 and td[S.VALUE_PRED].requires_grad:
            self.n -= 1
            out["loss_objective"] = out["loss_objective"] * float("nan")
        return out


def test_nan_minibatch_is_skipped_and_repeated_nan_stops(tmp_path):
    cfg = tiny(tmp_path / "a", "run.steps=1", "train.epochs=1", "train.minibatches=2",
               "train.max_bad_steps=2")
    pipe = Pipeline(cfg, progress=False)
    pipe.updater.loss = NaNLoss(pipe.updater.loss, n=1)
    _, metrics = pipe.step()
    assert metrics["train/skipped_minibatches"] == 1
    assert all(torch.isfinite(p).all() for p in pipe.models.actor.parameters())
    pipe.updater.loss.n = 2
    with pytest.raises(TrainingDiverged, match="2 consecutive minibatches"):
        pipe.step()


def test_target_kl_stops_the_epochs(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "train.target_kl=0.0", "train.lr=0.01", "train.epochs=4"),
                    progress=False)
    pipe.step()  # first step: ratio 1 on the first minibatch, approx_kl 0: no stop yet possible
    _, metrics = pipe.step()
    assert metrics["train/early_stopped"] == 1


def test_kl_as_loss_term(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "kl.in=loss", "kl.estimator=k3", "kl.coef=0.5"), progress=False)
    pipe.step()
    batch, metrics = pipe.step()
    reward_total = batch[S.REWARD].sum(-1)
    assert torch.allclose(reward_total, batch[S.SCORE])  # no KL in the reward
    assert metrics["loss/kl"] > 0


def test_cosine_schedule_with_warmup(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "train.schedule=cosine", "train.warmup_steps=2",
                         "train.lr=0.001"), progress=False)
    sched = pipe.updater.scheds["actor"]
    lrs = []
    for _ in range(2 * 2 * 2):  # steps x epochs x minibatches
        lrs.append(sched.get_last_lr()[0])
        sched.step()
    assert lrs[0] == pytest.approx(0.001 / 3) and lrs[1] == pytest.approx(0.002 / 3)
    assert lrs[2] == pytest.approx(0.001) and lrs[-1] < lrs[3] < lrs[2]


def test_ptx_language_modelling_loss(tmp_path):
    (tmp_path / "ptx.txt").write_text("The weather is nice today.\nA short story about a cat.\n")
    pipe = Pipeline(tiny(tmp_path / "run", "ptx.coef=0.5", f"ptx.data={tmp_path / 'ptx.txt'}",
                         "ptx.batch_size=2"), progress=False)
    _, metrics = pipe.step()
    assert metrics["policy/ptx_loss"] > 0
    assert metrics["loss/ptx"] == pytest.approx(0.5 * metrics["policy/ptx_loss"])


# ---- the loss contract -------------------------------------------------------------------------

UPDATE = ("loss/objective", "loss/critic", "loss/kl", "loss/total", "policy/loss",
          "policy/clipfrac", "policy/approx_kl", "policy/entropy", "value/loss", "value/clipfrac")


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A pipeline of the tiny example and one scored rollout batch (shared, read-only)."""
    pipe = Pipeline(tiny(tmp_path_factory.mktemp("rollout"), "train.epochs=1"), progress=False)
    batch, _ = pipe.step()
    return pipe, batch


def updater(pipe, loss, *settings):
    """A fresh Updater over the pipeline's models; ``settings`` are ``(section, key, value)``."""
    cfg = copy.deepcopy(pipe.cfg)
    for section, key, value in settings:
        setattr(getattr(cfg, section), key, value)
    return make(cfg, pipe.models, loss, pipe.temperature, pipe.device, pipe.dist)


def make(cfg, models, loss, temperature=1.0, device=torch.device("cpu"), dist=None):
    """An Updater given the sections of ``cfg`` it reads, as `Pipeline` builds it."""
    return Updater(cfg.train, models, loss, kl.KLPenalty(plan_run(cfg).kl), steps=cfg.run.steps,
                   seed=cfg.run.seed, ptx=cfg.ptx, rollout_mode=cfg.rollout_correction.mode,
                   temperature=temperature, device=device, dist=dist)


def test_update_leaves_the_callers_batch_as_it_was(rollout):
    """The forward's outputs (log_prob, entropy, value_pred) and the minibatch counts go into
    copies (TorchRL's rule): the batch handed to update() keeps its keys and its values."""
    pipe, batch = rollout
    given, before = batch.clone(), batch.clone()
    updater(pipe, PPOLoss(entropy_coef=0.01), ("train", "grad_accum", 2)).update(given)
    assert set(given.keys(True, True)) == set(before.keys(True, True))
    for key in before.keys(True, True):
        assert torch.equal(given[key], before[key]), key


class Recording(PPOLoss):
    """PPOLoss that records, per call, whether ``entropy`` and ``value_pred`` came, with a graph."""

    def __init__(self, entropy: str, critic_terms=(), **kwargs):
        super().__init__(**kwargs)
        self.contract = dataclasses.replace(self.contract, entropy=entropy,
                                            critic_terms=critic_terms)
        self.seen = []

    def forward(self, td):
        got = {k: td.get(k).requires_grad for k in (S.LOG_PROB, S.ENTROPY, S.VALUE_PRED)
               if k in td.keys()}
        self.seen.append(got)
        return super().forward(td)


@pytest.mark.parametrize("entropy, expected", [
    ("grad", {S.LOG_PROB: True, S.ENTROPY: True, S.VALUE_PRED: True}),
    ("detached", {S.LOG_PROB: True, S.ENTROPY: False, S.VALUE_PRED: True}),
    ("none", {S.LOG_PROB: True, S.VALUE_PRED: True})])
def test_the_trainer_computes_what_the_loss_declares(rollout, entropy, expected):
    pipe, batch = rollout
    loss = Recording(entropy)
    updater(pipe, loss).update(batch.clone())
    assert loss.seen and all(seen == expected for seen in loss.seen)


def test_declared_critic_terms_split_the_pass_actor_first(rollout):
    """With ``critic_terms``, each micro-batch calls the loss twice: the actor's pass (log_prob
    and entropy with a graph, value_pred a detached stand-in), then the critic's (value_pred
    with a graph, the actor's outputs detached); the critic's forward starts after the actor's
    backward (its gradients are there), so the two models' activations are never held at once.
    Without the declaration: one call, the critic's forward before any backward."""
    pipe, batch = rollout
    for terms, calls in ((("loss_critic",), [{S.LOG_PROB: True, S.ENTROPY: True, S.VALUE_PRED: False},
                                            {S.LOG_PROB: False, S.ENTROPY: False, S.VALUE_PRED: True}]),
                         ((), [{S.LOG_PROB: True, S.ENTROPY: True, S.VALUE_PRED: True}])):
        models = copy.deepcopy(pipe.models)
        loss, actor_grads = Recording("grad", critic_terms=terms, entropy_coef=0.01), []
        models.critic.register_forward_pre_hook(lambda *_: actor_grads.append(
            all(p.grad is not None for p in models.actor.parameters() if p.requires_grad)))
        make(pipe.cfg, models, loss, pipe.temperature, pipe.device, pipe.dist).update(batch.clone())
        assert loss.seen == calls * (len(loss.seen) // len(calls)) and loss.seen, terms
        assert actor_grads and all(actor_grads) == bool(terms) and any(actor_grads) == bool(terms)


@pytest.mark.parametrize("loss_args, kl_coef", [({}, 0.0), ({"entropy_coef": 0.01}, 0.05),
                                                ({"value_clip": None, "vf_coef": 0.1}, 0.0)])
def test_split_pass_gives_the_joint_update_exactly(rollout, loss_args, kl_coef):
    """PPO declares ``critic_terms``: its two-pass update equals the one-pass update of the same
    loss without the declaration, metric for metric and weight for weight, bit for bit."""
    pipe, batch = rollout
    got = {}
    for terms in (("loss_critic",), ()):
        models, loss = copy.deepcopy(pipe.models), PPOLoss(**loss_args)
        loss.contract = dataclasses.replace(loss.contract, critic_terms=terms)
        cfg = copy.deepcopy(pipe.cfg)
        cfg.train.epochs, cfg.train.grad_accum = 2, 2
        cfg.kl.in_, cfg.kl.coef = "loss", kl_coef
        metrics = make(cfg, models, loss, pipe.temperature, pipe.device,
                       pipe.dist).update(batch.clone())
        weights = {f"{name}.{k}": v.detach().clone() for name in ("actor", "critic")
                   for k, v in getattr(models, name).named_parameters()}
        got[terms] = metrics, weights
    (split, split_w), (joint, joint_w) = got.values()
    assert split == joint
    assert split_w.keys() == joint_w.keys() and all(torch.equal(split_w[k], joint_w[k])
                                                    for k in split_w)


def test_target_kl_without_a_declared_metric_is_a_build_time_error():
    class NoKL(LossModule):
        contract = LossContract()
    models = SimpleNamespace(actor=None, critic=None)  # never reached: the check comes first
    cfg = load_config(TINY, ["train.target_kl=0.02"])
    with pytest.raises(UserError, match="train.target_kl is set but .* declares no approx-KL"):
        make(cfg, models, NoKL())
    values = SimpleNamespace(actor=None, critic=torch.nn.Linear(1, 1))
    with pytest.raises(UserError, match="needs a critic, but .* declares values=False"):
        make(load_config(TINY), values, type("NoValues", (LossModule,), {
            "contract": LossContract(values=False)})())


class LoudKL(PPOLoss):
    """Declares ``policy/always_big`` (always 100) as its approx-KL metric."""

    contract = dataclasses.replace(PPOLoss.contract, approx_kl_metric="policy/always_big")

    def forward(self, td):
        out = super().forward(td)
        out["policy", "always_big"] = torch.tensor(100.0)
        return out


def test_target_kl_reads_the_declared_metric(rollout):
    pipe, batch = rollout
    stop = updater(pipe, LoudKL(), ("train", "target_kl", 1.0), ("train", "epochs", 3))
    assert stop.update(batch.clone())["train/early_stopped"] == 1  # after the first minibatch
    quiet = updater(pipe, PPOLoss(), ("train", "target_kl", 1e6), ("train", "epochs", 2))
    assert quiet.update(batch.clone())["train/early_stopped"] == 0
    missing = updater(pipe, PPOLoss(), ("train", "target_kl", 1.0))
    missing.contract = dataclasses.replace(missing.contract, approx_kl_metric="policy/absent")
    with pytest.raises(UserError, match="declares approx_kl_metric 'policy/absent' but did not"):
        missing.update(batch.clone())


class Bare(LossModule):
    """A third-party loss with no contract: PPO without its own KL term."""

    def __init__(self):
        super().__init__()
        self.ppo = PPOLoss()

    def forward(self, td):
        return self.ppo(td)  # never handed the penalty: no loss_kl of its own


def test_default_kl_term_is_the_losss_own(tmp_path):
    """kl.in: loss -- the trainer's default term (for a loss that does not declare kl_term) and
    PPOLoss's own term are one implementation: the same update, number for number."""
    runs = {}
    for name, make in (("own", PPOLoss), ("default", Bare)):
        pipe = Pipeline(tiny(tmp_path / name, "kl.in=loss", "kl.estimator=k3", "kl.coef=0.5",
                             "run.steps=1"), progress=False)
        pipe.updater = updater(pipe, make())
        runs[name] = pipe.step()[1]
    assert runs["own"]["loss/kl"] > 0
    for key in UPDATE:
        assert runs["default"][key] == runs["own"][key], key


class NoKLTerm(PPOLoss):
    def forward(self, td):
        return super().forward(td).exclude("loss_kl")


def test_a_declared_kl_term_must_be_written(rollout):
    pipe, batch = rollout
    with pytest.raises(UserError, match="declares kl_term but wrote no loss_kl"):
        updater(pipe, NoKLTerm(), ("kl", "in_", "loss"), ("kl", "coef", 0.1)).update(batch.clone())


def test_explained_var_does_not_depend_on_the_micro_batch_split(tmp_path, monkeypatch):
    """1 and 3 micro-batches per minibatch give the same value/explained_var (pooled sums), as
    they give the same losses; a token-weighted mean of micro-batch values would not."""
    got, edges, counts = {}, {}, clip_edges.count_edges(monkeypatch)
    for accum in (1, 3):
        pipe = Pipeline(tiny(tmp_path / str(accum), f"train.grad_accum={accum}", "run.steps=1"),
                        progress=False)
        (_, got[accum]), edges[accum] = clip_edges.counted(counts, pipe.step)
    cfg = pipe.cfg
    tokens = (cfg.data.batch_size * cfg.collector.args["n"] * cfg.train.epochs
              * got[1]["response/length"])
    for key in (*UPDATE[:2], *UPDATE[3:], "value/explained_var"):
        # a clip fraction counts tokens past a hard edge: round-off in the summation order may
        # move across it only the tokens within round-off of it (tests/clip_edges.py's bound)
        tol = ({"abs": clip_edges.tolerance(key, edges[1], edges[3], tokens), "rel": 1e-5}
               if key in clip_edges.FRACTIONS else {"rel": 1e-5, "abs": 1e-6})
        assert got[3][key] == pytest.approx(got[1][key], **tol), (key, edges)
