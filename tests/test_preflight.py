"""The mismatch preflight (core/run/preflight.py, `rlpipe check`, `run.preflight`): its numbers against
a float64 loop; on HF (the engine is the actor) it passes, it fails on one line with exit status 1
for truncated sampling scored untruncated, and a run with the preflight trains as one without."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlpipe.core.config.settings import load_config
from rlpipe.core.run.pipeline import Pipeline, train
from rlpipe.core.run.preflight import PreflightFailed, check, measure

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = ["collector.max_new_tokens=8", "data.batch_size=4", "train.epochs=1"]


def test_measure_equals_a_float64_loop():
    g = torch.Generator().manual_seed(0)
    engine = -torch.rand(3, 5, generator=g) * 2
    trainer = engine + (torch.rand(3, 5, generator=g) - 0.5)
    mask = torch.arange(5) < torch.tensor([[5], [0], [2]])
    m = measure(engine, trainer, mask)
    cells = [(b, t) for b in range(3) for t in range(5) if mask[b, t]]
    d = {c: float(trainer[c]) - float(engine[c]) for c in cells}
    seq = [math.exp(sum(d[(b, t)] for t in range(5) if mask[b, t])) for b in (0, 2)]
    assert (m.tokens, m.sequences) == (7, 2)
    assert m.gap_mean == pytest.approx(sum(abs(x) for x in d.values()) / 7)
    assert m.gap_max == pytest.approx(max(abs(x) for x in d.values()))
    assert m.kl == pytest.approx(sum(math.exp(x) - 1 - x for x in d.values()) / 7)  # k3, r = e^d
    assert (m.seq_weight_min, m.seq_weight_max) == (pytest.approx(min(seq)), pytest.approx(max(seq)))
    assert m.seq_weight_mean == pytest.approx(sum(seq) / 2)
    assert m.failure(max_kl=1.0, max_gap=1.0) is None
    assert "run.preflight_max_gap=0.01" in m.failure(max_kl=1.0, max_gap=0.01)


def test_check_passes_on_hf_and_leaves_the_data_order_and_rng_alone(tmp_path):
    pipe = Pipeline(load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *FAST]), progress=False)
    before = (pipe.prompts.position, list(pipe.prompts.order), torch.get_rng_state())
    lines = []
    m = check(pipe, echo=lines.append)
    assert m.gap_max < 1e-5 and m.kl < 1e-9 and m.tokens > 0
    assert lines[0].startswith("preflight: 8 sequences") and lines[-1].startswith("preflight passed")
    assert (pipe.prompts.position, list(pipe.prompts.order)) == before[:2]
    assert torch.equal(torch.get_rng_state(), before[2])


def test_run_with_preflight_trains_exactly_as_without(tmp_path, capsys):
    rows = {}
    for flag in ("false", "true"):
        cfg = load_config(TINY, [f"run.output_dir={tmp_path / flag}", "run.steps=1",
                                 f"run.preflight={flag}", *FAST])
        text = (train(cfg, progress=False) / "metrics.jsonl").read_text()
        rows[flag] = {k: v for k, v in json.loads(text).items() if not k.startswith(("time/", "perf/"))}
    assert rows["true"] == rows["false"]
    assert "preflight passed" in capsys.readouterr().out


def test_a_failing_preflight_stops_the_run_before_step_one(tmp_path):
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "run.preflight=true",
                             "collector.top_p=0.5", *FAST])
    with pytest.raises(PreflightFailed, match="set collector.score_truncated: true"):
        train(cfg, progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_rlpipe_check_cli_passes_and_fails_on_one_line(tmp_path, harness):
    ok = harness.run(["check", TINY, f"run.output_dir={tmp_path / 'never'}", *FAST,
                      "collector.top_p=0.5", "collector.score_truncated=true"])
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "mismatch KL" in ok.stdout and "preflight passed" in ok.stdout
    assert not (tmp_path / "never").exists(), "check writes no run directory"
    bad = harness.run(["check", TINY, *FAST, "collector.top_p=0.5"])
    harness.error(bad, "preflight: the engine and the trainer disagree",
                  "collector.score_truncated: true", code=1)
    harness.error(harness.run(["check", TINY, "run.preflight_max_gap=-1"]),
                  "run.preflight_max_gap", code=2)


def test_rlpipe_check_of_a_distributed_config_says_it_runs_one_process(tmp_path, harness):
    result = harness.run(["check", TINY, *FAST, "distributed.nproc=2", "run.device=cpu"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "preflight passed" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "distributed.nproc=2" in warnings[0]
    assert "run.preflight=true" in warnings[0]
