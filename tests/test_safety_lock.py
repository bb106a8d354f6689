"""Issue 54: the lock belongs to a run, not a process. `train()` that raises in a process that
lives on (a notebook) leaves the run directory free for a terminal; export, report and doctor
read a read-only folder or one a dead process held; ``.rlpipe-lock`` as a symbolic link to a
user's file is refused and the file left alone. The tiny example, one step."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.run import runlock
from rlpipe.core.run.callbacks import Callback
from rlpipe.core.run.pipeline import train

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = ["run.steps=1", "data.batch_size=2", "collector.max_new_tokens=6", "train.epochs=1",
        "train.minibatches=1", "log.progress=false", "checkpoint.every=1"]
TAKE = ("import sys; from pathlib import Path; from rlpipe.core.run import runlock; "
        "runlock.hold(Path(sys.argv[1]), 'run.output_dir'); print('held')")


def another_process_can_take(run_dir: Path) -> bool:
    """A terminal's rlpipe: takes the lock of ``run_dir`` (and ends)."""
    result = subprocess.run([sys.executable, "-c", TAKE, str(run_dir)], capture_output=True,
                            text=True, timeout=120)
    return result.stdout.strip() == "held"


class Fails(Callback):
    def on_step_end(self, pipe, batch, metrics):
        if batch is not None:
            raise RuntimeError("my callback's bug")


def test_train_that_raises_releases_the_lock_in_a_process_that_lives_on(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match="callback Fails failed"):
        train(load_config(TINY, [f"run.output_dir={run_dir}", *FAST]), progress=False,
              callbacks=[Fails()])
    assert not (run_dir / runlock.LOCK).exists()
    assert another_process_can_take(run_dir)


def test_train_that_returns_releases_the_lock(tmp_path):
    run_dir = train(load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *FAST]),
                    progress=False)
    assert not (run_dir / runlock.LOCK).exists()
    assert another_process_can_take(run_dir)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return train(load_config(TINY, [f"run.output_dir={tmp_path_factory.mktemp('f') / 'run'}",
                                    *FAST]), progress=False)


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def read_only(mp, run_dir: Path) -> None:
    """Writes into ``run_dir`` refused as on a read-only mount (the tests run as root, for
    whom chmod refuses nothing)."""
    real = os.open

    def open_(path, flags, *args, **kwargs):
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and Path(path).parent == run_dir:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, *args, **kwargs)
    mp.setattr(runlock.os, "open", open_)


@pytest.mark.parametrize("stale_lock", [False, True])
def test_export_reads_a_read_only_run_folder(stale_lock, finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    if stale_lock:   # left by a killed run: the dead process holds nothing
        (run_dir / runlock.LOCK).write_text("999999999 since 2026-01-01T00:00:00+0000\n")
    with pytest.MonkeyPatch.context() as mp:
        read_only(mp, run_dir.resolve())
        result = cli("export", run_dir, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "config.json").is_file()


def test_report_and_doctor_read_a_folder_a_dead_process_held(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    (run_dir / runlock.LOCK).write_text("999999999 since 2026-01-01T00:00:00+0000\n")
    for command in (["export", run_dir, tmp_path / "out"], ["report", run_dir],
                    ["doctor", run_dir]):
        result = cli(*command)
        assert result.exit_code == 0, (command, result.stderr)
        assert "in use" not in result.stderr


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_kept(tmp_path, harness):
    run_dir, mine = tmp_path / "run", tmp_path / "my-notes.txt"
    run_dir.mkdir()
    mine.write_text("my notes\n")
    (run_dir / runlock.LOCK).symlink_to(mine)
    result = harness.run(["run", TINY, f"run.output_dir={run_dir}", *FAST])
    harness.error(result, f"{run_dir / runlock.LOCK} is a symbolic link, not rlpipe's lock file")
    assert mine.read_text() == "my notes\n"
    assert [p.name for p in run_dir.iterdir()] == [runlock.LOCK]
    with pytest.raises(UserError, match="is a symbolic link"):   # export too
        runlock.hold(run_dir, "RUN_DIR", shared=True)
    assert mine.read_text() == "my notes\n"
