"""Composing in Python (core/config/compose.py): stage objects into the pipeline, the critic decision from
the advantage object, the record of what ran, ready-made stages by name, and the docs' compose snippets."""

import functools
import importlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import rlpipe
from rlpipe.core.run import build
from rlpipe.core.config import compose
from rlpipe.core.contracts import registry
from rlpipe.core.config.compose import save_config
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.plugins.advantages import GAE, GRPO
from rlpipe.plugins.collectors import HFCollector
from rlpipe.plugins.losses import PPOLoss
from rlpipe.plugins.rewards import LengthPenalty

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


class ReturnToGo(torch.nn.Module):
    """A critic-free advantage: the undiscounted return of each token."""

    needs_critic = False

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale

    def forward(self, td):
        mask = td["response_mask"]
        td["advantage"] = self.scale * (td["reward"] * mask).flip(-1).cumsum(-1).flip(-1) * mask
        td["value_target"] = td["advantage"].clone()
        return td


def bare_config(tmp_path, **extra) -> Path:
    """A config with no plugin section at all: models, data, run and train only."""
    raw = {"run": {"steps": 1, "output_dir": str(tmp_path / "run"), "device": "cpu"},
           "models": {"actor": {"path": str(TINY.parent / "model"), "init": "random"}},
           "data": {"prompts": str(TINY.parent / "prompts.txt"), "batch_size": 4},
           "train": {"epochs": 1, "minibatches": 1}, "log": {"progress": False}, **extra}
    path = tmp_path / "bare.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def short(responses):
    return [float(len(r) < 20) for r in responses]


def short_reward(prompts, responses, **batch):
    return short(responses)


def test_objects_only_train_without_plugin_sections(tmp_path):
    cfg = load_config(bare_config(tmp_path))
    assert cfg.rewards == [] and cfg.advantage.name == "gae"  # defaults, replaced below
    pipe = Pipeline(cfg, progress=False,
                    collector=functools.partial(HFCollector, max_new_tokens=6, n=2),
                    rewards=[lambda prompts, responses, **batch: short(responses),
                             ("length", 0.5, LengthPenalty(min_tokens=2, max_tokens=4))],
                    advantage=ReturnToGo(scale=2.0), loss=PPOLoss(clip_low=0.1))
    assert pipe.models.critic is None  # from the advantage object's needs_critic
    assert pipe.plugins.rewards.labels == ["reward_0", "length"]
    assert pipe.plugins.rewards.weights == [1.0, 0.5]
    assert pipe.plugins.loss.clip_low == 0.1 and pipe.updater.loss is pipe.plugins.loss
    run_dir = pipe.train()
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/reward_0" in row and "reward/length" in row and "value/loss" not in row
    text = (run_dir / "config.yaml").read_text()
    saved = yaml.safe_load(text)
    here = ReturnToGo.__module__
    assert saved["advantage"] == {"name": f"{here}:ReturnToGo", "scale": 2.0}
    assert saved["collector"] == {"name": "rlpipe.plugins.collectors.hf:HFCollector",
                                  "max_new_tokens": 6, "n": 2}
    assert saved["loss"]["name"] == "rlpipe.plugins.losses.ppo:PPOLoss"
    assert saved["loss"]["clip_low"] == 0.1 and saved["loss"]["vf_coef"] == 0.5
    assert saved["rewards"][1] == {"name": "rlpipe.plugins.rewards.length:LengthPenalty",
                                   "weight": 0.5, "label": "length"}  # its arguments: see below
    head = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert f"#   advantage: {here}:ReturnToGo (a Python object)" in head
    assert "# This file cannot rebuild every stage of this run:" in head
    assert re.search(r"#   rewards\.0: .*<lambda> is a lambda", head), head
    assert "#   rewards.1: constructor argument(s) min_tokens, max_tokens, " in head
    assert "name: gae" not in text and "name: hf" not in text and "name: ppo" not in text


