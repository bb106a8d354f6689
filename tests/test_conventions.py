"""Conventions users bring from TRL and friends: tracker extras refused on one line before any
model loads, the resolved config logged as hyperparameters, ``rlpipe report RUN_A RUN_B``,
errors that name Python keywords from Python and flags from the command line, and
``module:attr`` imported from the working directory as ``python -m`` does."""

import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.observe import metrics
from rlpipe.core.run import rundir
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import ON_COMMAND_LINE, UserError
from rlpipe.core.run.pipeline import train
from rlpipe.core.contracts.registry import PluginError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


# ---- trackers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_missing_tracker_is_one_line_before_any_model_loads(tracker, tmp_path, monkeypatch):
    find = metrics.importlib.util.find_spec
    monkeypatch.delitem(sys.modules, tracker, raising=False)
    monkeypatch.setattr(metrics.importlib.util, "find_spec",
                        lambda name, *a: None if name == tracker else find(name, *a))
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(TINY), f"log.{tracker}=true",
                                       f"run.output_dir={out}"])
    assert result.exit_code == 2
    assert result.output == (f"error: log.{tracker}: true needs the {tracker} package: "
                             f"pip install 'rlpipe[{tracker}]'\n")
    assert not out.exists()  # refused at load: no run directory, no model built


def test_the_extras_name_the_trackers():
    text = (ROOT / "pyproject.toml").read_text()
    for extra in ("tensorboard", "wandb", "vllm", "report"):
        assert f"\n{extra} = [" in text, extra


class FakeWandb(types.ModuleType):
    """The part of the wandb API the sink calls, recording what it was given."""

    def __init__(self):
        super().__init__("wandb")
        self.config, self.logged = {}, []
        outer = self

        class Run:
            class config:  # noqa: N801 -- wandb.Run.config
                @staticmethod
                def update(values, allow_val_change=False):
                    outer.config.update(values)

            @staticmethod
            def log(values, step):
                outer.logged.append((step, values))

            @staticmethod
            def finish():
                pass

        self.init = lambda **kwargs: Run()
        self.Table = lambda columns, data: ("table", columns, data)


def test_the_resolved_config_is_the_runs_hyperparameters(tmp_path, monkeypatch):
    """W&B gets the config as written to config.yaml; TensorBoard its flat form as hparams."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics, "_wandb_key_configured", lambda: False)
    tensorboard = pytest.importorskip("tensorboard", reason="pip install 'rlpipe[tensorboard]'")
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "run.steps=1",
                             "log.wandb=true", "log.tensorboard=true", "log.samples_every=0"])
    run_dir = train(cfg, progress=False)
    assert fake.config == cfg.to_dict() and fake.config["run"]["steps"] == 1
    assert [step for step, _ in fake.logged] == [1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    session = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    assert b"run.steps" in session and b"kl.coef" in session and tensorboard.__version__


def test_flat_config_is_what_tensorboard_takes():
    flat = metrics.flat_config(load_config(TINY).to_dict())
    assert flat["run.steps"] == 12 and flat["kl.coef"] == 0.1 and flat["collector.n"] == 2
    assert all(isinstance(v, (int, float, str, bool)) for v in flat.values())


# ---- rlpipe report RUN_A RUN_B ------------------------------------------------------------------

def _fake_run(path: Path, scores: list[float]) -> Path:
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "reward/score": s, "kl/ref": 0.01 * i} for i, s in enumerate(scores)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_overlays_several_runs(tmp_path):
    a = _fake_run(tmp_path / "a" / "lr-1e-5", [-1.0, 0.0, 0.5])
    b = _fake_run(tmp_path / "b" / "lr-1e-5", [-1.0, 0.2, 0.9])  # same name: parents tell apart
    result = CliRunner().invoke(main, ["report", str(a), str(b)])
    assert result.exit_code == 0, result.output
    table = result.output.split("\n\n")[-1]
    assert "a/lr-1e-5      3           0.5" in table and "b/lr-1e-5      3           0.9" in table
    written = sorted(p.name for p in (a / "report").iterdir())
    assert written == ["compare-kl.png", "compare-overview.png", "compare-reward.png"]
    assert not (b / "report").exists()  # only the first run's report/ is written
    result = CliRunner().invoke(main, ["report", str(a), str(a)])
    assert result.exit_code == 2 and "named twice" in result.output


# ---- errors name what the user typed --------------------------------------------------------------

def _earlier_run(path: Path) -> Path:
    path.mkdir()
    rundir.write_marker(path, "run")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return path


def test_errors_name_python_keywords_from_python_and_flags_from_the_cli(tmp_path):
    out = _earlier_run(tmp_path / "run")
    with pytest.raises(UserError) as python_error:
        train(load_config(TINY, [f"run.output_dir={out}"]), progress=False)
    assert "pass overwrite=True to replace it, or resume=True to continue it" in str(python_error.value)
    assert "--" not in str(python_error.value)
    result = CliRunner().invoke(main, ["run", str(TINY), f"run.output_dir={out}"])
    assert result.exit_code == 2
    assert "pass --overwrite to replace it, or --resume to continue it" in result.output
    assert ON_COMMAND_LINE.get() is False  # the CLI's setting did not leak into this context


# ---- module:attr from the working directory ------------------------------------------------------

def test_module_reference_resolves_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_cwd.py").write_text(
        "def brevity(prompts, responses, **batch):\n    return [-len(r) for r in responses]\n")
    monkeypatch.chdir(tmp_path)  # as the `rlpipe` script runs: the working directory not on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cfg = load_config(TINY, ["rewards=[{name: 'my_rewards_cwd:brevity'}]"])
    assert cfg.rewards[0].resolved.obj.__name__ == "brevity"
    assert sys.path[0] == str(tmp_path)


def test_a_module_that_does_not_import_suggests_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginError, match=r"as python -m does; for a file elsewhere use "
                                          r"`path: FILE.py` and `function: NAME`"):
        load_config(TINY, ["rewards=[{name: 'not_here_anywhere:brevity'}]"])
