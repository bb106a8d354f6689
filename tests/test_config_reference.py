"""The config reference cannot drift: every setting has its help on the field (or in its plugin's
``Args:``), docs/config.md is what `rlpipe.tools.explain` generates now, and ``rlpipe config
--defaults`` / ``--explain`` / ``CONFIG`` print the loader's own defaults."""

import dataclasses
from pathlib import Path

import yaml
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.contracts import registry
from rlpipe.core.config.settings import Config, load_config
from rlpipe.tools.explain import REQUIRED, plugin_settings, reference_markdown, settings

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


def test_every_setting_has_a_help_line():
    missing = [s.key for s in settings() if not s.help.strip()]
    assert not missing, f"config fields without help (opt/num help=...): {missing}"


def test_every_builtin_plugin_argument_has_a_help_line():
    missing = []
    for group in ("collectors", "rewards", "advantages", "losses", "environments"):
        for name, specs in registry.find(group).items():
            if specs[0].builtin:
                missing += [f"{name}.{s.key}" for s in plugin_settings(group, name) if not s.help]
    assert not missing, f"plugin arguments without an Args: line in the docstring: {missing}"


def test_the_docs_page_is_current():
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == reference_markdown(), \
        "docs/config.md is stale: python -m rlpipe.tools.explain > docs/config.md"


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def test_defaults_yaml_holds_the_loaders_defaults():
    out = CliRunner().invoke(main, ["config", "--defaults"])
    assert out.exit_code == 0, out.output
    template, printed = yaml.safe_load(out.output), yaml.safe_load(out.output)
    # filled with the few required values, the template loads, and every default is the loader's
    template["models"]["actor"].update(path=str(TINY.parent / "model"), init="random")
    template["data"]["prompts"] = str(TINY.parent / "prompts.txt")
    template["rewards"] = [{"name": "length"}]
    del template["collector"]["max_prompt_tokens"]  # 256 + 64 exceeds the tiny model's context;
    # left unset, the budget shrinks to fit (given, it is an error: config_checks)
    written = ROOT / "runs" / "defaults-template.yaml"
    written.parent.mkdir(exist_ok=True)
    written.write_text(yaml.safe_dump(template))
    loaded = load_config(written).to_dict()
    written.unlink()
    off = tuple(s.key + "." for s in settings() if s.section and s.default is None)  # commented out
    for s in settings():
        if s.key.startswith(off) or s.section or s.key.startswith("rewards") or s.default == REQUIRED or \
                s.key == "collector.max_prompt_tokens":
            continue
        assert _get(loaded, s.key) == _get(template, s.key), s.key
        if not s.key.startswith(("collector.", "advantage.", "loss.")):  # plugin args: below
            assert _get(printed, s.key) == s.default, s.key


def test_explain_prints_type_default_range_and_help():
    out = CliRunner().invoke(main, ["config", "--explain", "train.lr"])
    assert out.exit_code == 0
    lr = {f.name: f for f in dataclasses.fields(Config.__dataclass_fields__["train"].default_factory())}["lr"]
    assert lr.metadata["help"] == "AdamW learning rate of the actor"  # the field's own help
    assert out.output == "train.lr: float, default 1.0e-05, range > 0\n  AdamW learning rate of the actor\n"
    out = CliRunner().invoke(main, ["config", str(TINY), "--explain", "rewards.1.n"])
    assert out.output.startswith("rewards.1.n: int, default 3 (reward loop)\n  n-gram length")
    out = CliRunner().invoke(main, ["config", "--explain", "nope.key"])
    assert out.exit_code == 2 and out.output.startswith("error: --explain nope.key: not a setting")


def test_config_prints_every_plugin_argument():
    out = CliRunner().invoke(main, ["config", str(TINY)])
    assert out.exit_code == 0, out.output
    resolved = yaml.safe_load(out.output)
    hf = {s.key for s in plugin_settings("collectors", "hf")}
    assert set(resolved["collector"]) == {"name"} | hf and len(hf) == 13
    assert resolved["collector"]["max_new_tokens"] == 24  # the file's value, not the default
    assert resolved["collector"]["cache"] == "dynamic"   # the signature's default
    assert resolved["rewards"][1]["min_repeats"] == 3
    # what it prints is a config that loads to the same thing
    again = ROOT / "runs" / "resolved-again.yaml"
    again.parent.mkdir(exist_ok=True)
    again.write_text(out.output)
    try:
        assert load_config(again).collector.args == {k: v for k, v in resolved["collector"].items()
                                                     if k != "name"}
    finally:
        again.unlink()


def test_explain_environment_documents_the_section_and_the_tools_arguments():
    out = CliRunner().invoke(main, ["config", "--explain", "environment"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("environment: section\n  multi-turn: the environment answering")
    assert "environment.name: str, default required\n" in out.output
    tools = plugin_settings("environments", "tools", "environment.")
    assert tools and all(f"{s.key}: " in out.output and s.help in out.output for s in tools)
    assert {"environment.tools", "environment.max_turns"} <= {s.key for s in tools}
    out = CliRunner().invoke(main, ["config", "--explain", "environment.max_turns"])
    assert out.output == "environment.max_turns: int, default 4 (environment tools)\n" \
                         "  the model's turns per conversation\n"
    assert "### environment `tools`" in reference_markdown()
