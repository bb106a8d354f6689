"""docs/coming-from-trl.md names only rlpipe keys that exist (a table cell's YAML fragment is
loaded with `load_config`, plugin arguments against the plugin's signature), and the shipped
TRL-defaults config loads and runs one step on a tiny chat model."""

import copy
import inspect
import re
from pathlib import Path

import pytest
import yaml

from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.contracts import registry
from rlpipe.core.run.pipeline import Pipeline
from tests.test_docs import chat_model  # noqa: F401 - the tiny Llama with a chat template

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "coming-from-trl.md").read_text()
CONFIG = ROOT / "examples" / "trl_grpo" / "config.yaml"
PLUGINS = {"collector": ("collectors", "hf"), "advantage": ("advantages", "gae"),
           "loss": ("losses", "ppo")}


def tables() -> dict[str, list[str]]:
    """Each ``## SECTION`` table's rlpipe column (the third), by section."""
    out = {}
    for section, body in re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", PAGE, re.S | re.M):
        rows = [line.split("|")[1:-1] for line in body.splitlines() if line.startswith("| `")]
        if rows:
            out[section] = [row[2].strip() for row in rows]
    return out


def fragments(cell: str) -> list[dict]:
    """The YAML fragments of a cell, dotted keys (``train.epochs: 1``) made nested."""
    out = []
    for text in re.findall(r"`([^`]+)`", cell):
        raw = yaml.safe_load(text)
        assert isinstance(raw, dict), f"{text!r}: an rlpipe cell holds `key: value` fragments"
        for key, value in raw.items():
            *path, last = key.split(".")
            node = nested = {}
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
            out.append(nested)
    return out


def accepted(group: str, name: str) -> set[str]:
    return set(inspect.signature(registry.load(group, name)).parameters)


def check_keys(cells: list[str]) -> dict:
    """Plugin arguments checked against their plugin's signature; the rest merged into one
    config tree (returned)."""
    tree: dict = {}
    for cell in cells:
        for fragment in fragments(cell):
            for section, value in fragment.items():
                if section in PLUGINS:
                    group, default = PLUGINS[section]
                    args = {k: v for k, v in value.items() if k != "name"}
                    assert set(args) <= accepted(group, value.get("name", default)), (cell, args)
                elif section == "rewards":
                    for reward in value:
                        args = set(reward) - {"name", "weight", "label"}
                        assert args <= accepted("rewards", reward["name"]), (cell, reward)
                else:
                    merge(tree, {section: value})
    return tree


def merge(into: dict, over: dict) -> dict:
    """``over`` merged into ``into``, mapping by mapping."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


@pytest.mark.parametrize("section", ["GRPOConfig", "PPOConfig"])
def test_every_rlpipe_key_the_page_names_exists(section, tmp_path):
    cells = tables()[section]
    assert len(cells) >= 10
    tree = check_keys(cells)
    base = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    base["models"]["actor"]["path"] = str(ROOT / "examples" / "tiny" / "model")
    base["data"]["prompts"] = str(ROOT / "examples" / "tiny" / "prompts.txt")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(merge(base, tree)))
    load_config(tmp_path / "c.yaml", [f"run.output_dir={tmp_path / 'run'}"])  # unknown key: error


def test_the_trl_defaults_config_is_trls_algorithm_and_runs_a_step(tmp_path, chat_model):  # noqa: F811
    cfg = load_config(CONFIG, [f"models.actor.path={chat_model}", "eval.prompts=null",
                               "eval.every=0", "collector.max_new_tokens=6",
                               "collector.max_prompt_tokens=128",
                               f"run.output_dir={tmp_path / 'run'}"])
    assert (cfg.train.epochs, cfg.train.minibatches, cfg.kl.coef) == (1, 1, 0)
    assert cfg.advantage.name == "grpo" and cfg.advantage.args["scale_std"] is True
    assert cfg.loss.args["agg"] == "token-mean" and cfg.collector.args["n"] == 8
    batch, metrics = Pipeline(cfg, progress=False).step()
    assert batch.batch_size[0] == 8 and "reward/answer_match" in metrics
