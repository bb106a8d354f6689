"""The loop's public hooks (core/run/callbacks.py): a loop of your own with the default callbacks
writes what `train()` writes, bit for bit; your callbacks add metrics and stop a run; a failing
step still closes the writers."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.run.callbacks import Callback, Hooks, default_callbacks
from rlpipe.core.run.pipeline import Pipeline, train
from rlpipe.core.run.run_state import RunState

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
STEPS = ["run.steps=2", "checkpoint.every=1", "log.progress=false"]


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock entries (time/*, perf/*)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in lines]


def weights(run_dir: Path) -> dict:
    return load_file(run_dir / "final" / "model.safetensors")


def test_your_own_loop_with_the_default_callbacks_writes_what_train_writes(tmp_path):
    by_train = train(load_config(TINY, [*STEPS, f"run.output_dir={tmp_path / 'a'}"]),
                     progress=False)
    pipe = Pipeline(load_config(TINY, [*STEPS, f"run.output_dir={tmp_path / 'b'}"]),
                    progress=False)
    with Hooks(pipe, default_callbacks(pipe)) as hooks:
        while pipe.step_count < 2:
            batch, metrics = pipe.step()
            hooks.step_end(batch, {"step": pipe.step_count, **metrics})
    pipe.save_final()
    declared = typing.get_type_hints(RunState)  # what checkpoint and resume read and write
    assert all(isinstance(getattr(pipe, name), kind) for name, kind in declared.items()), declared
    own = tmp_path / "b"
    assert rows(own) == rows(by_train) and [r["step"] for r in rows(own)] == [1, 2]
    a, b = weights(by_train), weights(own)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (own / "checkpoints").iterdir()) == \
        sorted(p.name for p in (by_train / "checkpoints").iterdir())
    assert sorted(p.name for p in (own / "samples").iterdir()) == \
        sorted(p.name for p in (by_train / "samples").iterdir())


class Recorder(Callback):
    """Adds a metric, records the hooks it saw, and stops the run at ``stop_at``."""

    def __init__(self, stop_at: int | None = None):
        self.seen, self.stop_at = [], stop_at

    def on_train_start(self, pipe):
        self.seen.append("start")

    def on_step_end(self, pipe, batch, metrics):
        self.seen.append(metrics["step"])
        if batch is not None:   # step 0 (batch None) is written only where something adds to it
            metrics["custom/twice_score"] = 2 * metrics["reward/score"]
        if metrics["step"] == self.stop_at:
            pipe.stopped_by = "recorder"

    def on_train_end(self, pipe):
        self.seen.append("end")


def test_your_callbacks_add_metrics_and_stop_a_run_after_a_checkpoint(tmp_path):
    recorder = Recorder(stop_at=1)
    cfg = load_config(TINY, ["run.steps=3", "log.progress=false", f"run.output_dir={tmp_path}"])
    run_dir = train(cfg, progress=False, callbacks=[recorder])
    assert recorder.seen == ["start", 0, 1, "end"]     # step 0: the row before any update
    written = rows(run_dir)
    assert [r["step"] for r in written] == [1]
    assert written[0]["custom/twice_score"] == 2 * written[0]["reward/score"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000001"]
    assert not (run_dir / "final").exists()             # stopped: no final policy


class Failing(Callback):
    def on_step_end(self, pipe, batch, metrics):
        if batch is not None:
            raise RuntimeError("boom")


def test_a_failing_step_still_closes_every_callback(tmp_path):
    ended = Recorder()
    pipe = Pipeline(load_config(TINY, ["run.steps=2", f"run.output_dir={tmp_path}"]),
                    progress=False)
    with pytest.raises(UserError, match="^callback Failing failed in on_step_end: RuntimeError: "
                                        "boom$"):   # issue 54: the callback named, one line
        pipe.train(callbacks=[ended, Failing()])
    assert ended.seen[0] == "start" and ended.seen[-1] == "end"