def test_objects_and_entry_points_mix_and_the_record_rebuilds(tmp_path):
    cfg = load_config(TINY, ["run.steps=1", f"run.output_dir={tmp_path / 'run'}",
                             "log.progress=false"])
    pipe = Pipeline(cfg, advantage=functools.partial(GRPO, scale_std=False))
    assert pipe.models.critic is None
    assert [type(p).__name__ for p in pipe.plugins.rewards.parts] == ["LengthPenalty", "LoopPenalty"]
    assert type(pipe.plugins.advantage) is GRPO and pipe.plugins.advantage.scale_std is False
    batch, metrics = pipe.step()
    assert torch.isfinite(batch["advantage"]).all() and "value/loss" not in metrics
    text = (pipe.run_dir / "config.yaml").read_text()
    dist = f"rlpipe {importlib.metadata.version('rlpipe')}"
    assert f"#   rewards.0: rlpipe.rewards:length ({dist})" in text
    assert f"#   collector: rlpipe.collectors:hf ({dist})" in text
    assert "cannot rebuild" not in text
    again = load_config(pipe.run_dir / "config.yaml")  # the record is a config that rebuilds it
    assert again.advantage.name == "rlpipe.plugins.advantages.grpo:GRPO"
    assert again.advantage.args == {"scale_std": False} and again.advantage.resolved.obj is GRPO
    assert build.needs_critic(again) is False


def test_critic_follows_the_advantage_object_never_the_name():
    cfg = load_config(TINY)  # advantage: gae in the YAML

    class NoCritic(torch.nn.Module):
        needs_critic = False

    cases = [(None, True), (GAE(), True), (GRPO(), False), (GRPO, False),
             (functools.partial(GRPO, eps=1e-4), False), (NoCritic(), False), (ReturnToGo, False)]
    for advantage, expected in cases:
        assert build.needs_critic(compose.apply(cfg, advantage=advantage)) is expected, advantage
    grpo = load_config(TINY, ["advantage={name: grpo}"])
    assert build.needs_critic(compose.apply(grpo, advantage=GAE())) is True
    assert cfg.advantage.name == "gae"  # the caller's config is not changed


@pytest.mark.parametrize("stage, obj, fragments", [
    ("collector", type("Engine", (), {"collect": lambda self, p: None})(),
     ["collector: ", "Engine (a Python object): wrong shape: collector class lacks sync_weights"]),
    ("advantage", lambda td: td, ["advantage: ", "wrong shape: expected a torch.nn.Module subclass"]),
    ("loss", torch.nn.Linear(1, 1), ["loss: torch.nn.modules.linear:Linear (a Python object): wrong "
                                     "shape: expected a torchrl.objectives.LossModule subclass"]),
    ("rewards", [42], ["rewards.0: builtins:int (a Python object): wrong shape"]),
    ("rewards", [("a", "heavy", short)], ["rewards.0: weight must be a finite number, got 'heavy'"]),
    ("rewards", [short_reward, short_reward],
     ["rewards: duplicate reward labels ['short_reward', 'short_reward']"]),
    ("rewards", [short], ["reward function short(responses) fits no accepted signature"]),
    ("rewards", [functools.partial(short, 1)], ["rewards.0: a functools.partial with positional"]),
])
def test_an_object_of_the_wrong_kind_is_one_user_error_before_any_model(tmp_path, stage, obj,
                                                                         fragments):
    cfg = load_config(bare_config(tmp_path))
    with pytest.raises(rlpipe.UserError) as info:
        Pipeline(cfg, **{stage: obj})
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    assert not (tmp_path / "run").exists()  # refused before the run directory or any model


