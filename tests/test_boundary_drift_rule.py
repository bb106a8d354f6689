"""The `boundary_drift` health rule: fires on the first step with any conversation whose turn
boundaries differ from the chat template's rendering, quiet otherwise and where no environment
logged the metric; registered under ``rlpipe.health`` like the other built-ins."""

import importlib
import tomllib
from pathlib import Path

import pytest

from rlpipe.core.contracts.rule import History
from rlpipe.core.observe.health import Rule
from rlpipe.plugins.health.rules import BoundaryDrift

ROOT = Path(__file__).resolve().parents[1]
KEY = "env/receipt/boundary_drift"


def rows(*drift):
    return [{"step": i + 1, KEY: d} for i, d in enumerate(drift)]


@pytest.mark.parametrize("series, fires_at", [
    ((0.0, 0.0, 1 / 16), 3),          # one conversation in 16, at once: no window
    ((0.5,), 1),                      # from step 1
])
def test_it_fires_on_any_drift(series, fires_at):
    history = rows(*series)
    line = BoundaryDrift().check(History(history))
    assert line.startswith(f"{KEY} {series[-1]:.3g} at step {fires_at} > 0")
    assert all(BoundaryDrift().check(History(history, end)) is None
               for end in range(1, len(history)) if history[end - 1][KEY] == 0)


@pytest.mark.parametrize("history", [
    rows(0.0, 0.0, 0.0),                                   # healthy
    [{"step": 1, "reward/score": 1.0}],                    # single-turn: no env metrics
    [{"step": 1, KEY: float("nan")}],                      # not a number: quiet
    rows(0.5, 0.0),                                        # judges the newest step only
])
def test_it_is_quiet_without_drift(history):
    assert BoundaryDrift().check(History(history)) is None


def test_its_threshold_is_a_parameter():
    assert BoundaryDrift(threshold=0.25).check(History(rows(0.25))) is None
    assert BoundaryDrift(threshold=0.25).check(History(rows(0.3))) is not None


def test_it_is_registered_and_declares_itself():
    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    module, _, attr = points["rlpipe.health"]["boundary_drift"].partition(":")
    rule = getattr(importlib.import_module(module), attr)
    assert rule is BoundaryDrift and issubclass(rule, Rule)
    assert rule.reads == (KEY,) and rule.panel and "." in rule.remedy  # names config keys
    assert "`boundary_drift`" in (ROOT / "docs" / "health.md").read_text()
