"""After the fact: the health rules replayed over a finished (or running) run's ``metrics.jsonl``.

`examine` judges every rule at every step, as the live monitor would have, with the rule
parameters of the run's own ``config.yaml`` (``health`` section; defaults for runs without
one). `rlpipe doctor RUN_DIR` prints `health_text` and exits 1 when a rule fired; ``rlpipe
report`` adds the same text as its "health" section.

>>> import json, shutil, tempfile
>>> run = Path(tempfile.mkdtemp())
>>> rows = [{"step": s, "policy/clipfrac": c} for s, c in enumerate([0.1, 0.6, 0.7, 0.8, 0.2], 1)]
>>> _ = (run / "metrics.jsonl").write_text("".join(json.dumps(r) + chr(10) for r in rows))
>>> findings = examine(*load_run(run))
>>> [(f.rule, f.ranges) for f in findings]
[('clip_high', '4-5')]
>>> print(health_text(findings).splitlines()[0])
health: 1 rule fired
>>> shutil.rmtree(run)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.rule import History, Rule
from rlpipe.core.base.yamlconf import Converter
from rlpipe.core.observe.health.monitor import HealthConfig, judge, load_rules
from rlpipe.core.observe.metrics import load_metrics


@dataclass
class Finding:
    """A rule that fired: the steps where its condition held and what it saw the first time."""

    rule: str
    steps: list[int]
    seen: str
    remedy: str
    reads: tuple[str, ...]
    panel: str

    @property
    def ranges(self) -> str:
        """The steps as ranges: ``"3-5, 9"``."""
        spans: list[list[int]] = []
        for step in self.steps:
            if spans and step == spans[-1][1] + 1:
                spans[-1][1] = step
            else:
                spans.append([step, step])
        return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def run_settings(run_dir: Path):
    """The ``health`` section of ``run_dir/config.yaml`` (defaults without one)."""
    path = Path(run_dir) / "config.yaml"
    raw = {}
    if path.is_file():
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise UserError(f"{path}: unreadable ({type(exc).__name__})") from None
    section = raw.get("health") if isinstance(raw, dict) else None
    try:
        return Converter(Path(run_dir), set()).section(HealthConfig, section or {}, "health")
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None


def load_run(run_dir: Path) -> tuple[list[dict], dict[str, Rule]]:
    """The rows of ``run_dir/metrics.jsonl`` and the rules the run was judged by."""
    rows = load_metrics(Path(run_dir))  # a bad run dir or metrics line is one UserError
    settings = run_settings(run_dir)
    try:
        return rows, load_rules(settings)  # health.enabled: false turns off only the live checks
    except UserError as exc:
        raise UserError(f"{Path(run_dir) / 'config.yaml'}: {exc}") from None


def examine(rows: list[dict], rules: dict[str, Rule]) -> list[Finding]:
    """Every rule judged at every step of ``rows``; the rules that fired, in firing order."""
    found: dict[str, Finding] = {}
    for end in range(1, len(rows) + 1):
        history = History(rows, end)
        for name, rule in rules.items():
            seen = judge(rule, history)
            if seen is None:
                continue
            if name not in found:
                found[name] = Finding(name, [], f"at step {history.step}: {seen}", rule.remedy,
                                      tuple(rule.reads), rule.panel)
            found[name].steps.append(history.step)
    return list(found.values())


def health_text(findings: list[Finding], report_dir: Path | None = None) -> str:
    """The findings as text: one block per rule (steps, what it saw, the remedy). With
    ``report_dir``, each names the plot there that shows it, when there is one."""
    if not findings:
        return "health: no rule fired"
    lines = [f"health: {len(findings)} rule{'s' if len(findings) > 1 else ''} fired"]
    for f in findings:
        plot = report_dir / f"{f.panel}.png" if report_dir is not None else None
        where = f"plot {plot}" if plot is not None and plot.is_file() else f"panel {f.panel}"
        lines += [f"  {f.rule}: steps {f.ranges} ({', '.join(f.reads)}; {where})",
                  f"    {f.seen}",
                  f"    remedy: {f.remedy}"]
    return "\n".join(lines)


def report_section(run_dir: Path) -> str:
    """The "health" section of ``rlpipe report``: `health_text`, naming the plots in
    ``run_dir/report``; a run whose ``health`` settings no longer load says so instead."""
    try:
        findings = examine(*load_run(run_dir))
    except UserError as exc:
        return f"health: not judged ({exc})"
    return health_text(findings, Path(run_dir) / "report")


def doctor(run_dir: Path) -> tuple[str, int]:
    """``rlpipe doctor``: the text and the exit status (0: no rule fired, 1: some did)."""
    rows, rules = load_run(run_dir)
    findings = examine(rows, rules)
    head = (f"{run_dir}: {len(rows)} steps ({rows[0]['step']}-{rows[-1]['step']}), "
            f"{len(rules)} health rules")
    return f"{head}\n{health_text(findings)}", int(bool(findings))
