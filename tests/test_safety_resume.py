"""Issue 54: metrics after a kill. With evaluation on (a step-0 row), at ``rollout.staleness``
0 and 1, a run is killed at each write point (after the step-0 row, after a step's row before
its checkpoint, inside the first checkpoint, with ``checkpoint.every: 0``), resumed, and must hold
each step's row exactly once, equal to an uninterrupted run's. A deleted ``metrics.jsonl`` on
``--resume`` is one warning line. Kills are simulated as in tests/test_resume_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.config.settings import load_config
from rlpipe.core.run import checkpoint
from rlpipe.core.run.pipeline import Pipeline
from tests.conftest import logged_metrics as rows
from tests.test_resume_faults import Killed, after_row

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["run.steps=3", "data.batch_size=4", "collector.max_new_tokens=8", "train.epochs=1",
        "log.progress=false", f"eval.prompts={ROOT / 'examples' / 'tiny' / 'prompts.txt'}",
        "eval.max_prompts=4", "rollout_correction.mode=tis"]
STALENESS = [0, 1]


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def train(run_dir, staleness, *extra, resume=False) -> Path:
    cfg = load_config(TINY, [f"run.output_dir={run_dir}", *FAST,
                             f"rollout.staleness={staleness}", *extra])
    return Pipeline(cfg, progress=False, resume=resume).train()


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {s: rows(train(tmp_path_factory.mktemp(f"ref{s}") / "run", s)) for s in STALENESS}
    finally:
        torch.set_num_threads(threads)


def in_first_checkpoint(mp):
    real = checkpoint.save_file

    def save_file(tensors, path):
        real(tensors, path)
        raise Killed
    mp.setattr(checkpoint, "save_file", save_file)


KILLS = {  # name: (checkpoint settings, where the kill happens)
    "after-eval-row-0": (["checkpoint.every=1"], after_row(0)),
    "after-row-1-before-first-checkpoint": (["checkpoint.every=2"], after_row(1)),
    "inside-first-checkpoint": (["checkpoint.every=1"], in_first_checkpoint),
    "after-row-2-every-0": (["checkpoint.every=0"], after_row(2)),
    "after-row-3-before-last-checkpoint": (["checkpoint.every=2"], after_row(3)),
}


@pytest.mark.parametrize("staleness", STALENESS)
@pytest.mark.parametrize("point", KILLS)
def test_a_kill_at_each_write_point_keeps_each_row_once(point, staleness, tmp_path, references):
    extra, install = KILLS[point]
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        install(mp)
        with pytest.raises(Killed):
            train(run_dir, staleness, *extra)
    train(run_dir, staleness, *extra, resume=True)
    got = rows(run_dir)
    assert [r["step"] for r in got] == [0, 1, 2, 3]   # evaluation's step 0 once, none dropped
    assert got == references[staleness]


def test_a_deleted_metrics_file_on_resume_is_one_warning_line(tmp_path):
    run_dir = tmp_path / "run"
    args = [TINY, f"run.output_dir={run_dir}", *FAST, "checkpoint.every=1"]
    with pytest.MonkeyPatch.context() as mp:
        after_row(3)(mp)
        with pytest.raises(Killed):
            train(run_dir, 0, "checkpoint.every=1")
    (run_dir / "metrics.jsonl").unlink()
    result = CliRunner().invoke(main, ["run", *map(str, args), "--resume"])
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {run_dir / 'metrics.jsonl'} is missing: the rows of steps 1-2 "
                        f"are lost; resuming from step-000002, rows from step 3 on"]
    assert [json.loads(line)["step"] for line in
            (run_dir / "metrics.jsonl").read_text().splitlines()] == [3]
