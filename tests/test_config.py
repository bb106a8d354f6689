"""Config loading and the CLI's handling of bad input: one line naming the problem, exit status 2."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.base.yamlconf import parse_overrides
from rlpipe.core.config.plan import plan_run
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.tools.explain import with_plugin_defaults

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny"


@pytest.fixture
def cfg_file(tmp_path):
    """A valid config in tmp_path (its own prompt file; the tiny example's model folder)."""
    (tmp_path / "prompts.txt").write_text("Hello there\nThe sky is\n")
    raw = yaml.safe_load((TINY / "config.yaml").read_text())
    raw["models"]["actor"]["path"] = str(TINY / "model")
    raw["run"]["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def edit(path, **sections):
    raw = yaml.safe_load(path.read_text())
    for dotted, value in sections.items():
        *parents, last = dotted.split("__")
        node = raw
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[last] = value
    path.write_text(yaml.safe_dump(raw))
    return path


def cli_error(*args) -> str:
    result = CliRunner().invoke(main, list(map(str, args)))
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_valid_config_loads_with_defaults_and_plugin_args(cfg_file):
    cfg = load_config(cfg_file)
    assert cfg.collector.name == "hf" and cfg.collector.args["max_new_tokens"] == 24
    assert cfg.data.prompts == cfg_file.parent / "prompts.txt"       # relative to the YAML file
    assert cfg.train.max_grad_norm == 1.0 and cfg.kl.estimator is None  # the plan chooses it
    assert [r.key for r in cfg.rewards] == ["length", "loop"]


def test_overrides_are_typed_and_paths_are_relative_to_cwd(cfg_file, tmp_path, monkeypatch):
    (tmp_path / "other.txt").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(cfg_file, ["run.steps=3", "kl.coef=0.1", "data.prompts=other.txt",
                                 "rewards.0.weight=2", "collector.temperature=0.7"])
    assert (cfg.run.steps, cfg.kl.coef, cfg.rewards[0].weight) == (3, 0.1, 2.0)
    assert cfg.data.prompts == tmp_path / "other.txt"
    assert cfg.collector.args["temperature"] == 0.7


def test_exponent_floats_without_a_dot_are_floats(cfg_file):
    """YAML 1.1 reads 3e-4 as a string; rlpipe reads it as YAML 1.2 does, in files and overrides."""
    text = re.sub(r"(?m)^(\s*)critic_lr:.*$", r"\1critic_lr: 5e-5", cfg_file.read_text())
    assert "critic_lr: 5e-5" in text
    cfg_file.write_text(text)
    cfg = load_config(cfg_file, ["train.lr=3e-4", "kl.coef=1E-2"])
    assert (cfg.train.lr, cfg.train.critic_lr, cfg.kl.coef) == (3e-4, 5e-5, 1e-2)
    assert parse_overrides(["a=1e5x", "b=e5", "c=7"]) == {"a": "1e5x", "b": "e5", "c": 7}


def test_gpu_example_config_is_valid(tmp_path):
    """examples/gpu/config.yaml checks out once its placeholder paths point at real folders."""
    cfg = load_config(TINY.parent / "gpu" / "config.yaml",
                      [f"models.actor.path={TINY / 'model'}", f"rewards.0.path={tmp_path}"])
    assert cfg.run.device == "cuda" and cfg.models.actor.dtype == "bfloat16"
    assert cfg.models.actor.lora.r == 16 and cfg.models.reference.offload is False


def test_resolved_config_round_trips(cfg_file, tmp_path):
    result = CliRunner().invoke(main, ["config", str(cfg_file), "run.steps=4"])
    assert result.exit_code == 0, result.output
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(result.stdout)
    again = load_config(resolved)  # the same config, plugin defaults now written out
    expected = with_plugin_defaults(cfg := load_config(cfg_file, ["run.steps=4"]))
    expected["collector"]["max_prompt_tokens"] = 256 - 24  # the plan's budget, lowered to fit
    assert again.to_dict() == expected
    first, second = plan_run(cfg), plan_run(again)  # the same run planned
    assert (first.kl, first.scoring, first.budgets) == (second.kl, second.scoring, second.budgets)


@pytest.mark.parametrize("change, message", [
    ({"bogus": 1}, "unknown key bogus"),
    ({"train__epochz": 3}, "unknown key train.epochz; valid keys here: epochs"),
    ({"advantage__name": "nope"}, "unknown advantage plugin 'nope'; available: gae"),
    ({"loss__name": "nope"}, "unknown loss plugin 'nope'; available: cispo, gspo, ppo"),
    ({"collector__max_new_tokenz": 3}, "collector.max_new_tokenz: unknown argument for plugin "
                                       "rlpipe.collectors:hf (rlpipe 0.1.0); accepted: max_new_tokens"),
    ({"train__epochs": "four"}, "train.epochs: expected int, got str 'four'"),
    ({"run__steps": 1.5}, "run.steps: expected int, got float 1.5"),
    ({"run__debug": 1}, "run.debug: expected bool, got int 1"),
    ({"kl__estimator": "k9"}, "kl.estimator: 'k9' is not one of 'k1', 'k2', 'k3'"),
    ({"rewards__0__per_token": "lots"}, "rewards.0.per_token: expected float, got str 'lots'"),
    ({"data__prompts": "missing.txt"}, "data.prompts: file not found: "),
    ({"rewards": []}, "rewards: list at least one reward plugin"),
])
def test_bad_config_is_one_line_and_exit_2(cfg_file, change, message):
    for key, value in change.items():
        edit(cfg_file, **{key: value})
    assert message in cli_error("run", cfg_file)


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  steps: [1, 2\n")
    assert "malformed YAML (line" in cli_error("run", bad)


def test_missing_config_file(tmp_path):
    assert "config file not found" in cli_error("run", tmp_path / "nope.yaml")


def test_bad_override(cfg_file):
    assert "is not KEY=VALUE" in cli_error("config", cfg_file, "run.steps")
    assert "unknown key run.stepz" in cli_error("config", cfg_file, "run.stepz=2")


def test_duplicate_reward_needs_label(cfg_file):
    edit(cfg_file, rewards=[{"name": "loop"}, {"name": "loop", "n": 3}])
    assert "give repeated plugins a `label`" in cli_error("config", cfg_file)
    edit(cfg_file, rewards=[{"name": "loop"}, {"name": "loop", "n": 3, "label": "loop3"}])
    assert [r.key for r in load_config(cfg_file).rewards] == ["loop", "loop3"]


def test_subprocess_exit_status_and_debug_traceback(cfg_file):
    edit(cfg_file, train__epochs="four")
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", str(cfg_file)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 2
    assert plain.stderr.strip() == "error: train.epochs: expected int, got str 'four'"
    debug = subprocess.run(cmd + ["--debug"], capture_output=True, text=True, env=env, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "UserError" in debug.stderr


def test_user_error_is_the_exception_type(cfg_file):
    edit(cfg_file, bogus=1)
    with pytest.raises(UserError):
        load_config(cfg_file)


def test_rlpipe_device_env_replaces_run_device_unless_overridden(monkeypatch):
    """RLPIPE_DEVICE (the test suite's device switch) wins over the file, a KEY=VALUE over it."""
    monkeypatch.setenv("RLPIPE_DEVICE", "auto")
    assert load_config(TINY / "config.yaml").run.device == "auto"  # the file says cpu
    assert load_config(TINY / "config.yaml", ["run.device=cpu"]).run.device == "cpu"
    monkeypatch.delenv("RLPIPE_DEVICE")
    assert load_config(TINY / "config.yaml").run.device == "cpu"


def test_overrides_as_pairs_are_taken_and_other_shapes_are_one_line():
    """Issue 54: `load_config` with overrides as (KEY, VALUE) pairs raised a traceback."""
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
    assert load_config(tiny, [("run.steps", 3), "run.seed=4"]).run.steps == 3
    for bad in ("run.steps=3", [3], [("run.steps",)]):
        with pytest.raises(UserError, match=r"^overrides?"):
            load_config(tiny, bad)
