"""Run-directory safety (issue 13): rlpipe writes only into a new or empty directory or its own
run directory, and ``--overwrite`` deletes only an rlpipe run directory, never a symbolic link's
target, the working directory or a parent, the home directory, ``/``, or a folder holding a model,
data or config file the run reads. Each refusal: exit 2, one ``error:`` line, no traceback, and
no file under the test's folder changed. Real folders, symlinks and a copy of the tiny model.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.run import build, rundir, runlock
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FAST = ["run.steps=1", "data.batch_size=2", "collector.max_new_tokens=6", "train.epochs=1",
        "train.minibatches=1", "log.progress=false"]


def cli(*args) -> SimpleNamespace:
    """``rlpipe ARGS`` in this process; the fields the conftest harness asserts on."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def fake_run(path: Path, *extra: str, kind: str = "run") -> Path:
    """An earlier rlpipe run directory (marker, config, metric rows, a checkpoint, final/)."""
    (path / "checkpoints" / "step-000001").mkdir(parents=True)
    (path / "final").mkdir()
    rundir.write_marker(path, kind)
    (path / "config.yaml").write_text("run: {steps: 1}\n")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / "final" / "model.safetensors").write_bytes(b"weights")
    for name in extra:
        (path / name).write_text("the user's\n")
    return path


