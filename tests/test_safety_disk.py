"""Issue 54: a full disk or a refused write anywhere in a checkpoint save (the folder, each
weights file, torch's ``state.pt`` whose zip writer wraps ENOSPC as ``RuntimeError: unexpected
pos``, the policy folder, the manifest, the flush, the rename that publishes it) is one line and
leaves the previous checkpoint intact. Faults are raised where the write happens, as in
tests/test_write_errors.py; one case runs the tiny example end to end and resumes."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.base.errors import UserError
from rlpipe.core.run import checkpoint
from tests.conftest import logged_metrics

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
WEIGHTS = {"actor": {"w": torch.arange(6.0)}}
TORCH_ENOSPC = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
RUST_ENOSPC = Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                        'message: "No space left on device" })')


def refused(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def fail_when(mp, target, name: str, exc: BaseException, when) -> None:
    """``target.name`` raises ``exc`` when ``when(*args)`` holds, else does what it did."""
    real = getattr(target, name)

    def patched(*args, **kwargs):
        if when(*args):
            raise exc
        return real(*args, **kwargs)
    mp.setattr(target, name, patched)


def in_step_2(*args) -> bool:
    return any("step-000002" in str(a) for a in args)


FAULTS = {   # name: how a write of checkpoint 2 fails
    "mkdir-eacces": lambda mp: fail_when(mp, Path, "mkdir", refused(errno.EACCES), in_step_2),
    "weights-enospc": lambda mp: fail_when(mp, checkpoint, "save_file", refused(errno.ENOSPC),
                                           in_step_2),
    "state-torch-unexpected-pos": lambda mp: fail_when(mp, checkpoint.torch, "save",
                                                       TORCH_ENOSPC, in_step_2),
    "policy-safetensors-storagefull": None,   # the `extra` writer, below
    "manifest-enospc": lambda mp: fail_when(mp, Path, "write_text", refused(errno.ENOSPC),
                                            lambda p, *a: in_step_2(p)),
    "fsync-eio": lambda mp: fail_when(mp, checkpoint.os, "fsync", refused(errno.EIO),
                                      lambda *a: True),
    "publish-rename-eacces": lambda mp: fail_when(mp, Path, "rename", refused(errno.EACCES),
                                                  in_step_2),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_refused_write_anywhere_in_a_save_is_one_line_and_keeps_the_previous(fault, tmp_path):
    checkpoint.save(tmp_path, 1, WEIGHTS, {"step": 1}, keep=2)
    extra = None
    with pytest.MonkeyPatch.context() as mp:
        if FAULTS[fault] is None:
            def extra(folder):
                raise RUST_ENOSPC
        else:
            FAULTS[fault](mp)
        with pytest.raises(UserError) as exc:
            checkpoint.save(tmp_path, 2, WEIGHTS, {"step": 2}, keep=2, extra=extra)
    line = str(exc.value)
    assert "\n" not in line and line.startswith("cannot write checkpoint ")
    assert "step-000001 is intact" in line and "resume" in line
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-000001"]
    assert checkpoint.verify(tmp_path / "checkpoints" / "step-000001") is None
    assert not list((tmp_path / "checkpoints").glob(".t*"))   # no half-written folder left


def test_torch_unexpected_pos_during_a_run_is_one_line_and_the_run_resumes(tmp_path, harness):
    run_dir = tmp_path / "run"
    args = ["run", TINY, f"run.output_dir={run_dir}", "run.steps=2", "data.batch_size=2",
            "collector.max_new_tokens=6", "train.epochs=1", "log.progress=false",
            "checkpoint.every=1"]
    with pytest.MonkeyPatch.context() as mp:
        fail_when(mp, checkpoint.torch, "save", TORCH_ENOSPC, in_step_2)
        got = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(got.exception, SystemExit), got.exception
    result = SimpleNamespace(returncode=got.exit_code, stdout=got.stdout, stderr=got.stderr)
    harness.error(result, "cannot write checkpoint", "unexpected pos 64 vs 0",
                  "step-000001 is intact")
    assert [p.name for p in checkpoint.complete(run_dir)] == ["step-000001"]
    assert CliRunner().invoke(main, [*map(str, args), "--resume"]).exit_code == 0
    assert [r["step"] for r in logged_metrics(run_dir)] == [1, 2]
