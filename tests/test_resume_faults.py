"""Checkpoints and resume under faults (issue 13).

A run is killed at chosen points (after a metric row, between the files of a checkpoint, while
pruning, while saving ``final/``, before its first checkpoint), resumed with ``--resume``, and
compared with an uninterrupted run: ``metrics.jsonl`` without ``time/`` and ``perf/`` keys, each
step exactly once, and the final weights bit for bit. In-process kills raise `Killed`, a
`BaseException` that no cleanup code catches; one kill is a real ``os._exit`` in a subprocess.
Damaged checkpoints, a full disk, a finished run and changed settings are covered too.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.observe.metrics import MetricsWriter
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.run import checkpoint, rundir
from tests.conftest import final_weights, logged_metrics as rows

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = ["run.steps=3", "data.batch_size=4", "collector.max_new_tokens=8", "train.epochs=1",
        "log.progress=false"]


class Killed(BaseException):
    """Stands for a kill at this point: `except Exception` cleanup does not run."""


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def config(run_dir, *extra):
    return load_config(TINY, [f"run.output_dir={run_dir}", *FAST, *extra])


def train(run_dir, *extra, resume=False) -> Path:
    return Pipeline(config(run_dir, *extra), progress=False, resume=resume).train()


def assert_same_run(run_dir, reference) -> None:
    got, want = rows(run_dir), rows(reference)
    assert [r["step"] for r in got] == [1, 2, 3]  # each step exactly once
    assert got == want
    a, b = final_weights(run_dir), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cli(*args) -> SimpleNamespace:
    """``rlpipe ARGS`` in this process; the fields the conftest harness asserts on."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(tmp_path_factory.mktemp("reference") / "run")
    finally:
        torch.set_num_threads(threads)


# ---- kill points: (checkpoint settings, hook installer) ----------------------------------------

def after_row(step):
    """The metric row of ``step`` is on disk, its checkpoint is not."""
    def install(mp):
        real = MetricsWriter.write

        def write(self, metrics):
            real(self, metrics)
            if metrics["step"] == step:
                raise Killed
        mp.setattr(MetricsWriter, "write", write)
    return install


def mid_checkpoint(step):
    """The first weights file of checkpoint ``step`` is written, the rest is not."""
    def install(mp):
        real = checkpoint.save_file

        def save_file(tensors, path):
            real(tensors, path)
            if f"step-{step:06d}" in path:
                raise Killed
        mp.setattr(checkpoint, "save_file", save_file)
    return install


def pruning(delete_first: bool):
    """While an old checkpoint is pruned: its marker is gone and (``delete_first``) it is renamed
    and one of its files deleted."""
    def install(mp):
        real = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            path = Path(path)
            if path.name.startswith(".trash-step") and (path.exists() or not delete_first):
                if delete_first:
                    next(p for p in path.iterdir() if p.is_file()).unlink()
                raise Killed
            return real(path, *args, **kwargs)
        mp.setattr(checkpoint.shutil, "rmtree", rmtree)
    return install


def in_final(mp):
    """``final/`` is half written."""
    def export(self, final):
        final.mkdir()
        (final / "model.safetensors").write_bytes(b"partial")
        raise Killed
    mp.setattr(Pipeline, "_export", export)


def in_final_temp_file(mp):
    """``save_pretrained`` is cut with its temporary file in the folder (``.tmpXXXXXXXX``)."""
    def export(self, folder):
        folder.mkdir()
        (folder / ".tmpk3j2x9q1").write_bytes(b"partial")
        raise Killed
    mp.setattr(Pipeline, "_export", export)


KILLS = {
    "after-row-2": (["checkpoint.every=1"], after_row(2)),
    "before-first-checkpoint": (["checkpoint.every=2"], after_row(1)),
    "mid-checkpoint-2": (["checkpoint.every=1"], mid_checkpoint(2)),
    "pruning-marker-removed": (["checkpoint.every=1", "checkpoint.keep=1"], pruning(False)),
    "pruning-files-deleted": (["checkpoint.every=1", "checkpoint.keep=1"], pruning(True)),
    "in-final": (["checkpoint.every=1"], in_final),
    "in-final-temp-file": (["checkpoint.every=1"], in_final_temp_file),
}


