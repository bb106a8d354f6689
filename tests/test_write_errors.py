"""The OS refusing a write (issue 39): a full disk or quota (ENOSPC, EDQUOT), a read-only file
system (EROFS), no permission (EACCES) is one ``error:`` line naming the path and what was being
written, exit 2, and the newest checkpoint stays resumable. The refusals are raised where the
write happens (the test machine's disk is not filled); a run then resumes to the same result."""

import builtins
import errno
import os
import pathlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.run import checkpoint
from rlpipe.core.observe import metrics, samples
from tests.conftest import final_weights, logged_metrics

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = ["run.steps=2", "data.batch_size=4", "collector.max_new_tokens=8", "train.epochs=1",
        "log.progress=false", "checkpoint.every=1"]


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def cli(*args) -> SimpleNamespace:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def refused(code: int):
    return OSError(code, os.strerror(code))


class _Refusing:
    """A text file whose write of a line holding ``marker`` fails with ``code``."""

    def __init__(self, file, marker: str, code: int):
        self.file, self.marker, self.code = file, marker, code

    def write(self, text):
        if self.marker in text:
            raise refused(self.code)
        return self.file.write(text)

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_refused_metrics_row_is_one_line_and_the_run_resumes(code, tmp_path, harness):
    run_dir = tmp_path / "run"
    args = ["run", TINY, f"run.output_dir={run_dir}", *FAST]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics, "open", lambda *a, **k: _Refusing(builtins.open(*a, **k),
                                                             '"step": 2,', code), raising=False)
        result = cli(*args)
    harness.error(result, f"cannot write {run_dir / 'metrics.jsonl'} (the metrics row of step 2)",
                  os.strerror(code))
    assert [p.name for p in checkpoint.complete(run_dir)] == ["step-000001"]  # resumable
    assert cli(*args, "--resume").returncode == 0
    assert [r["step"] for r in logged_metrics(run_dir)] == [1, 2]
    assert final_weights(run_dir)


def test_refused_samples_are_one_line(tmp_path, harness):
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        real = Path.write_text
        mp.setattr(samples.Path, "write_text", lambda self, *a, **k: (_ for _ in ()).throw(
            refused(errno.ENOSPC)) if self.name == "step-1.jsonl.tmp" else real(self, *a, **k))
        result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST)
    harness.error(result, f"cannot write {run_dir / 'samples' / 'step-1.jsonl'} (the samples of "
                          f"step 1): No space left on device")


def test_an_unwritable_parent_of_the_run_directory_is_one_line(tmp_path, harness):
    """The test runs as root, for whom chmod refuses nothing: mkdir itself is refused."""
    run_dir = tmp_path / "locked" / "run"
    with pytest.MonkeyPatch.context() as mp:
        real = pathlib.Path.mkdir
        mp.setattr(pathlib.Path, "mkdir", lambda self, *a, **k: (_ for _ in ()).throw(
            refused(errno.EACCES)) if self == run_dir else real(self, *a, **k))
        result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST)
    harness.error(result, f"cannot write {run_dir} (the run directory and its lock): "
                          f"Permission denied")
    assert not run_dir.exists()


def test_an_unexpected_refused_write_is_still_one_line(tmp_path, harness, monkeypatch):
    """A write rlpipe does not wrap (here: the reward module's) still gives one line."""
    def boom(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/somewhere/cache.db")
    from rlpipe.core.run import pipeline
    monkeypatch.setattr(pipeline.Pipeline, "train", boom)
    result = cli("run", TINY, f"run.output_dir={tmp_path / 'run'}", *FAST)
    harness.error(result, "cannot write /somewhere/cache.db: Permission denied")