@pytest.fixture
def world(tmp_path, monkeypatch):
    """tmp/assets/{model, prompts.txt}, tmp/cfg/config.yaml reading them, tmp/home (HOME),
    tmp/work/sub (the working directory), folders, links and files to aim run.output_dir at."""
    assets = tmp_path / "assets"
    shutil.copytree(EXAMPLES / "tiny" / "model", assets / "model")
    shutil.copy(EXAMPLES / "tiny" / "prompts.txt", assets / "prompts.txt")
    raw = yaml.safe_load((EXAMPLES / "tiny" / "config.yaml").read_text())
    raw["models"]["actor"]["path"] = str(assets / "model")
    raw["data"]["prompts"] = str(assets / "prompts.txt")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / ".ssh" / "id_rsa").write_text("secret\n")
    (tmp_path / "work" / "sub").mkdir(parents=True)
    (tmp_path / "work" / "notes.txt").write_text("mine\n")
    (tmp_path / "mine" / "deep").mkdir(parents=True)
    (tmp_path / "mine" / "thesis.tex").write_text("years of work\n")
    (tmp_path / "mine" / "deep" / "data.csv").write_text("1,2\n")
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    fake_run(tmp_path / "old_run")
    (tmp_path / "run_link").symlink_to(tmp_path / "old_run")
    fake_run(tmp_path / "run_plus", "notes.txt")
    for name, inner in (("run_final_note", "final/notes.txt"), ("run_samples_note", "samples/mine.md"),
                        ("run_ckpt_copy", "checkpoints/step-000001-best/state.pt"),
                        ("run_ckpt_note", "checkpoints/step-000001/notes.txt")):
        fake_run(tmp_path / name)
        (tmp_path / name / inner).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name / inner).write_text("the user's\n")
    (tmp_path / "rm_out").mkdir()
    fake_run(tmp_path / "rm_out", kind="reward_model")
    (tmp_path / "no_marker").mkdir()
    fake_run(tmp_path / "no_marker")
    (tmp_path / "no_marker" / rundir.MARKER).unlink()
    (tmp_path / "a_file").write_text("not a folder\n")
    shutil.copytree(EXAMPLES / "tiny" / "model", tmp_path / "rm_model")
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "texts.txt").write_text("some text\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "work" / "sub")
    return SimpleNamespace(root=tmp_path, config=tmp_path / "cfg" / "config.yaml")


# output_dir (relative to tmp, or absolute), flags, fragments of the one error line
REFUSED = {
    "working-dir": ("work/sub", ["--overwrite"], ["is the working directory"]),
    "parent-of-working-dir": ("work", ["--overwrite"], ["parent of the working directory"]),
    "dot-dot": ("../..", ["--overwrite"], ["parent of the working directory"]),
    "home": ("home", ["--overwrite"], ["home directory"]),
    "root": ("/", ["--overwrite"], ["filesystem root"]),
    "model-folder": ("assets/model", ["--overwrite"], ["assets/model, which this run reads"]),
    "folder-holding-model-and-data": ("assets", ["--overwrite"], ["a folder holding", "reads"]),
    "config-folder": ("cfg", ["--overwrite"], ["config.yaml, which this run reads"]),
    "reward-model-folder": ("rm_model", ["--overwrite", "rewards=[{name: reward_model, "
                                         "path: {root}/rm_model}]"], ["rm_model, which"]),
    "ptx-data-folder": ("ptx", ["--overwrite", "ptx.coef=0.1", "ptx.data={root}/ptx/texts.txt"],
                        ["texts.txt, which this run reads"]),
    "unrelated-folder": ("mine", ["--overwrite"], ["not an rlpipe run", "no .rlpipe-run marker"]),
    "unrelated-folder-no-flag": ("mine", [], ["not an rlpipe run"]),
    "unrelated-folder-resume": ("mine", ["--resume"], ["not an rlpipe run"]),
    "symlink-to-folder": ("link", ["--overwrite"], ["symbolic link"]),
    "symlink-to-run": ("run_link", ["--overwrite"], ["symbolic link"]),
    "a-file": ("a_file", ["--overwrite"], ["is a file"]),
    "run-with-foreign-file": ("run_plus", ["--overwrite"], ["notes.txt", "does not write"]),
    # inside the folders only rlpipe writes, one level down and in a checkpoint's own folder
    "file-in-final": ("run_final_note", ["--overwrite"], ["final/notes.txt", "does not write"]),
    "file-in-samples": ("run_samples_note", ["--overwrite"], ["samples/mine.md"]),
    "copied-checkpoint": ("run_ckpt_copy", ["--overwrite"], ["checkpoints/step-000001-best/"]),
    "copied-checkpoint-resume": ("run_ckpt_copy", ["--resume"], ["checkpoints/step-000001-best/"]),
    "file-in-a-checkpoint": ("run_ckpt_note", ["--overwrite"],
                             ["checkpoints/step-000001/notes.txt"]),
    "reward-model-output": ("rm_out", ["--overwrite"], ["marker says 'reward_model'"]),
    "run-without-marker": ("no_marker", ["--overwrite"], ["no .rlpipe-run marker"]),
    "earlier-run-no-flag": ("old_run", [], ["earlier run directory", "--overwrite", "--resume"]),
    "overwrite-and-resume": ("old_run", ["--overwrite", "--resume"], ["pass only one"]),
}


def test_safetensors_temporary_files_are_rlpipes_own(tmp_path):
    """safetensors writes each file as ``.tmpXXXXXX`` and renames it: in a checkpoint being
    saved (seen by a second ``rlpipe run --overwrite`` while the first saves) or left by a kill,
    it is the run's own, so --overwrite and --resume take the run; elsewhere it stays foreign."""
    run_dir = fake_run(tmp_path / "run")
    for inner in ("checkpoints/.tmp-step-000002/.tmpQC5dxA", "checkpoints/step-000001/.tmp82m2te",
                  "checkpoints/step-000001/policy/.tmp8auUFu", "final/.tmpab12cd"):
        (run_dir / inner).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / inner).write_bytes(b"partial")
    assert rundir.state(run_dir, rundir.RUN_LAYOUT) == "run"
    (run_dir / ".tmpZZZZZZ").write_text("the user's\n")  # the run folder itself: never written
    assert rundir.state(run_dir, rundir.RUN_LAYOUT) == ("foreign: it holds .tmpZZZZZZ, which "
                                                        "rlpipe does not write")


@pytest.mark.parametrize("case", REFUSED)
def test_refused_output_dirs_change_nothing(case, world, harness):
    target, flags, fragments = REFUSED[case]
    output = target if target.startswith(("/", "..")) else world.root / target
    flags = [f.replace("{root}", str(world.root)) for f in flags]
    before = harness.snapshot(world.root)
    result = cli("run", world.config, f"run.output_dir={output}", *FAST, *flags)
    harness.error(result, "run.output_dir", *fragments)
    assert harness.snapshot(world.root) == before