@pytest.mark.parametrize("point", KILLS)
def test_killed_run_resumes_to_the_uninterrupted_result(point, tmp_path, reference):
    extra, install = KILLS[point]
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        install(mp)
        with pytest.raises(Killed):
            train(run_dir, *extra)
    for path in checkpoint.complete(run_dir):  # what looks complete is intact
        assert checkpoint.verify(path) is None, path
    train(run_dir, *extra, resume=True)
    assert_same_run(run_dir, reference)
    assert not list((run_dir / "checkpoints").glob(".t*"))  # leftovers are cleaned up
    assert not list(run_dir.glob(".t*")) and not list((run_dir / "final").glob(".t*"))


def test_a_run_killed_in_final_can_be_overwritten(tmp_path, reference):
    """The red-team case: a kill while final/ is written left rlpipe's own temporary file, and
    --overwrite refused it as foreign; final/ is now written beside and renamed."""
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        in_final_temp_file(mp)
        with pytest.raises(Killed):
            train(run_dir, "checkpoint.every=1")
    assert not (run_dir / "final").exists()  # never a half-written final/
    Pipeline(config(run_dir), progress=False, overwrite=True).train()
    assert_same_run(run_dir, reference)


def test_a_final_folder_cut_by_an_older_rlpipe_is_rlpipes_own(tmp_path, reference):
    """final/.tmpXXXX left by a kill in a version that wrote final/ in place: resumed (the
    unfinished final/ is rewritten) and overwritable, not refused as foreign."""
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        in_final(mp)
        with pytest.raises(Killed):
            train(run_dir, "checkpoint.every=1")
    (run_dir / "final").mkdir()
    (run_dir / "final" / ".tmpab12cd34").write_bytes(b"partial")
    assert rundir.state(run_dir, rundir.RUN_LAYOUT) == "run"  # --resume and --overwrite take it
    train(run_dir, "checkpoint.every=1", resume=True)
    assert_same_run(run_dir, reference)


KILL_SCRIPT = """
import os, sys
from rlpipe.core.run import checkpoint
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline
real = checkpoint.save_file
def save_file(tensors, path):
    real(tensors, path)
    if "step-000002" in path:
        os._exit(137)  # a real kill: nothing else runs
checkpoint.save_file = save_file
Pipeline(load_config(sys.argv[1], sys.argv[2:]), progress=False).train()
"""


def test_a_real_kill_between_checkpoint_files_resumes_exactly(tmp_path, reference):
    run_dir = tmp_path / "run"
    args = [f"run.output_dir={run_dir}", *FAST, "checkpoint.every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(TINY), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 137, done.stderr[-2000:]
    assert [p.name for p in checkpoint.complete(run_dir)] == ["step-000001"]
    result = cli("run", TINY, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert_same_run(run_dir, reference)


# ---- damaged checkpoints -----------------------------------------------------------------------

def flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


DAMAGE = {  # what happens to checkpoint step-000002, and the reason the warning gives
    "flipped-byte": (lambda d: flip_byte(d / "actor.safetensors"), "sha256"),
    "truncated": (lambda d: (d / "state.pt").write_bytes(b"x"), "bytes"),
    "file-deleted": (lambda d: (d / "critic.safetensors").unlink(), "missing"),
    "no-manifest": (lambda d: (d / "manifest.json").unlink(), "manifest"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_checkpoint_falls_back_to_an_intact_one(damage, tmp_path, reference, capsys):
    spoil, reason = DAMAGE[damage]
    run_dir = tmp_path / "run"
    train(run_dir, "checkpoint.every=1", "run.steps=2")
    spoil(run_dir / "checkpoints" / "step-000002")
    capsys.readouterr()
    train(run_dir, "checkpoint.every=1", resume=True)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "checkpoint" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), warnings
    assert "step-000002" in warnings[0] and reason in warnings[0]
    assert "resuming from step-000001" in warnings[0]
    assert_same_run(run_dir, reference)


def test_no_intact_checkpoint_is_one_line_and_changes_nothing(tmp_path, harness):
    run_dir = tmp_path / "run"
    train(run_dir, "checkpoint.every=1", "run.steps=2")
    for path in checkpoint.complete(run_dir):
        flip_byte(path / "state.pt")
    before = harness.snapshot(tmp_path)
    result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST, "--resume")
    harness.error(result, "no intact checkpoint", "step-000002", "step-000001")
    assert harness.snapshot(tmp_path) == before


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_resume_without_a_readable_config_yaml_is_refused(damage, tmp_path, harness):
    """Its config.yaml is what the refused settings (seed, LoRA, prompts, ...) are checked
    against: without it a resume would follow the checkpoints with unchecked settings."""
    run_dir = tmp_path / "run"
    train(run_dir, "checkpoint.every=1", "run.steps=1")
    if damage == "missing":
        (run_dir / "config.yaml").unlink()
    else:
        (run_dir / "config.yaml").write_text("x: [\n")
    before = harness.snapshot(tmp_path)
    result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST, "run.seed=5", "--resume")
    harness.error(result, "cannot resume", "config.yaml",
                  "is missing" if damage == "missing" else "does not read as a mapping")
    assert harness.snapshot(tmp_path) == before


def test_resume_without_any_checkpoint_says_it_starts_again(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "checkpoint.every=1", "run.steps=2")
    shutil.rmtree(run_dir / "checkpoints")
    result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST, "checkpoint.every=1", "--resume")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no checkpoint in" in warnings[0]
    assert "starting again at step 1" in warnings[0]
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]


