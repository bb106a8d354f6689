"""End to end: the tiny example trains, writes the run directory, and keeps the DESIGN.md rules."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.models.lm import response_logprobs
from rlpipe.core.run.pipeline import Pipeline, train
from tests import clip_edges

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
DESIGN_METRICS = ["step", "reward/score", "kl/ref", "kl/coef", "policy/loss", "policy/clipfrac",
                  "policy/approx_kl", "policy/entropy", "value/loss", "value/clipfrac",
                  "value/explained_var", "response/length", "response/finished_frac",
                  "perf/tokens_per_s", "time/rollout_s", "time/update_s", "time/step_s"]


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *overrides])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_writes_run_directory(tmp_path):
    run_dir = train(tiny(tmp_path, "run.steps=2"), progress=False)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for name in DESIGN_METRICS + ["reward/length", "reward/loop"]:
        assert all(isinstance(r[name], (int, float)) for r in rows), name
    assert (run_dir / "config.yaml").is_file()
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert final.config.hidden_size == 64


def test_same_seed_same_metrics(tmp_path):
    a = read_metrics(train(tiny(tmp_path / "a", "run.steps=2"), progress=False))
    b = read_metrics(train(tiny(tmp_path / "b", "run.steps=2"), progress=False))
    drop = ("time/", "perf/")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]  # noqa: E731
    assert strip(a) == strip(b)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ratio_is_one_on_first_minibatch(tmp_path, temperature):
    """The trainer's forward in the update reproduces old_log_prob exactly (left padding, temperature)."""
    pipe = Pipeline(tiny(tmp_path, f"collector.temperature={temperature}"), progress=False)
    batch = pipe.plugins.collector.collect(["Hi", "The weather today is very", "Once"])
    assert batch[S.PROMPT_MASK].sum(-1).unique().numel() > 1  # prompts really are left-padded
    pipe._score_tokens(batch)
    micro = batch[1:]
    inputs = [micro[k] for k in (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)]
    logp, _ = response_logprobs(pipe.models.actor, *inputs, temperature, with_entropy=True)
    mask = micro[S.RESPONSE_MASK]
    ratio = torch.exp(logp - micro[S.OLD_LOG_PROB])[mask]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
    # the reference starts as the actor: KL 0 on the first step, up to round-off: two float32
    # log-probs (the sampling pass's and the reference's forward), each a log-softmax over the
    # 1000-token vocabulary, so within 2 n u of each other (tests/clip_edges.py; 1.6e-6 seen on
    # ATen's default kernels, where 1e-6 failed)
    assert torch.allclose(batch[S.REF_LOG_PROB], batch[S.OLD_LOG_PROB], atol=clip_edges.EDGE)


def test_first_response_token_logprob_matches_unpadded_forward(tmp_path):
    pipe = Pipeline(tiny(tmp_path), progress=False)
    batch = pipe.plugins.collector.collect(["Hi", "The weather today is very"])
    pipe._score_tokens(batch)
    actor = pipe.models.actor
    for row in range(2):
        p = batch[S.PROMPT_IDS][row][batch[S.PROMPT_MASK][row]]
        r = batch[S.RESPONSE_IDS][row][batch[S.RESPONSE_MASK][row]]
        with torch.no_grad():
            logits = actor(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None]).squeeze(-1)
        got = batch[S.OLD_LOG_PROB][row][: len(r)]
        assert got[0] != 0 and torch.allclose(got, expected, atol=1e-5)
