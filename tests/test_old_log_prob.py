"""Old log-probs from the sampling pass (``rollout_correction.old_log_prob``): where the HF
collector samples with the actor itself, it also writes ``actor_log_prob``, each drawn token's
log-prob under the trainer's scoring distribution from the sampling pass's own logits, and the
pipeline takes it as ``old_log_prob`` instead of running the actor over the rollout again (what
TRL's PPOTrainer does). PPO's first ratio is then 1 within float32 round-off; these tests prove it
against the trainer's own forward (`response_logprobs`, which the update's first forward runs)
and, in float64, against a plain per-row loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.models.lm import response_logprobs
from rlpipe.core.run.pipeline import Pipeline, train
from rlpipe.core.base.truncation import Truncation, truncated_log_prob
from rlpipe.plugins.collectors.hf import HFCollector

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)
PROMPTS = ["Hi", "The weather today is very", "Once"]


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *overrides])


def count_forwards(pipe, batch) -> dict:
    """Run the pipeline's scoring stage on ``batch``; the forward calls of each model."""
    calls = {"actor": 0, "reference": 0}
    hooks = [module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
             for name, module in (("actor", pipe.models.actor),
                                  ("reference", pipe.models.frozen_reference))]
    try:
        pipe._score_tokens(batch)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


@pytest.mark.parametrize("sampling", [
    ["collector.temperature=1.0"],
    ["collector.temperature=0.7", "collector.min_new_tokens=6"],   # EOS suppressed: not scored
    ["collector.temperature=0"],                                   # greedy scores at temperature 1
    ["collector.top_k=5", "collector.top_p=0.8", "collector.score_truncated=true"],
    ["collector.top_k=5", "collector.top_p=0.8"],   # the trainer scores the full distribution
    ["collector.n=2", "collector.micro_batch_size=1", "collector.stop_strings=[e]"],
])
def test_the_first_ratio_is_one_and_the_actor_forward_is_gone(tmp_path, sampling):
    pipe = Pipeline(tiny(tmp_path, *sampling), progress=False)
    assert pipe.old_from_sampling and not pipe.values_from_rollout   # separate critic: a forward
    batch = pipe.plugins.collector.collect(PROMPTS)
    from_sampling = batch[S.ACTOR_LOG_PROB].clone()
    calls = count_forwards(pipe, batch)
    assert calls["actor"] == 0 and calls["reference"] > 0
    assert torch.equal(batch[S.OLD_LOG_PROB], from_sampling)
    assert S.ACTOR_LOG_PROB not in batch.keys()   # used, then dropped
    # what the update's first forward computes: the ratio exp(logp - old) is 1 within round-off
    logp, _ = response_logprobs(pipe.models.actor, *[batch[k] for k in INPUTS], pipe.temperature,
                                truncation=pipe.truncation)
    mask = batch[S.RESPONSE_MASK]
    assert mask.sum() > 5
    assert (logp - batch[S.OLD_LOG_PROB])[mask].abs().max() < 1e-5   # float32 round-off
    assert (batch[S.OLD_LOG_PROB][~mask] == 0).all()
    gap = (batch[S.ENGINE_LOG_PROB] - batch[S.OLD_LOG_PROB])[mask].abs().max()
    if "score_truncated" in str(sampling):   # the trainer scores the truncated distribution too
        assert gap < 1e-5
    elif "min_new_tokens" in str(sampling) or "top_k" in str(sampling):
        assert gap > 1e-4   # the engine's are of the processed distribution; the trainer's not


@pytest.mark.parametrize("temperature, truncation, min_new", [
    (0.7, None, 5), (1.0, None, 0), (0.0, None, 0), (0.9, Truncation(top_k=6, top_p=0.9), 3)])
