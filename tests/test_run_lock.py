"""A run directory has one owner at a time (issue 39): `rlpipe run`, ``--resume``,
``--overwrite`` take an OS lock on it (``flock`` on ``DIR/.rlpipe-lock``, dropped when the
process ends however it ends), ``rlpipe export`` a shared one; a second process gets one line
naming the holder's pid and changes nothing. Real processes, the tiny example."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlpipe.core.run import runlock

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FAST = ["run.steps=1", "data.batch_size=2", "collector.max_new_tokens=6", "train.epochs=1",
        "train.minibatches=1", "log.progress=false"]
HOLD = ("import sys, time; from pathlib import Path; from rlpipe.core.run import runlock; "
        "runlock.hold(Path(sys.argv[1]), 'run.output_dir'); print('held', flush=True); "
        "time.sleep(3600)")   # until killed: a loaded machine's three runs may take minutes


def holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds ``run_dir``'s lock until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_overwrite_or_resume_is_refused_while_another_process_holds_it(
        tmp_path, harness):
    run_dir = tmp_path / "run"
    config = EXAMPLES / "tiny" / "config.yaml"
    proc = holder(run_dir)
    try:
        for flags in ([], ["--overwrite"], ["--resume"]):
            result = harness.run(["run", config, f"run.output_dir={run_dir}", *FAST, *flags])
            harness.error(result, f"{run_dir} is in use by another rlpipe process (pid {proc.pid}")
        assert [p.name for p in run_dir.iterdir()] == [runlock.LOCK]  # nothing written
    finally:
        proc.kill()
        proc.wait()
    # the holder died without releasing: the OS dropped its lock, its file is rlpipe's own
    result = harness.run(["run", config, f"run.output_dir={run_dir}", *FAST])
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (run_dir / runlock.LOCK).exists()


def test_a_held_directory_is_in_use_whatever_its_files_look_like(tmp_path):
    """A running run's files change under a second process's look (a checkpoint publishes:
    entries vanish between the listing and the look). The lock is asked first, so the answer is
    "in use" even where the files alone would read as foreign; an entry gone since it was
    listed is not foreign (seen on an H200, where steps are fast, 2026-11-28)."""
    from rlpipe import load_config
    from rlpipe.core.base.errors import UserError
    from rlpipe.core.run import rundir
    from rlpipe.core.run.build import check_run_dir

    run_dir = tmp_path / "run"
    proc = holder(run_dir)
    try:
        rundir.write_marker(run_dir, "run")
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "not-rlpipes").write_text("x")
        cfg = load_config(EXAMPLES / "tiny" / "config.yaml", [f"run.output_dir={run_dir}"])
        for overwrite, resume in ((True, False), (False, True), (False, False)):
            with pytest.raises(UserError, match=rf"in use by another rlpipe process \(pid {proc.pid} "):
                check_run_dir(cfg, overwrite, resume)
    finally:
        proc.kill()
        proc.wait()
    assert "not-rlpipes" in rundir.state(run_dir, rundir.RUN_LAYOUT)   # the files alone: foreign
    gone = run_dir / "checkpoints" / ".tmp-step-000026"
    assert rundir._foreign(gone, "checkpoints/.tmp-step-000026", ("x",), ()) is None


def test_overwrite_cannot_delete_a_running_run(tmp_path, harness):
    """The red-team case: a long run with checkpoints in the background, then ``--overwrite``
    into its directory: refused on one line, the running run's files untouched."""
    run_dir = tmp_path / "run"
    config = EXAMPLES / "tiny" / "config.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "rlpipe.cli", "run", str(config),
                              f"run.output_dir={run_dir}", "run.steps=200", "checkpoint.every=1",
                              "log.progress=false"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (run_dir / "metrics.jsonl").is_file() and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, "the first run ended early"
        result = harness.run(["run", config, f"run.output_dir={run_dir}", *FAST, "--overwrite"])
        harness.error(result, f"(pid {first.pid} since")
        assert first.poll() is None and (run_dir / "config.yaml").is_file()
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert saved["run"]["steps"] == 200
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_export_waits_for_no_run_and_a_run_for_no_export(tmp_path, harness):
    """export holds a shared lock: refused while a run holds the directory (its checkpoints
    may be rotated away under it)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run: {steps: 1}\n")
    proc = holder(run_dir)
    try:
        result = harness.run(["export", run_dir, tmp_path / "out"])
        harness.error(result, f"is in use by another rlpipe process (pid {proc.pid}")
        assert not (tmp_path / "out").exists()
    finally:
        proc.kill()
        proc.wait()
    (run_dir / runlock.LOCK).unlink()  # what the killed holder left
    first = runlock.hold(run_dir, "RUN_DIR", shared=True)  # an export, as another process
    runlock._HELD.clear()
    result = harness.run(["export", run_dir, tmp_path / "out"])  # a second export may read
    assert "in use" not in result.stderr
    first.release()
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # no lock file left
