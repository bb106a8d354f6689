"""The README's test command is exactly what CI runs, and its documented config keys exist."""

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest

from rlpipe.core.config.settings import Config
from rlpipe.core.contracts import registry

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert test_cmd.strip() in ci_lines


def test_first_command_is_the_quickstart_and_ci_tests_it_with_the_same_packages():
    first = re.findall(r"```bash\n(.*?)\n```", README, re.S)[0]
    assert first.endswith("python examples/quickstart/run.py")
    pins = re.search(r"pip install --no-deps ([^&]+?) &&", first).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"pip install --no-deps {pins} && RLPIPE_REQUIRE_QUICKSTART=1" in ci


PAGES = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
DOCUMENTED = sorted(set(re.findall(r"`([a-z_]+\.[a-z_]+(?:\.[a-z_]+)?)`", PAGES))
                    - {"metrics.jsonl", "config.yaml", "pyproject.toml"})


DEFAULT_PLUGINS = {"collector": ("collectors", "hf"), "advantage": ("advantages", "gae"),
                   "loss": ("losses", "ppo")}


def _has_key(cls, dotted: str) -> bool:
    section, _, arg = dotted.partition(".")
    if section in DEFAULT_PLUGINS:  # a plugin section: an argument of its default plugin
        return arg == "name" or arg in inspect.signature(
            registry.load(*DEFAULT_PLUGINS[section])).parameters
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        fields = {f.metadata.get("yaml", f.name): f.name for f in dataclasses.fields(cls)}
        if part not in fields:
            return False
        tp = hints[fields[part]]
        options = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        cls = options[0] if options else tp
    return True


@pytest.mark.parametrize("key", [k for k in DOCUMENTED if k.split(".")[0] in
                                 {f.name for f in dataclasses.fields(Config)}])
def test_documented_config_keys_exist(key):
    """Every dotted config key named in the README or the docs is a real key of the config tree."""
    assert _has_key(Config, key), key
