"""Evaluation with an environment: the held-out prompts run the same multi-turn conversations as
training (greedy), the samples file holds them, and ``eval/env/*`` are training's ``env/*``
definitions over the held-out conversations."""

import json
import math

import pytest

from rlpipe.core.base import schema as S
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.multiturn import MultiTurn, env_metrics
from tests.test_metric_table import documented
from tests.test_multiturn_pipeline import TINY, Echo, chat_tiny, config  # noqa: F401 (fixture)


@pytest.fixture
def pipe(chat_tiny, tmp_path):  # noqa: F811
    made = Pipeline(config(chat_tiny, tmp_path, f"eval.prompts={TINY / 'prompts.txt'}",
                           "eval.max_prompts=3", "eval.batch_size=2"),
                    environment=Echo, progress=False)
    yield made
    made.plugins.environment.close()
    made.evaluator.close()


def test_evaluation_runs_the_conversations_greedily(pipe):
    evaluator = pipe.evaluator
    assert isinstance(evaluator.turns, MultiTurn)
    assert evaluator.turns.collector is evaluator.collector            # the eval sampler's engine
    assert evaluator.collector.temperature == 0.0                      # greedy, as evaluation is
    assert evaluator.turns is not pipe.plugins.environment             # training's stays untouched

    metrics = evaluator.run(0, pipe.models.actor)
    rows = [json.loads(line) for line in
            (pipe.run_dir / "samples" / "eval-step-0.jsonl").read_text().splitlines()]
    assert [r["row"] for r in rows] == [0, 1, 2]
    for r in rows:
        roles = [m["role"] for m in r["conversation"]]
        assert roles[0] == "user" and roles.count("assistant") == r["turns"] >= 1
        assert r["stop_reason"] in S.STOP_REASONS and r["receipt"] in S.RECEIPTS
        assert r["response"] == [m for m in r["conversation"] if m["role"] == "assistant"][-1]["content"]
        assert 1 <= r["action_tokens"] <= r["length"]
        assert r["turns"] - 1 <= r["env"]["tool_calls"] <= r["turns"]  # Echo: one a step taken

    # the oracle: each eval/env/* is a plain mean over the samples (obs_token_frac: of the tokens)
    n = len(rows)
    assert metrics["eval/env/turns"] == pytest.approx(sum(r["turns"] for r in rows) / n)
    assert metrics["eval/env/tool_calls"] == pytest.approx(
        sum(r["env"]["tool_calls"] for r in rows) / n)
    tokens, actions = sum(r["length"] for r in rows), sum(r["action_tokens"] for r in rows)
    assert metrics["eval/env/obs_token_frac"] == pytest.approx((tokens - actions) / tokens)
    for name in S.STOP_REASONS:
        assert metrics[f"eval/env/stop/{name}"] == pytest.approx(
            sum(r["stop_reason"] == name for r in rows) / n)
    for name in S.RECEIPTS:
        assert metrics[f"eval/env/receipt/{name}"] == pytest.approx(
            sum(r["receipt"] == name for r in rows) / n)
    assert math.isfinite(metrics["eval/score"])
    assert metrics["eval/score"] == pytest.approx(sum(r["score"] for r in rows) / n)


def test_eval_env_metrics_have_trainings_names(pipe):
    """Every env/* name training logs has its eval/env/* twin, and no other."""
    metrics = pipe.evaluator.run(0, pipe.models.actor)
    batch = pipe.plugins.environment.collect(pipe.data.records([0]), 0)
    assert {k for k in metrics if k.startswith("eval/env/")} == \
        {f"eval/{k}" for k in env_metrics(batch)}


def test_evaluation_is_the_same_at_the_same_weights(pipe):
    """Greedy and seeded by row: two evaluations of one actor give the same conversations."""
    first = pipe.evaluator.run(0, pipe.models.actor)
    text = (pipe.run_dir / "samples" / "eval-step-0.jsonl").read_text()
    second = pipe.evaluator.run(0, pipe.models.actor)
    assert (pipe.run_dir / "samples" / "eval-step-0.jsonl").read_text() == text
    drop = "time/"
    assert {k: v for k, v in first.items() if not k.startswith(drop)} == \
        {k: v for k, v in second.items() if not k.startswith(drop)}


def test_every_env_metric_is_in_the_metric_table(pipe):
    """The tiny runs of tests/test_metric_table.py have no environment: its env/* names here."""
    batch, metrics = pipe.step()
    logged = {k for k in {**metrics, **pipe.evaluator.run(0, pipe.models.actor)}
              if k.startswith(("env/", "eval/env/"))}
    assert logged and not logged - documented(), sorted(logged - documented())