# ---- a full disk --------------------------------------------------------------------------------

def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writer", ["save_file", "torch.save"])
def test_full_disk_while_saving_is_one_line_and_keeps_the_last_checkpoint(writer, tmp_path,
                                                                          reference, harness):
    run_dir = tmp_path / "run"
    args = ["run", TINY, f"run.output_dir={run_dir}", *FAST, "checkpoint.every=1"]
    with pytest.MonkeyPatch.context() as mp:
        real = checkpoint.save_file
        if writer == "save_file":
            mp.setattr(checkpoint, "save_file",
                       lambda t, p: enospc() if "step-000002" in p else real(t, p))
        else:
            real_save = torch.save
            mp.setattr(checkpoint.torch, "save", lambda obj, f, *a, **k: enospc()
                       if "step-000002" in str(f) else real_save(obj, f, *a, **k))
        result = cli(*args)
    harness.error(result, "cannot write checkpoint", "No space left", "step-000001 is intact")
    assert [p.name for p in checkpoint.complete(run_dir)] == ["step-000001"]
    assert checkpoint.verify(run_dir / "checkpoints" / "step-000001") is None
    assert not list((run_dir / "checkpoints").glob(".t*"))
    assert cli(*args, "--resume").returncode == 0
    assert_same_run(run_dir, reference)


# ---- a finished run, changed settings -----------------------------------------------------------

def test_resume_of_a_finished_run_says_so_and_trains_nothing(tmp_path, reference, harness):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = harness.snapshot(run_dir)
    result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST, "--resume")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"run {run_dir} is already finished at step 3; "
                                     f"raise run.steps to continue")
    assert "error" not in result.stderr
    assert harness.snapshot(run_dir) == before


def test_changed_settings_are_applied_and_listed_on_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    steady = ["train.warmup_steps=0"]  # the lr asserted below, not a warm-up's fraction of it
    train(run_dir, "checkpoint.every=1", "run.steps=2", "train.lr=0.001", *steady)
    capsys.readouterr()
    pipe = Pipeline(config(run_dir, "checkpoint.every=1", "train.lr=0.0005", "kl.coef=0.2", *steady),
                    progress=False, resume=True)
    pipe.train()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(err) == 1 and "train.lr 0.001 -> 0.0005" in err[0]
    assert "kl.coef 0.1 -> 0.2" in err[0]
    assert "run.steps" not in err[0]  # raising run.steps is what resume is for
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["train/lr"] == 0.0005 and last["kl/coef"] == 0.2
    assert all(g["lr"] == 0.0005 for g in pipe.updater.opts["actor"].param_groups)
    assert "lr: 0.0005" in (run_dir / "config.yaml").read_text()  # the next resume compares to it


