"""Rollout correction (core/step/rollout_correction.py): weights and metrics against plain float64 loops,
the PPO loss's weighted surrogate, the contract and config checks, and on the tiny example with
the HF engine (the actor itself) every mode reduces to plain PPO; bypass skips the actor's
recompute forward and its first ratio is 1."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.step import rollout_correction as rc
from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.step.loss import LossContract
from rlpipe.core.models.lm import response_logprobs, response_values
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.update import _checked_contract
from rlpipe.plugins.losses.ppo import PPOLoss
from tests import clip_edges

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)


def batch_of_logprobs(seed=0):
    """Old and engine log-probs [4, 6] with a gap of up to ~1 nat, one empty row, ragged rows."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) * 3
    engine = old + (torch.rand(4, 6, generator=g) - 0.5) * 2
    lengths = torch.tensor([6, 3, 0, 1])
    mask = torch.arange(6) < lengths[:, None]
    return old, engine, mask


def oracle_weights(old, engine, mask, mode, level, c):
    """A float64 loop: per-token (or per-sequence product) ratio, truncated or masked."""
    out = []
    for b in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[b, t]]
        seq = math.exp(sum(float(old[b, t]) - float(engine[b, t]) for t in valid))
        row = []
        for t in range(old.shape[1]):
            if not mask[b, t]:
                row.append(0.0)
                continue
            w = seq if level == "sequence" else math.exp(float(old[b, t]) - float(engine[b, t]))
            row.append(min(w, c) if mode == "tis" else (w if 1 / c <= w <= c else 0.0))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("c", [1.0, 1.5, 3.0])
def test_weights_equal_a_float64_loop(mode, level, c):
    old, engine, mask = batch_of_logprobs()
    got = rc.correction_weights(rc.log_weights(old, engine, mask, level), mask, mode, c)
    expected = oracle_weights(old, engine, mask, mode, level, c)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-7)
    if mode == "mis" and c == 1.5:
        assert 0 < (expected[mask] == 0).sum() < mask.sum(), "the case masks some tokens, not all"


def test_sequence_weights_do_not_overflow():
    old, engine = torch.zeros(1, 400), torch.full((1, 400), -1.0)   # product e^400
    mask = torch.ones(1, 400, dtype=torch.bool)
    log_w = rc.log_weights(old, engine, mask, "sequence")
    assert rc.correction_weights(log_w, mask, "tis", 2.0).eq(2.0).all()
    assert rc.correction_weights(log_w, mask, "mis", 2.0).eq(0.0).all()
    d = rc.diagnostics(old, engine, mask, "sequence")
    assert all(math.isfinite(v) for v in d.values()), d


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_diagnostics_equal_a_float64_loop(level):
    old, engine, mask = batch_of_logprobs(1)
    c = 1.5 if level == "token" else 2.5   # sequence weights here: 0.60, 0.15 (masked), 0.47
    weights = rc.correction_weights(rc.log_weights(old, engine, mask, level), mask, "mis", c)
    got = rc.diagnostics(old, engine, mask, level, weights)
    tokens = [(b, t) for b in range(4) for t in range(6) if mask[b, t]]
    if level == "token":
        w = [math.exp(float(old[b, t]) - float(engine[b, t])) for b, t in tokens]
    else:
        w = [math.exp(sum(float(old[b, t]) - float(engine[b, t]) for t in range(6) if mask[b, t]))
             for b in range(4) if mask[b].any()]
    kl = [math.exp(float(old[b, t]) - float(engine[b, t])) - 1 - (float(old[b, t]) - float(engine[b, t]))
          for b, t in tokens]   # k3 of KL(engine || old): r - 1 - log r, r = old / engine
    masked = sum(float(weights[b, t]) == 0.0 for b, t in tokens) / len(tokens)
    expected = {"rollout/is_weight_mean": sum(w) / len(w), "rollout/is_weight_max": max(w),
                "rollout/ess": sum(w) ** 2 / (len(w) * sum(x * x for x in w)),
                "rollout/mismatch_kl": sum(kl) / len(kl), "rollout/masked_frac": masked}
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-6), key
    assert 0 < got["rollout/masked_frac"] < 1


def test_no_gap_gives_unit_weights_and_zero_kl():
    old, _, mask = batch_of_logprobs()
    d = rc.diagnostics(old, old.clone(), mask)
    assert d == {"rollout/is_weight_mean": 1.0, "rollout/is_weight_max": 1.0, "rollout/ess": 1.0,
                 "rollout/mismatch_kl": 0.0, "rollout/masked_frac": 0.0}


