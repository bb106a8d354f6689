"""Issue 54: callbacks cannot break the run's files. Each case runs the tiny example with a
callback that does the wrong thing and checks the one line, the lock and the files: values are
converted or refused naming the callback, a bad callback object is refused at ``train()``, an
exception inside a hook names the callback and leaves the run resumable, the row's ``step``
and ``pipe.step_count`` cannot be rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.run import checkpoint, runlock
from rlpipe.core.run.callbacks import Callback, check_callbacks
from rlpipe.core.run.pipeline import train

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = ["data.batch_size=2", "collector.max_new_tokens=6", "train.epochs=1",
        "train.minibatches=1", "log.progress=false", "checkpoint.every=1"]


def cfg(run_dir: Path, steps: int = 2):
    return load_config(TINY, [f"run.output_dir={run_dir}", f"run.steps={steps}", *FAST])


def steps_of(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Adds(Callback):
    """Adds ``value`` under ``custom/x`` at ``at`` (a step)."""

    def __init__(self, value, at: int = 2):
        self.value, self.at = value, at

    def on_step_end(self, pipe, batch, metrics):
        if metrics["step"] == self.at:
            metrics["custom/x"] = self.value


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def assert_resumable(run_dir: Path, steps: int = 2) -> None:
    """The lock is gone, checkpoint 1 intact, and --resume (a plain run) finishes the run."""
    assert not (run_dir / runlock.LOCK).exists()
    assert [p.name for p in checkpoint.complete(run_dir)] == ["step-000001"]
    assert checkpoint.verify(run_dir / "checkpoints" / "step-000001") is None
    train(cfg(run_dir, steps), progress=False, resume=True)
    assert steps_of(run_dir) == list(range(1, steps + 1))


@pytest.mark.parametrize("value, written", [
    (torch.tensor(1.5), 1.5), (torch.tensor([2.0]), 2.0), (np.float32(0.25), 0.25),
    (np.int64(3), 3), (True, 1)])
def test_a_metric_value_is_converted(value, written, tmp_path):
    run_dir = train(cfg(tmp_path, steps=1), progress=False, callbacks=[Adds(value, at=1)])
    row = json.loads((run_dir / "metrics.jsonl").read_text())
    assert row["custom/x"] == written and type(row["custom/x"]) is type(written)


@pytest.mark.parametrize("value", [None, object(), torch.ones(3), [1.0]])
def test_a_metric_value_that_is_no_number_is_one_line_and_the_run_resumes(value, tmp_path):
    with pytest.raises(UserError) as exc:
        train(cfg(tmp_path), progress=False, callbacks=[Adds(value)])
    assert one_line(exc).startswith("callback Adds added metrics['custom/x']: ")
    assert steps_of(tmp_path) == [1]   # the bad row never reached the file
    assert_resumable(tmp_path)


class Raises(Callback):
    def on_step_end(self, pipe, batch, metrics):
        if metrics["step"] == 2:
            raise ZeroDivisionError("division by zero")


def test_an_exception_in_a_callback_names_it_and_leaves_the_run_resumable(tmp_path):
    with pytest.raises(UserError) as exc:
        train(cfg(tmp_path), progress=False, callbacks=[Raises()])
    assert one_line(exc) == ("callback Raises failed in on_step_end: ZeroDivisionError: "
                             "division by zero")
    assert_resumable(tmp_path)


class Rewrites(Callback):
    def __init__(self, key, value):
        self.key, self.value = key, value

    def on_step_end(self, pipe, batch, metrics):
        if metrics["step"] == 2:
            if self.value is None:
                del metrics[self.key]
            else:
                metrics[self.key] = self.value


@pytest.mark.parametrize("key, value", [("step", 7), ("step", None), ("reward/score", 1e9)])
def test_a_callback_cannot_rewrite_step_or_an_existing_metric(key, value, tmp_path):
    with pytest.raises(UserError) as exc:
        train(cfg(tmp_path), progress=False, callbacks=[Rewrites(key, value)])
    assert one_line(exc).startswith(f"callback Rewrites changed or removed metrics[{key!r}]")
    assert_resumable(tmp_path)


class Rewinds(Callback):
    def on_step_end(self, pipe, batch, metrics):
        if batch is not None:
            pipe.step_count = 0


def test_a_callback_that_resets_step_count_is_refused_instead_of_looping(tmp_path):
    with pytest.raises(UserError) as exc:
        train(cfg(tmp_path), progress=False, callbacks=[Rewinds()])
    assert one_line(exc) == ("callback Rewinds changed pipe.step_count (1 -> 0); a callback "
                             "stops a run by setting pipe.stopped_by")
    assert not (tmp_path / runlock.LOCK).exists()


class NoArgs(Callback):
    def on_step_end(self, pipe):
        pass


def a_function(pipe, batch, metrics):
    pass


def trainer_callback():
    transformers = pytest.importorskip("transformers")
    return transformers.TrainerCallback()


@pytest.mark.parametrize("make, line", [
    (lambda: [a_function], "callback a_function is a function; give an object with "
                           "on_train_start(pipe)"),
    (lambda: [Adds], "callback Adds is a class; give an object: a Callback subclass's instance, "
                     "e.g. callbacks=[Adds()]"),
    (lambda: [NoArgs()], "callback NoArgs: on_step_end must take 3 argument(s) (pipe, batch, "
                         "metrics)"),
    (lambda: Raises(), "callbacks=Raises: expected a list of Callback objects"),
    (lambda: [trainer_callback()], "callback TrainerCallback is a transformers TrainerCallback, "
                                   "whose hooks rlpipe does not call; subclass "
                                   "rlpipe.core.run.callbacks.Callback instead"),
])
def test_a_bad_callback_object_is_one_line(make, line):
    with pytest.raises(UserError) as exc:
        check_callbacks(make())
    assert one_line(exc).startswith(line)


def test_a_bad_callback_object_is_refused_at_train_before_any_step(tmp_path):
    with pytest.raises(UserError, match="callback a_function is a function"):
        train(cfg(tmp_path), progress=False, callbacks=[a_function])
    assert not (tmp_path / "metrics.jsonl").exists() or steps_of(tmp_path) == []
    assert not (tmp_path / runlock.LOCK).exists()