def test_float64_actor_log_prob_equals_a_plain_loop(tiny_model, tiny_tokenizer, temperature,
                                                    truncation, min_new):
    """A float64 model against a plain float64 loop: per row, the unpadded prompt + response
    through the model, logits / temperature, log-softmax (or the truncated distribution), at each
    response token. ``generate`` hands its processors float32 logits, so the match is to float32
    round-off (2e-6); a wrong temperature, position, or an EOS suppression scored in would be
    off by 1e-3 or more."""
    from rlpipe.core.base.context import RunContext

    model = tiny_model.double()
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=model, device=model.device, max_new_tokens=8)
    collector = HFCollector(ctx, max_new_tokens=8, temperature=temperature, n=2,
                            micro_batch_size=2, min_new_tokens=min_new,
                            top_k=truncation.top_k if truncation else 0,
                            top_p=truncation.top_p if truncation else 1.0)
    collector.record_actor_log_prob(temperature, truncation)
    torch.manual_seed(0)
    batch = collector.collect(["the cat sat on the mat", "hello", "big red dog"])
    got, scale = batch[S.ACTOR_LOG_PROB].double(), temperature if temperature > 0 else 1.0
    for b in range(len(batch)):
        prompt = batch[S.PROMPT_IDS][b][batch[S.PROMPT_MASK][b]]
        response = batch[S.RESPONSE_IDS][b][batch[S.RESPONSE_MASK][b]]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]
        scores = logits[len(prompt) - 1:-1] / scale
        want = (truncated_log_prob(scores, response, truncation.top_k, truncation.top_p)
                if truncation else torch.log_softmax(scores, -1).gather(-1, response[:, None])[:, 0])
        assert torch.allclose(got[b, :len(response)], want, rtol=0, atol=2e-6), b
        assert (got[b, len(response):] == 0).all()


def test_a_shared_critic_reads_its_values_from_the_rollout_too(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "models.critic.path=null", "models.critic.shared_backbone=true"),
                    progress=False)
    assert pipe.old_from_sampling and pipe.values_from_rollout
    batch = pipe.plugins.collector.collect(PROMPTS)
    assert {S.ACTOR_LOG_PROB, S.ENGINE_HIDDEN} <= set(batch.keys())
    assert count_forwards(pipe, batch)["actor"] == 0   # no backbone forward at all


@pytest.mark.parametrize("overrides", [
    ["rollout_correction.old_log_prob=recompute"],
    ["rollout_correction.mode=tis"],                   # tis/mis compare the engine with a forward
    ["models.actor.dtype=bfloat16"],                   # auto: not within float32 round-off
])
def test_the_actor_forward_runs_where_the_sampling_pass_is_not_used(tmp_path, overrides):
    pipe = Pipeline(tiny(tmp_path, *overrides), progress=False)
    assert not pipe.old_from_sampling
    batch = pipe.plugins.collector.collect(PROMPTS)
    assert S.ACTOR_LOG_PROB not in batch.keys()
    assert count_forwards(pipe, batch)["actor"] > 0


def test_sampling_is_refused_where_it_cannot_be_honoured(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="old_log_prob: sampling needs rollout_correction.mode: none"):
        tiny(tmp_path, "rollout_correction.old_log_prob=sampling", "rollout_correction.mode=bypass")
    monkeypatch.setattr(HFCollector, "record_actor_log_prob", None)   # a collector without it
    with pytest.raises(UserError, match="declares no record_actor_log_prob"):
        Pipeline(tiny(tmp_path, "rollout_correction.old_log_prob=sampling"), progress=False)
    assert not Pipeline(tiny(tmp_path), overwrite=True, progress=False).old_from_sampling  # auto


def test_a_collector_that_offers_it_but_does_not_write_it_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(HFCollector, "record_actor_log_prob", lambda self, *args: None)
    pipe = Pipeline(tiny(tmp_path), progress=False)
    with pytest.raises(UserError, match="did not write 'actor_log_prob' into the batch"):
        pipe.step()


def test_training_is_the_recomputed_run_within_round_off(tmp_path):
    """Two PPO steps (the second starts from the first's update): the same samples, losses and
    updates as with the actor forward, to float32 round-off."""
    runs = {}
    for choice in ("recompute", "auto"):
        cfg = tiny(tmp_path / choice, "run.steps=2", "data.batch_size=4",
                   "collector.max_new_tokens=8", f"rollout_correction.old_log_prob={choice}")
        run_dir = train(cfg, progress=False)
        runs[choice] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for plain, reused in zip(runs["recompute"], runs["auto"], strict=True):
        assert reused["response/length"] == plain["response/length"]   # the same samples
        for key in ("reward/score", "kl/ref", "policy/loss", "policy/approx_kl", "value/loss",
                    "loss/objective"):
            assert reused[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