def test_ppo_loss_weights_each_tokens_clipped_surrogate():
    """loss_objective = sum_t w_t max(-A r, -A clip(r)) / num_tokens, as a float64 loop."""
    g = torch.Generator().manual_seed(3)
    logp, old, adv = (torch.randn(3, 5, generator=g) * 0.3 for _ in range(3))
    mask = torch.arange(5) < torch.tensor([[5], [2], [4]])
    weight = torch.rand(3, 5, generator=g) * 2 * mask
    td = TensorDict({S.LOG_PROB: logp, S.OLD_LOG_PROB: old, S.ADVANTAGE: adv,
                     S.RESPONSE_MASK: mask, S.ROLLOUT_IS_WEIGHT: weight}, batch_size=[3])
    got = PPOLoss(clip_low=0.2, clip_high=0.28)(td)["loss_objective"].item()
    total = 0.0
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                r, a = math.exp(float(logp[b, t]) - float(old[b, t])), float(adv[b, t])
                total += float(weight[b, t]) * max(-a * r, -a * min(max(r, 0.8), 1.28))
    assert got == pytest.approx(total / int(mask.sum()), rel=1e-5)
    unweighted = PPOLoss(clip_low=0.2, clip_high=0.28)(td.exclude(S.ROLLOUT_IS_WEIGHT))
    assert unweighted["loss_objective"].item() != pytest.approx(got)


def _run(mode):
    return SimpleNamespace(target_kl=None), mode  # the train section, rollout_correction.mode


def test_weighting_modes_need_a_loss_that_declares_rollout_weights():
    class Plain(torch.nn.Module):
        contract = LossContract()

    models = SimpleNamespace(critic=None)
    for mode in ("tis", "mis"):
        with pytest.raises(UserError, match=f"rollout_correction.mode: {mode} .*rollout_weights"):
            _checked_contract(*_run(mode), models, Plain(), None)
        assert _checked_contract(*_run(mode), models, PPOLoss(), None).rollout_weights
    for mode in ("none", "bypass"):   # bypass needs nothing from the loss
        assert _checked_contract(*_run(mode), models, Plain(), None) == LossContract()


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *overrides])


@pytest.mark.parametrize("overrides, match", [
    (["rollout_correction.mode=tis", "collector.top_p=0.9"], "collector.score_truncated: true"),
    (["rollout_correction.mode=bypass", "collector.top_k=5"], "collector.score_truncated: true"),
    (["rollout_correction.mode=clip"], "rollout_correction.mode"),
    (["rollout_correction.level=batch"], "rollout_correction.level"),
    (["rollout_correction.threshold=0.5"], "rollout_correction.threshold"),
    (["run.preflight_max_kl=0"], "run.preflight_max_kl"),
])
def test_bad_settings_are_one_line_errors_at_load(tmp_path, overrides, match):
    with pytest.raises(UserError, match=match):
        tiny(tmp_path, *overrides)


def test_truncated_sampling_is_fine_once_scored_truncated_or_greedy(tmp_path):
    tiny(tmp_path, "rollout_correction.mode=tis", "collector.top_p=0.9",
         "collector.score_truncated=true")
    tiny(tmp_path, "rollout_correction.mode=mis", "collector.top_k=3", "collector.temperature=0")
    tiny(tmp_path, "collector.top_p=0.9")   # mode none: nothing compares the two


def test_a_collector_must_report_engine_log_probs(tmp_path):
    """Every sampling collector writes engine_log_prob (DESIGN.md); one that does not is one line
    naming it at its first batch, whatever the rollout_correction mode."""
    from rlpipe.plugins.collectors.hf import HFCollector

    class Silent(HFCollector):
        def collect(self, prompts):
            batch = super().collect(prompts)
            del batch[S.ENGINE_LOG_PROB]
            return batch

    pipe = Pipeline(load_config(TINY, [f"run.output_dir={tmp_path}", "run.steps=1"]),
                    progress=False, collector=Silent)
    with pytest.raises(UserError, match=r"collector .*Silent.* did not write 'engine_log_prob'"):
        pipe.step()


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


