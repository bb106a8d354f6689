"""Every metric a run logs has a row in the metric table (docs/metrics.md).

The logged names come from real one-step tiny runs that switch on the optional terms (KL as a loss
term, PPO-ptx, dual clip; a critic-free estimator), plus `CONDITIONAL`: names only a setting these
runs cannot reach logs (each is checked against the table too). A metric another module adds
shows up here as soon as the tiny run logs it, documented or not."""

import json
import re
from pathlib import Path

import pytest

from rlpipe.core.run.pipeline import Pipeline

from tests.test_trainer import tiny

ROOT = Path(__file__).resolve().parents[1]

# Logged only by settings a CPU tiny run does not reach.
CONDITIONAL = {"collector/logprob_gap"}  # collectors that report engine log-probs (vllm)


def documented() -> set[str]:
    """The backticked names in the first column of the metric table (docs/metrics.md)."""
    page = (ROOT / "docs" / "metrics.md").read_text()
    section = page.split("## Metrics (`metrics.jsonl`", 1)[1].split("\n#", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([^`]+)`", line.split(" | ")[0]))
    return names


def generic(key: str, labels) -> str:
    """``reward/length/std`` -> ``reward/<label>/std`` for the run's reward labels."""
    for label in labels:
        if key == f"reward/{label}" or key.startswith(f"reward/{label}/"):
            return "reward/<label>" + key[len(f"reward/{label}"):]
    return key


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> set[str]:
    tmp = tmp_path_factory.mktemp("table")
    (tmp / "ptx.txt").write_text("The weather is nice today.\nA short story about a cat.\n")
    runs = {"gae": ["kl.in=loss", "ptx.coef=0.1", f"ptx.data={tmp / 'ptx.txt'}",
                    "ptx.batch_size=2", "loss.dual_clip=3.0", "rollout.staleness=1",
                    "rollout_correction.mode=tis"],
            "grpo": ["advantage={name: grpo}", "data.dynamic_sampling.enabled=true",
                     "data.dynamic_sampling.max_rounds=1"]}
    names = set()
    for name, overrides in runs.items():
        cfg = tiny(tmp / name, "run.steps=1", "train.epochs=1", "log.samples_every=0", *overrides)
        run_dir = Pipeline(cfg, progress=False).train()
        labels = [r.key for r in cfg.rewards]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            names |= {generic(k, labels) for k in json.loads(line)}
    return names


def test_every_logged_metric_is_in_the_metric_table(logged):
    missing = sorted(logged - documented())
    assert not missing, f"metrics logged but missing from the metric table (docs/metrics.md): {missing}"


def test_the_runs_reach_the_optional_terms(logged):
    assert {"loss/kl", "loss/ptx", "policy/ptx_loss", "train/grad_norm",
            "train/critic_grad_norm"} <= logged


def test_conditional_metrics_are_documented():
    assert CONDITIONAL <= documented()
