"""Plugin registry: discovery by metadata, lazy import, provenance in errors, isolation of broken plugins."""

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.contracts import registry
from rlpipe.core.base import schema
from rlpipe.core.contracts.registry import PluginError
from tests.conftest import python_path

BUILTINS = {("collectors", "hf"), ("rewards", "length"), ("rewards", "loop"),
            ("advantages", "gae"), ("losses", "ppo")}


def make_dist(site, dist, version, entry_points: dict, modules: dict):
    """Write a fake installed distribution (dist-info metadata + modules) into ``site``."""
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[rlpipe.{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "fakeplug", "1.2", {
        "rewards": {"bad": "fakeplug_bad:Reward", "shout": "fakeplug_ok:shout"},
        "advantages": {"notaclass": "fakeplug_ok:shout"},
    }, {
        "fakeplug_bad": "raise ImportError('needs a library that is not installed')\n",
        "fakeplug_ok": """
            def shout(prompts, responses, *, bonus: float = 1.0, **batch):
                return [bonus * r.count('!') for r in responses]
        """,
    })
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    return site


def test_builtins_are_listed_with_distribution_and_version():
    rows = {(s.group, s.name): (s, status) for s, status in registry.status_table()}
    assert BUILTINS <= set(rows)
    for key in BUILTINS:
        spec, status = rows[key]
        assert (spec.dist, status) == ("rlpipe", "ok"), (key, status)
        assert spec.version and spec.version != "?"


def test_broken_plugin_is_reported_and_others_still_work(fake_site):
    rows = {(s.group, s.name): (s, status) for s, status in registry.status_table()}
    spec, status = rows[("rewards", "bad")]
    assert spec.label == "rlpipe.rewards:bad (fakeplug 1.2)"
    assert status.startswith("broken:") and "not installed" in status
    assert rows[("rewards", "shout")][1] == "ok"
    assert all(rows[key][1] == "ok" for key in BUILTINS)
    with pytest.raises(PluginError, match=r"rlpipe\.rewards:bad \(fakeplug 1\.2\): failed to import"):
        registry.load("rewards", "bad")
    assert registry.load("rewards", "length").__name__ == "LengthPenalty"


def test_wrong_shape_is_reported_with_provenance(fake_site):
    with pytest.raises(PluginError, match=r"advantages:notaclass \(fakeplug 1\.2\): wrong shape"):
        registry.load("advantages", "notaclass")


def test_unknown_name_lists_available():
    with pytest.raises(PluginError, match=r"unknown advantage plugin 'nope'; available: .*gae"):
        registry.load("advantages", "nope")


def test_discovery_does_not_import(fake_site):
    found = registry.find("rewards")
    assert "bad" in found and "fakeplug_bad" not in sys.modules


def test_disable_autoload_keeps_only_builtins(fake_site, monkeypatch):
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    assert "shout" not in registry.find("rewards")
    assert {"length", "loop"} <= set(registry.find("rewards"))


def test_same_name_from_two_distributions_is_a_conflict(fake_site):
    make_dist(fake_site, "otherplug", "0.1", {"rewards": {"shout": "fakeplug_ok:shout"}}, {})
    with pytest.raises(PluginError, match=r"registered more than once: .*fakeplug 1\.2.*otherplug 0\.1"):
        registry.load("rewards", "shout")


def test_plain_reward_function_is_wrapped(fake_site):
    cls = registry.load("rewards", "shout")
    # its settings, and `columns` (a mapping of parameters to data columns, reward_fn)
    assert list(inspect.signature(cls).parameters) == ["bonus", "columns"]
    td = TensorDict({schema.FINISHED: torch.tensor([True, False])}, batch_size=[2])
    td[schema.PROMPT_TEXT] = ["a", "b"]
    td[schema.RESPONSE_TEXT] = ["hey!!", "no"]
    out = registry.instantiate(cls, {"bonus": 0.5})(td)
    assert torch.equal(out, torch.tensor([1.0, 0.0]))


def test_cli_plugins_lists_broken_plugin_and_exits_zero(fake_site):
    env = {**os.environ, "PYTHONPATH": python_path(fake_site)}
    env.pop(registry.DISABLE_ENV, None)
    out = subprocess.run([sys.executable, "-m", "rlpipe.cli", "plugins"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["group", "name", "distribution", "version", "status"]
    bad = next(line for line in lines if " bad " in line)
    assert "fakeplug" in bad and "broken" in bad
    assert any(line.split()[:5] == ["rewards", "length", "rlpipe", "0.1.0", "ok"] for line in lines)


def test_metadata_is_scanned_once_and_plugins_loaded_once(fake_site, monkeypatch):
    scans, loads = [], []
    real_entry_points, real_load = registry.entry_points, registry.EntryPoint.load
    monkeypatch.setattr(registry, "entry_points", lambda **kw: scans.append(kw) or real_entry_points(**kw))
    monkeypatch.setattr(registry.EntryPoint, "load", lambda ep: loads.append(ep.value) or real_load(ep))
    registry.refresh()
    for _ in range(3):
        assert "shout" in registry.find("rewards") and registry.resolve("advantages", "gae")
        first = registry.load("rewards", "shout")
    assert len(scans) == len(registry.GROUPS)  # one scan of every group, then the cache
    assert loads == ["fakeplug_ok:shout"] and registry.load("rewards", "shout") is first
    assert registry.get("rewards", "shout").spec.entry_point.value == "fakeplug_ok:shout"
    for _ in range(2):  # a failed import is not cached: it is tried (and reported) each time
        with pytest.raises(PluginError, match="failed to import"):
            registry.load("rewards", "bad")
    assert loads.count("fakeplug_bad:Reward") == 2
    registry.refresh()
    registry.find("rewards")
    assert len(scans) == 2 * len(registry.GROUPS)


def test_a_new_sys_path_entry_is_seen_without_refresh(tmp_path, monkeypatch):
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    registry.find("rewards")  # cached for the current sys.path
    late = tmp_path / "late"
    late.mkdir()
    make_dist(late, "lateplug", "0.3", {"rewards": {"late": "lateplug:late"}},
              {"lateplug": "def late(prompts, responses, **batch):\n    return [0.0] * len(prompts)\n"})
    monkeypatch.syspath_prepend(str(late))
    assert registry.resolve("rewards", "late").label == "rlpipe.rewards:late (lateplug 0.3)"