def test_no_reward_anywhere_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^rewards: list at least one reward plugin \(or pass "):
        Pipeline(load_config(bare_config(tmp_path)))


def test_record_of_yaml_plugins_names_distribution_and_version(tmp_path):
    cfg = load_config(TINY)
    save_config(cfg, tmp_path / "config.yaml")
    head = [line for line in (tmp_path / "config.yaml").read_text().splitlines() if line[0] == "#"]
    dist = f"rlpipe {importlib.metadata.version('rlpipe')}"
    assert head == [f"# Written by rlpipe {rlpipe.__version__}. Stages as they ran:",
                    f"#   collector: rlpipe.collectors:hf ({dist})",
                    f"#   advantage: rlpipe.advantages:gae ({dist})",
                    f"#   loss: rlpipe.losses:ppo ({dist})",
                    f"#   rewards.0: rlpipe.rewards:length ({dist})",
                    f"#   rewards.1: rlpipe.rewards:loop ({dist})"]
    assert load_config(tmp_path / "config.yaml").to_dict() == cfg.to_dict()


class Opaque(torch.nn.Module):
    def __init__(self, width: int = 3):
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)  # `width` is not kept


def test_instance_args_that_cannot_be_read_back_are_noted():
    plugin, args = compose.describe_object("advantages", Opaque(), "advantage")
    assert args == {} and "constructor argument(s) width of " in plugin.spec.note
    plugin, args = compose.describe_object("advantages", GAE(gamma=0.9), "advantage")
    assert args == {"gamma": 0.9, "lmbda": 0.95, "whiten": True, "lmbda_critic": None,
                    "length_adaptive_alpha": None} and plugin.spec.note == ""
    weights = torch.ones(2)  # a partial's argument that YAML cannot hold: noted, still passed on
    plugin, args = compose.describe_object("advantages", functools.partial(Opaque, width=weights),
                                           "advantage")
    assert args == {} and "constructor argument(s) width of " in plugin.spec.note
    assert dict(plugin.spec.kwargs) == {"width": weights}


def test_ready_made_stages_are_importable_by_name():
    """Every built-in entry point is exported by its group's package, as the same object."""
    assert rlpipe.UserError is UserError
    for group in ("collectors", "rewards", "advantages", "losses"):  # the stages (health rules
        package = importlib.import_module(f"rlpipe.plugins.{group}")  # live in rlpipe.core.observe.health)
        for name, specs in registry.find(group).items():
            spec = specs[0]
            if not spec.builtin:
                continue
            attr = spec.value.split(":")[1]
            assert attr in package.__all__, (group, attr)
            assert getattr(package, attr) is registry.load(group, name)
    with pytest.raises(AttributeError):
        importlib.import_module("rlpipe.plugins.advantages").Nope


def _readme_snippets() -> list[str]:
    page = (ROOT / "docs" / "compose.md").read_text()
    section = page.split("\n## ", 1)[0]  # the page's opening, before "How a step works"
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


def test_readme_compose_snippets_run(tmp_path, monkeypatch, capsys):
    snippets = _readme_snippets()
    assert len(snippets) == 2
    shutil.copytree(TINY.parent, tmp_path / "examples" / "tiny")  # run as from the repository root
    monkeypatch.chdir(tmp_path)
    trained = {}
    exec(compile(snippets[0], "docs/compose.md:1", "exec"), trained)
    assert len(snippets[0].splitlines()) <= 20
    run_dir = trained["run_dir"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "value/loss" not in rows[0]
    assert {"reward/reward_0", "reward/length"} <= set(rows[0])
    printed = capsys.readouterr().out
    assert "#   rewards.1: rlpipe.plugins.rewards.length:LengthPenalty (a Python object)" in printed
    standalone = {}
    exec(compile(snippets[1], "docs/compose.md:2", "exec"), standalone)
    out, td = standalone["out"], standalone["td"]
    assert torch.isfinite(out["loss_objective"]) and torch.isfinite(out["loss_critic"])
    # the advantage GAE wrote, against a float64 loop (gamma 1, lambda 0.95, no whitening)
    reward, value, mask = (td[k].double() for k in ("reward", "value", "response_mask"))
    for row in range(2):
        n, running = int(mask[row].sum()), 0.0
        for t in reversed(range(n)):
            next_value = value[row, t + 1] if t + 1 < n else 0.0
            running = reward[row, t] + next_value - value[row, t] + 0.95 * running
            assert abs(td["advantage"][row, t].item() - running) < 1e-5