def test_overwriting_the_model_folder_is_refused_in_a_real_process(world, harness):
    before = harness.snapshot(world.root)
    result = harness.run(["run", world.config, "run.output_dir=../../assets/model", *FAST,
                          "--overwrite"], cwd=world.root / "work" / "sub",
                         env={"HOME": str(world.root / "home")})
    harness.error(result, "which this run reads")
    assert harness.snapshot(world.root) == before


def test_overwrite_replaces_only_an_rlpipe_run(world, harness):
    run_dir = world.root / "old_run"
    outside = {k: v for k, v in harness.snapshot(world.root).items() if not k.startswith("old_run")}
    result = cli("run", world.config, f"run.output_dir={run_dir}", *FAST, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [
        rundir.MARKER, "config.yaml", "final", "metrics.jsonl", "plan.json", "samples"]
    assert json.loads((run_dir / rundir.MARKER).read_text())["finished_step"] == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    after = {k: v for k, v in harness.snapshot(world.root).items() if not k.startswith("old_run")}
    assert after == outside


def test_an_existing_empty_folder_is_used_as_it_is(world):
    empty = world.root / "empty"
    empty.mkdir()
    cfg = load_config(world.config, [f"run.output_dir={empty}"])
    assert build.prepare_run_dir(cfg)[0] == empty.resolve()
    assert sorted(p.name for p in empty.iterdir()) == [runlock.LOCK, rundir.MARKER, "config.yaml"]
    runlock._HELD.pop(empty.resolve()).release()  # what the run's end does
    assert sorted(p.name for p in empty.iterdir()) == [rundir.MARKER, "config.yaml"]


def test_a_run_that_fails_before_its_first_step_needs_no_overwrite(world, monkeypatch, harness):
    run_dir = world.root / "new_run"

    def fail(self):
        raise UserError("a mistake found at the first step")
    with monkeypatch.context() as mp:
        mp.setattr(Pipeline, "step", fail)
        harness.error(cli("run", world.config, f"run.output_dir={run_dir}", *FAST),
                      "first step")
    assert rundir.state(run_dir, rundir.RUN_LAYOUT) == "unstarted"
    result = cli("run", world.config, f"run.output_dir={run_dir}", *FAST)  # no --overwrite
    assert result.returncode == 0, result.stderr
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def rm_config(world, output: Path) -> Path:
    pairs = world.root / "assets" / "pairs.jsonl"
    shutil.copy(EXAMPLES / "reward_model" / "pairs.jsonl", pairs)
    raw = {"model": {"path": str(world.root / "assets" / "model"), "init": "random"},
           "data": {"pairs": str(pairs), "eval_fraction": 0.25, "max_length": 32},
           "train": {"epochs": 1, "batch_size": 8, "device": "cpu"}, "output_dir": str(output)}
    path = world.root / "cfg" / "rm.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("target, fragments", [
    ("mine", ["not an rlpipe train-rm output"]),
    ("assets", ["which this run reads"]),
    ("old_run", ["marker says 'run'"]),
    ("link", ["symbolic link"]),
])
def test_train_rm_overwrite_follows_the_same_rules(target, fragments, world, harness):
    config = rm_config(world, world.root / target)
    before = harness.snapshot(world.root)
    harness.error(cli("train-rm", config, "--overwrite", "--no-progress"), "output_dir", *fragments)
    assert harness.snapshot(world.root) == before


def test_train_rm_overwrites_its_own_output(world, harness):
    out = world.root / "rm"
    config = rm_config(world, out)
    assert cli("train-rm", config, "--no-progress").returncode == 0
    assert rundir.read_marker(out)["kind"] == "reward_model"
    harness.error(cli("train-rm", config, "--no-progress"), "--overwrite")
    assert cli("train-rm", config, "--overwrite", "--no-progress").returncode == 0