REFUSED = {
    "run.seed": ["run.seed=1"],
    "data.prompts": [f"data.prompts={Path(__file__)}"],
    "models.actor.lora": ["models.actor.lora={r: 4}"],
    "rewards.1.name": ["rewards=[{name: length}]"],
}


@pytest.mark.parametrize("key", REFUSED)
def test_changes_a_checkpoint_cannot_follow_are_refused(key, tmp_path, harness):
    run_dir = tmp_path / "run"
    train(run_dir, "checkpoint.every=1", "run.steps=1")
    before = harness.snapshot(tmp_path)
    result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST, *REFUSED[key], "--resume")
    harness.error(result, "cannot resume", key)
    assert harness.snapshot(tmp_path) == before


def test_checkpoint_beyond_run_steps_is_one_line(tmp_path, harness):
    run_dir = tmp_path / "run"
    train(run_dir, "checkpoint.every=1", "run.steps=2")
    shutil.rmtree(run_dir / "final")
    result = cli("run", TINY, f"run.output_dir={run_dir}", *FAST, "run.steps=1", "--resume")
    harness.error(result, "run.steps=1", "already at step 2")


def test_checkpoints_touch_and_read_only_their_own_folder_names(tmp_path):
    """Saving and pruning remove only ``step-NNNNNN`` and ``.tmp-``/``.trash-`` folders, and only
    those are read back: a user's ``step-000001-notes/`` survives, a copied ``step-best/`` with
    its marker is neither loaded nor a crash."""
    root = tmp_path / "checkpoints"
    notes = root / "step-000001-notes"
    notes.mkdir(parents=True)
    (notes / "notes.txt").write_text("mine\n")
    leftover = root / ".tmp-step-000003"
    leftover.mkdir()
    for step in (1, 2):
        checkpoint.save(tmp_path, step, {"actor": {"w": torch.full((2,), float(step))}},
                        {"step": step}, keep=1)
    shutil.copytree(root / "step-000002", root / "step-best")
    checkpoint.save(tmp_path, 3, {"actor": {"w": torch.zeros(2)}}, {"step": 3}, keep=1)
    assert (notes / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in root.iterdir()) == ["step-000001-notes", "step-000003", "step-best"]
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-000003"]


@pytest.mark.parametrize("name", ["state.pt", "actor.safetensors"])
def test_a_checkpoint_file_that_matches_its_manifest_but_does_not_load_is_one_line(name, tmp_path):
    """A file written corrupt (its manifest computed over the corrupt bytes) passes `verify`;
    loading it is one `UserError` that says what to do, not a pickle or safetensors traceback."""
    path = checkpoint.save(tmp_path, 2, {"actor": {"weight": torch.zeros(1, 2)}}, {"step": 2}, keep=2)
    (path / name).write_bytes(os.urandom(1000))
    (path / checkpoint.MANIFEST).unlink()
    checkpoint._seal(path, 2)          # the manifest now matches the corrupt file
    assert checkpoint.verify(path) is None
    with pytest.raises(UserError, match=rf"{path}: {name} does not load .*move that folder out"):
        checkpoint.load(path, {"actor": torch.nn.Linear(2, 1, bias=False)})


def test_a_checkpoint_holding_another_steps_state_is_one_line(tmp_path):
    """Step 1's state.pt in step-000002 with a manifest made to match: the weights are step 2's,
    the optimizer, RNG and data position step 1's. Loading refuses the mix."""
    weights = {"actor": {"weight": torch.zeros(1, 2)}}
    one = checkpoint.save(tmp_path, 1, weights, {"step": 1}, keep=2)
    two = checkpoint.save(tmp_path, 2, weights, {"step": 2}, keep=2)
    shutil.copy(one / "state.pt", two / "state.pt")
    (two / checkpoint.MANIFEST).unlink()
    checkpoint._seal(two, 2)
    assert checkpoint.verify(two) is None
    with pytest.raises(UserError, match=r"step-000002: its state.pt holds step 1, not 2"):
        checkpoint.load(two, {"actor": torch.nn.Linear(2, 1, bias=False)})