STEP_METRICS = ("reward/score", "kl/ref", "policy/loss", "policy/clipfrac", "policy/approx_kl",
                "value/loss", "loss/objective", "loss/critic", "response/length")


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_every_mode_is_plain_ppo_when_the_engine_is_the_actor(tmp_path, temperature, monkeypatch):
    """HF collector, same weights: the weights are 1 within round-off, so tis, mis and bypass
    give plain PPO's samples, losses and updates (two steps: the second starts from the update).
    policy/clipfrac may differ by the tokens within round-off of a clip edge
    (tests/clip_edges.py)."""
    runs, edges, counts = {}, {}, clip_edges.count_edges(monkeypatch)
    for mode in ("none", "tis", "mis", "bypass"):
        cfg = tiny(tmp_path / mode, "run.steps=2", f"rollout_correction.mode={mode}",
                   f"collector.temperature={temperature}", "data.batch_size=4",
                   "collector.max_new_tokens=8", "train.epochs=1")
        from rlpipe.core.run.pipeline import train

        run_dir, edges[mode] = clip_edges.counted(counts, lambda: train(cfg, progress=False))
        runs[mode] = read_metrics(run_dir)
    for mode in ("tis", "mis", "bypass"):
        for step, (plain, other) in enumerate(zip(runs["none"], runs[mode])):
            tokens = 4 * cfg.collector.args["n"] * plain["response/length"]  # epochs: 1
            for key in STEP_METRICS:
                tol = (clip_edges.tolerance(key, edges["none"], edges[mode], tokens)
                       if key in clip_edges.FRACTIONS else 0)
                assert other[key] == pytest.approx(plain[key], rel=1e-4, abs=max(tol, 1e-6)), \
                    (mode, step, key, edges)
    for mode in ("none", "tis", "mis"):
        for row in runs[mode]:
            assert row["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
            assert row["rollout/ess"] == pytest.approx(1.0, abs=1e-6)
            assert row["rollout/mismatch_kl"] < 1e-9 and row["rollout/masked_frac"] == 0.0
            assert row["collector/logprob_gap"] < 1e-5
    assert not any(k.startswith("rollout/") for k in runs["bypass"][0])  # no trainer log-probs


@pytest.mark.parametrize("sampling", [["collector.temperature=1.0"], ["collector.temperature=0.7"],
                                      ["collector.temperature=0"],
                                      ["collector.top_k=5", "collector.top_p=0.8",
                                       "collector.score_truncated=true"]])
def test_bypass_skips_the_actor_forward_and_its_first_ratio_is_one(tmp_path, sampling):
    pipe = Pipeline(tiny(tmp_path, "rollout_correction.mode=bypass", *sampling), progress=False)
    batch = pipe.plugins.collector.collect(["Hi", "The weather today is very", "Once"])
    calls = {"actor": 0, "reference": 0, "critic": 0}
    hooks = [module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
             for name, module in (("actor", pipe.models.actor),
                                  ("reference", pipe.models.frozen_reference),
                                  ("critic", pipe.models.critic))]
    pipe._score_tokens(batch)
    for hook in hooks:
        hook.remove()
    assert calls["actor"] == 0 and calls["reference"] > 0 and calls["critic"] > 0
    assert torch.equal(batch[S.OLD_LOG_PROB], batch[S.ENGINE_LOG_PROB])
    # what the update's first forward computes (same temperature and truncation as the trainer)
    logp, _ = response_logprobs(pipe.models.actor, *[batch[k] for k in INPUTS], pipe.temperature,
                                truncation=pipe.truncation)
    mask = batch[S.RESPONSE_MASK]
    assert mask.sum() > 5
    assert (logp - batch[S.OLD_LOG_PROB])[mask].abs().max() < 1e-5   # float32 round-off


@pytest.mark.parametrize("sampling", [["collector.temperature=0.7", "collector.n=2",
                                       "collector.micro_batch_size=1", "collector.stop_strings=[e]"],
                                      ["collector.temperature=0"]])
def test_bypass_with_a_shared_critic_reads_values_from_the_rollout(tmp_path, sampling):
    """bypass + a value head on the actor's backbone: the HF collector writes the LM head's input
    of each drawn token (``engine_hidden``) and the values are the head on it, with no backbone
    forward in scoring; they equal the values of a full forward (`response_values`) within
    float32 round-off, 0 on padding. Micro-batches of different response lengths are padded."""
    pipe = Pipeline(tiny(tmp_path, "rollout_correction.mode=bypass", "models.critic.path=null",
                         "models.critic.shared_backbone=true", *sampling), progress=False)
    assert pipe.values_from_rollout
    batch = pipe.plugins.collector.collect(["Hi", "The weather today is very", "Once"])
    hidden = batch[S.ENGINE_HIDDEN]
    assert hidden.shape == (*batch[S.RESPONSE_IDS].shape, pipe.models.actor.config.hidden_size)
    backbone = []
    hook = pipe.models.critic.backbone.register_forward_hook(lambda *_: backbone.append(1))
    pipe._score_tokens(batch)
    hook.remove()
    assert not backbone and S.ENGINE_HIDDEN not in batch.keys()  # used, then dropped
    with torch.no_grad():
        want = response_values(pipe.models.critic, *[batch[k] for k in INPUTS])
    mask = batch[S.RESPONSE_MASK]
    assert mask.sum() > 5 and (~mask).any() or "stop_strings" not in str(sampling)
    assert (batch[S.VALUE] - want).abs().max() < 1e-5
    assert (batch[S.VALUE][~mask] == 0).all()


def test_values_come_from_a_forward_when_the_actor_runs_or_with_a_separate_critic(tmp_path):
    for overrides in (["models.critic.path=null", "models.critic.shared_backbone=true",
                       "rollout_correction.old_log_prob=recompute"],
                      ["rollout_correction.mode=bypass"]):
        pipe = Pipeline(tiny(tmp_path, *overrides), overwrite=True, progress=False)
        assert not pipe.values_from_rollout
        assert S.ENGINE_HIDDEN not in pipe.plugins.collector.collect(["Hi"]).keys()
