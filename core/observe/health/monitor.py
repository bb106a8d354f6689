"""The rules of a run, built from its ``health`` config section, and the live monitor.

`load_rules` builds every installed rule (entry-point group ``rlpipe.health``) but those in
``health.ignore``, each with its ``health.rules.<rule>`` parameters checked like any config key;
`Monitor` judges them after every step: a rule whose condition holds logs ``health/<rule>`` = 1
in that step's metrics, prints one line the first time it fires, and, if it is in
``health.stop_on``, asks the run to stop.

>>> rules = load_rules(HealthConfig(rules={"clip_high": {"threshold": 0.4}}))
>>> rules["clip_high"].threshold, "value_not_learning" in rules
(0.4, True)
>>> lines = []
>>> monitor = Monitor({"clip_high": rules["clip_high"]}, stop_on=["clip_high"], echo=lines.append)
>>> for step in (1, 2, 3, 4):
...     row = {"step": step, "policy/clipfrac": 0.6}
...     monitor.observe(row)
>>> row["health/clip_high"], monitor.stop, len(lines)
(1, 'clip_high', 1)
>>> lines[0].split(";")[0]
'health: clip_high at step 3: policy/clipfrac 0.6 (mean of steps 1-3) > 0.4'
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlpipe.core.contracts import registry
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.rule import History, Rule
from rlpipe.core.base.yamlconf import Converter, opt
from rlpipe.core.base.files import read_jsonl

HEAD, TAIL = 100, 1000  # rows a live monitor keeps: the run's first steps and its newest


@dataclass
class HealthConfig:
    enabled: bool = opt(True, "judge the health rules after every step; false turns off the live "
                              "checks and stop_on, not rlpipe doctor")
    stop_on: list[str] = opt(help="installed rule names: rules that stop the run after a "
                                  "checkpoint when they fire",
                             factory=list)
    ignore: list[str] = opt(help="installed rule names: rules not judged (live, in rlpipe "
                                 "doctor and in the report)",
                            factory=list)
    rules: dict[str, Any] = opt(help="{RULE: {PARAM: VALUE}}: tune a rule within its declared "
                                     "ranges, e.g. clip_high: {threshold: 0.4}; an unknown rule "
                                     "or parameter is an error", factory=dict)
    resolved = None  # not a field: the rules `load_config` built (`rlpipe.core.observe.health.load_rules`)


def load_rules(settings, conv: Converter | None = None) -> dict[str, Rule]:
    """``{name: rule}`` for the ``health`` section ``settings``; names in ``stop_on``, ``ignore``
    and ``rules`` must be installed rules, and each rule's parameters pass its declared ranges.
    An installed third-party rule that fails to import is skipped with a warning unless the
    section names it."""
    conv = conv or Converter(Path.cwd(), set())
    found = registry.find("health")
    named = {"health.stop_on": settings.stop_on, "health.ignore": settings.ignore,
             "health.rules": list(settings.rules)}
    for key, names in named.items():
        for name in names:
            if name not in found:
                raise UserError(f"{key}: unknown health rule {name!r}; installed: "
                                f"{', '.join(found) or 'none'}")
    both = sorted(set(settings.stop_on) & set(settings.ignore))
    if both:
        raise UserError(f"health.stop_on: {both[0]} is also in health.ignore; keep it in one")
    rules = {}
    for name in found:
        if name in settings.ignore:
            continue
        try:
            plugin = registry.get("health", name)
        except registry.PluginError as exc:
            if name in settings.stop_on or name in settings.rules:
                raise
            print(f"warning: health rule {name} skipped: {exc}", file=sys.stderr)
            continue
        key = f"health.rules.{name}"
        with registry.calling(f"{key} ({plugin.spec.label})", "__init__"):
            rule = conv.section(plugin.obj, settings.rules.get(name) or {}, key)
        registry.tag(rule, f"health rule {name} ({plugin.spec.label})")
        rule.name = name
        rules[name] = rule
    return rules


def fired_line(name: str, rule: Rule, step: int, seen: str) -> str:
    """The one line a rule prints when it fires: step, numbers, remedy."""
    return f"health: {name} at step {step}: {seen}; {rule.remedy}"


def judge(rule: Rule, history: History) -> str | None:
    """``rule.check(history)``; an exception in a rule's code names the rule."""
    return registry.call(rule.check, history)


def _echo(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)  # above a progress bar, if one is drawn


class Monitor:
    """Judges ``rules`` after every step. ``rows``: the steps of the run so far (a resumed run's
    ``metrics.jsonl``); a rule with ``health/<rule>`` in them has fired already and prints no line
    again. ``echo`` prints a line (None: silent, as on ranks other than 0)."""

    def __init__(self, rules: dict[str, Rule], stop_on=(), rows=(),
                 echo: Callable[[str], None] | None = _echo):
        self.rules, self.stop_on, self.echo = rules, set(stop_on), echo
        self.rows: list[dict] = []
        self.fired: set[str] = set()
        self.stop: str | None = None  # the stop_on rule that fired
        for row in rows:
            self._keep(row)
            self.fired |= {k[len("health/"):] for k, v in row.items() if k.startswith("health/") and v}

    def _keep(self, row: dict) -> None:
        """Keep the first `HEAD` rows and the newest `TAIL`: a check reads a few rows, so memory
        and time per step stay flat over any run length."""
        self.rows.append(row)
        if len(self.rows) > HEAD + TAIL:
            del self.rows[HEAD]

    def observe(self, row: dict) -> None:
        """Judge every rule on the history up to ``row`` (one step's metrics, with ``step``), add
        ``health/<rule>`` = 1 to ``row`` for each whose condition holds, print the first-time
        ones and note a ``stop_on`` rule in `stop`."""
        self._keep(row)
        history, held = History(self.rows), {}
        for name, rule in self.rules.items():
            seen = judge(rule, history)
            if seen is None:
                continue
            held[f"health/{name}"] = 1
            if name not in self.fired:
                self.fired.add(name)
                if self.echo is not None:
                    self.echo(fired_line(name, rule, history.step, seen))
                if name in self.stop_on and self.stop is None:
                    self.stop = name
        row.update(held)


def monitor_for(settings, metrics_path: Path | None = None, echo: bool = True) -> Monitor:
    """The monitor of a run: its rules (none with ``health.enabled: false``), and the rows of
    ``metrics_path`` when resuming."""
    if not settings.enabled:
        return Monitor({}, echo=None)
    rules = settings.resolved if settings.resolved is not None else load_rules(settings)
    rows = []
    if metrics_path is not None and metrics_path.is_file():
        rows = [row for _, row in read_jsonl(metrics_path)]
    return Monitor(rules, settings.stop_on, rows, _echo if echo else None)
