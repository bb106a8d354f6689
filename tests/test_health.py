"""Health rules: each fires on a synthetic history made to trip it and stays quiet on one that
is not; the config section is checked; the live monitor prints once; `health.stop_on` stops a
real run after an intact checkpoint; `rlpipe doctor` and the report's health section."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlpipe.core.run import checkpoint
from rlpipe.core.contracts import registry
from rlpipe.core.config.settings import HealthConfig, load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.observe.health import History, Monitor, load_rules, slope
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.tools.doctor import examine
from tests.conftest import NO_ISOLATION

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
BUILTIN = {"kl_explosion", "kl_nonzero_at_start", "reward_hacking_length", "reward_hacking_loop",
           "value_not_learning", "clip_high", "entropy_collapse", "grad_spikes", "truncation",
           "nan_skips", "flat_groups", "boundary_drift", "tools_abandoned"}


def rows_of(**series) -> list[dict]:
    """One row per step from equal-length series: ``rows_of(**{"kl/ref": [...]})``."""
    n = len(next(iter(series.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in series.items()}} for i in range(n)]


def ramp(a: float, b: float, n: int) -> list[float]:
    return [a + (b - a) * i / (n - 1) for i in range(n)]


FLAT20 = [20.0] * 12
CASES = {  # rule: (a history that must fire it, at this step; one that must not)
    "tools_abandoned": [(rows_of(**{"env/tool_calls": [1.0] * 5 + [0.1] * 5}), 10),
                        rows_of(**{"env/tool_calls": [1.0] * 5 + [0.5] * 7})],  # fewer, not gone
    "boundary_drift": [(rows_of(**{"env/receipt/boundary_drift": [0.0, 0.25]}), 2),
                       rows_of(**{"env/receipt/boundary_drift": [0.0, 0.0]})],
    "kl_explosion": [
        (rows_of(**{"kl/ref": [0.0, 5.0, 40.0], "response/length": [20.0] * 3}), 3),  # 2 nats/token
        (rows_of(**{"kl/ref": [20 * v for v in ramp(0.0, 0.6, 5)],                    # +0.15/step
                    "response/length": [20.0] * 5}), 5),
        rows_of(**{"kl/ref": [20 * v for v in ramp(0.0, 0.35, 12)], "response/length": FLAT20})],
    "kl_nonzero_at_start": [
        (rows_of(**{"kl/ref": [0.5, 0.0], "response/length": [20.0, 20.0]}), 1),
        rows_of(**{"kl/ref": [0.0, 5.0, 9.0], "response/length": [20.0] * 3})],
    "reward_hacking_length": [
        (rows_of(**{"reward/score": ramp(0.0, 1.0, 10), "response/length": ramp(20, 32, 10),
                    "reward/rm": ramp(0.0, 1.2, 10), "reward/length": ramp(0.0, -0.2, 10)}), 10),
        rows_of(**{"reward/score": ramp(0.0, 1.0, 12), "response/length": ramp(20, 30, 12),
                   "reward/rm": ramp(0.0, 1.0, 12), "reward/length": [0.0] * 12})],
    "reward_hacking_loop": [
        (rows_of(**{"reward/score": ramp(0.0, 1.0, 10), "reward/loop": ramp(0.0, -0.3, 10)}), 10),
        rows_of(**{"reward/score": ramp(0.0, 1.0, 12), "reward/loop": ramp(0.0, -0.02, 12)})],
    "value_not_learning": [
        (rows_of(**{"value/explained_var": [-0.5] * 10, "value/loss": ramp(1.0, 0.5, 10)}), 8),
        (rows_of(**{"value/loss": [0.3] * 10}), 8),  # flat: the critic does not move
        rows_of(**{"value/explained_var": [-1.0, -0.3, 0.1, 0.3, 0.4, 0.5, 0.5, 0.6, 0.6, 0.7, 0.7],
                   "value/loss": ramp(1.0, 0.5, 11)})],
    "clip_high": [
        (rows_of(**{"policy/clipfrac": [0.1, 0.6, 0.7, 0.8]}), 4),
        rows_of(**{"policy/clipfrac": [0.2, 0.9, 0.2, 0.3, 0.2]})],  # one spike is not high
    "entropy_collapse": [
        (rows_of(**{"policy/entropy": [2.0] * 5 + [0.1] * 5}), 10),
        rows_of(**{"policy/entropy": ramp(2.0, 1.0, 12)})],
    "grad_spikes": [
        (rows_of(**{"train/grad_norm": [1.0] * 10 + [50.0]}), 11),
        (rows_of(**{"train/grad_norm": [1.0] * 6, "train/critic_grad_norm": [2.0] * 5 + [40.0]}), 6),
        rows_of(**{"train/grad_norm": ramp(1.0, 3.0, 12) + [8.0]})],
    "truncation": [
        (rows_of(**{"response/finished_frac": [0.2, 0.3, 0.1]}), 3),
        (rows_of(**{"response/clipped_frac": [0.9] * 3, "response/finished_frac": [1.0] * 3}), 3),
        rows_of(**{"response/finished_frac": [0.9, 0.8, 1.0, 0.95]})],
    "nan_skips": [
        (rows_of(**{"train/skipped_minibatches": [0, 0, 2, 0]}), 3),
        rows_of(**{"train/skipped_minibatches": [0] * 6})],
    "flat_groups": [
        (rows_of(**{"reward/zero_std_frac": [0.25, 0.75, 1.0]}), 3),  # mean 0.67 > 0.5
        rows_of(**{"reward/zero_std_frac": [1.0, 0.25, 0.25, 0.5, 0.5]})],  # never a mean > 0.5
}


@pytest.fixture(scope="module")
def rules():
    return load_rules(HealthConfig())


def test_every_builtin_rule_is_registered_and_declares_itself(rules):
    assert BUILTIN <= set(rules) and set(CASES) == BUILTIN
    for name in BUILTIN:
        spec = registry.resolve("health", name)
        rule = rules[name]
        assert spec.builtin and rule.name == name
        assert rule.reads and rule.panel and rule.remedy and "." in rule.remedy  # names config keys


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_rule_fires_on_its_history_and_not_on_a_healthy_one(rules, name):
    *firing, healthy = CASES[name]
    for rows, step in firing:
        found = examine(rows, {name: rules[name]})
        assert [f.rule for f in found] == [name], rows
        assert found[0].steps[0] == step and found[0].seen.startswith(f"at step {step}: ")
    assert examine(healthy, {name: rules[name]}) == []


def test_rules_are_quiet_when_their_metrics_are_absent(rules):
    rows = rows_of(**{"perf/tokens_per_s": [100.0] * 30, "reward/score": [float("nan")] * 30})
    assert examine(rows, rules) == []


def test_tuned_parameters_change_the_verdict():
    rows = rows_of(**{"policy/clipfrac": [0.45] * 4})
    assert examine(rows, load_rules(HealthConfig())) == []
    tuned = load_rules(HealthConfig(rules={"clip_high": {"threshold": 0.4}}))
    assert [f.rule for f in examine(rows, tuned)] == ["clip_high"]


@pytest.mark.parametrize("values", [[1.0, 2.5, 2.0, 4.0], [3.0, -1.0], [0.1 * i * i for i in range(9)]])
def test_slope_is_the_least_squares_fit(values):
    assert math.isclose(slope(values), np.polyfit(np.arange(len(values)), values, 1)[0],
                        rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (["health.rules.nope.threshold=1"], "health.rules: unknown health rule 'nope'; installed: "),
    (["health.stop_on=[kl_explode]"], "health.stop_on: unknown health rule 'kl_explode'"),
    (["health.ignore=[nope]"], "health.ignore: unknown health rule 'nope'"),
    (["health.rules.clip_high.limit=0.4"],
     "unknown key health.rules.clip_high.limit; valid keys here: window, threshold"),
    (["health.rules.clip_high.threshold=1.5"], "health.rules.clip_high.threshold: must be in (0, 1)"),
    (["health.rules.clip_high.window=two"], "health.rules.clip_high.window: expected int, got str"),
    (["health.stop_on=[clip_high]", "health.ignore=[clip_high]"],
     "health.stop_on: clip_high is also in health.ignore"),
])
def test_bad_health_settings_are_one_line_errors(overrides, message):
    with pytest.raises(UserError) as err:
        load_config(TINY, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def cli(*args):
    """``rlpipe ARGS`` in-process (click's runner): the exit code and what it printed."""
    from click.testing import CliRunner

    from rlpipe.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines


def test_bad_health_setting_through_the_cli():
    result = cli("config", TINY, "health.rules.clip_high.threshold=0")
    one_line_error(result, "health.rules.clip_high.threshold: must be in (0, 1)")


def test_monitor_prints_once_and_logs_every_step_it_holds(rules):
    lines = []
    monitor = Monitor({"clip_high": rules["clip_high"]}, echo=lines.append)
    rows = rows_of(**{"policy/clipfrac": [0.6, 0.6, 0.6, 0.7, 0.1, 0.1, 0.1, 0.9, 0.9, 0.9]})
    for row in rows:
        monitor.observe(row)
    assert [r["step"] for r in rows if r.get("health/clip_high") == 1] == [3, 4, 9, 10]
    assert len(lines) == 1 and lines[0].startswith("health: clip_high at step 3: policy/clipfrac")
    assert "lower train.lr" in lines[0]


def test_monitor_memory_stays_flat_and_resumed_rules_stay_quiet(rules):
    from rlpipe.core.observe.health.monitor import HEAD, TAIL

    lines = []
    old = [{"step": 1, "policy/clipfrac": 0.9, "health/clip_high": 1}]
    monitor = Monitor(rules, rows=old, echo=lines.append)
    for step in range(2, 3000):
        monitor.observe({"step": step, "policy/clipfrac": 0.9, "policy/entropy": 1.0})
    assert len(monitor.rows) == HEAD + TAIL and monitor.rows[0]["step"] == 1
    assert lines == []  # clip_high fired before the resume


def tiny_config(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "collector.max_new_tokens=4",
                              "run.steps=3", *overrides])


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_live_line_appears_once_in_a_real_run(tmp_path, capsys):
    """The tiny model, four new tokens: nearly every response is cut, step after step."""
    run_dir = Pipeline(tiny_config(tmp_path, "health.rules.truncation.window=1"),
                       progress=False).train()
    err = capsys.readouterr().err
    rows = read_rows(run_dir)
    held = [r["step"] for r in rows if r.get("health/truncation") == 1]
    assert held and held == [r["step"] for r in rows if r["response/finished_frac"] < 0.5]
    lines = [line for line in err.splitlines() if line.startswith("health: truncation")]
    assert len(lines) == 1 and lines[0].startswith(f"health: truncation at step {held[0]}: ")
    assert "collector.max_new_tokens" in lines[0]


def test_stop_on_stops_after_an_intact_checkpoint_and_resumes(tmp_path, capsys):
    settings = ["health.rules.truncation.window=1", "run.steps=3"]
    pipe = Pipeline(tiny_config(tmp_path, *settings, "health.stop_on=[truncation]"), progress=False)
    run_dir = pipe.train()
    assert pipe.stopped_by == "truncation" and pipe.step_count == 1
    saved = checkpoint.latest(run_dir)
    assert saved.name == "step-000001" and checkpoint.verify(saved) is None
    assert not (run_dir / "final").exists() and [r["step"] for r in read_rows(run_dir)] == [1]
    assert "health: run stopped after step 1: truncation is in health.stop_on" in capsys.readouterr().err

    resumed = Pipeline(tiny_config(tmp_path, *settings), progress=False, resume=True)
    resumed.train()
    err = capsys.readouterr().err
    assert resumed.stopped_by is None and (run_dir / "final" / "config.json").is_file()
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]
    assert "health: truncation at step" not in err  # it fired before the stop, once


def test_doctor_on_an_earlier_quickstart_run():
    """The 16 steps of the quickstart's measured run of 2026-11-23 (kept in tests/data, before
    the value head's smaller init): the critic stays weak, and the length drift of steps 7-11
    shows; nothing else fires."""
    result = cli("doctor", ROOT / "tests" / "data" / "quickstart-2026-11-23")
    assert result.exit_code == 1, result.output
    fired = [line.split(":")[0].strip() for line in result.stdout.splitlines()
             if line.startswith("  ") and not line.startswith("    ")]
    assert fired == ["value_not_learning", "reward_hacking_length"], result.stdout
    assert "value_not_learning: steps 8-16 (value/explained_var" in result.stdout
    assert "at step 8: value/explained_var -0.298 (mean of steps 4-8) < 0" in result.stdout
    assert "reward_hacking_length: steps 10-11 " in result.stdout


def write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_doctor_exit_status(tmp_path):
    clean = write_run(tmp_path / "clean", rows_of(**{"policy/clipfrac": [0.1] * 5}))
    result = cli("doctor", clean)
    assert result.exit_code == 0 and "health: no rule fired" in result.stdout, result.output

    sick = write_run(tmp_path / "sick", rows_of(**{"policy/clipfrac": [0.1, 0.7, 0.8, 0.9, 0.1]}))
    result = cli("doctor", sick)
    assert result.exit_code == 1, result.output
    assert "clip_high: steps 3-5 (policy/clipfrac; panel clipfrac)" in result.stdout
    assert "at step 3: policy/clipfrac 0.533 (mean of steps 1-3) > 0.5" in result.stdout

    (sick / "config.yaml").write_text("health: {rules: {clip_high: {threshold: 0.95}}}\n")
    assert cli("doctor", sick).exit_code == 0  # the run's own tuned parameters


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "run directory not found"),
    (lambda p: p.mkdir(), "no metrics.jsonl in"),
    (lambda p: write_run(p, [{"step": 1}]) and (p / "config.yaml").write_text("health: {stop_on: [x]}"),
     "config.yaml: health.stop_on: unknown health rule 'x'"),
])
def test_doctor_on_a_bad_run_dir_is_one_line(tmp_path, setup, message):
    setup(tmp_path / "run")
    one_line_error(cli("doctor", tmp_path / "run"), message)


def test_report_summary_has_a_health_section(tmp_path):
    from rlpipe.tools.report import summary

    run = write_run(tmp_path / "run", rows_of(**{"reward/score": [0.0, 1.0],
                                                 "train/skipped_minibatches": [0, 3]}))
    text = summary(run)
    assert "health: 1 rule fired\n  nan_skips: steps 2 (train/skipped_minibatches" in text
    (run / "config.yaml").write_text("health: {ignore: [gone]}\n")  # a rule since uninstalled
    assert summary(run).endswith("health: not judged (" + str(run / "config.yaml") +
                                 ": health.ignore: unknown health rule 'gone'; installed: "
                                 + ", ".join(sorted(BUILTIN)) + ")")


THIRD_PARTY = '''
from dataclasses import dataclass

from rlpipe.core.observe.health import Rule, num


@dataclass
class ScoreDrop(Rule):
    """reward/score fell by more than `threshold` from one step to the next."""

    threshold: float = num(1.0, "> 0")
    reads = ("reward/score",)
    panel = "reward"
    remedy = "the score fell sharply: lower train.lr"

    def check(self, h):
        score = h.last("reward/score", 2)
        if len(score) == 2 and score[0] - score[1] > self.threshold:
            return f"reward/score {score[0]:.3g} -> {score[1]:.3g}"
        return None
'''


def test_third_party_rule_through_the_entry_point(tmp_path, monkeypatch):
    import subprocess
    import sys

    package = tmp_path / "pkg"
    (package / "acme_health").mkdir(parents=True)
    (package / "acme_health" / "__init__.py").write_text(THIRD_PARTY)
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "acme-health"\nversion = "0.2.0"\n'
        '[project.entry-points."rlpipe.health"]\nscore_drop = "acme_health:ScoreDrop"\n'
        '[tool.setuptools]\npackages = ["acme_health"]\n')
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *NO_ISOLATION, "--target",
                    str(site), str(package)], check=True, timeout=300)
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    monkeypatch.syspath_prepend(str(site))  # a new sys.path: the registry scans metadata again

    listed = cli("plugins")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in listed.stdout.splitlines()}
    assert rows[("health", "score_drop")] == ["acme-health", "0.2.0", "ok"], listed.stdout

    run = write_run(tmp_path / "run", rows_of(**{"reward/score": [2.0, 2.1, 0.5, 0.6]}))
    result = cli("doctor", run)
    assert result.exit_code == 1 and "score_drop: steps 3 (reward/score; panel reward)" in result.stdout
    assert "at step 3: reward/score 2.1 -> 0.5" in result.stdout
    (run / "config.yaml").write_text("health: {rules: {score_drop: {threshold: 2.0}}}\n")
    assert cli("doctor", run).exit_code == 0  # tuned like a built-in
    one_line_error(cli("config", TINY, "health.rules.score_drop.threshold=-1"),
                   "health.rules.score_drop.threshold: must be > 0")


def test_a_rule_of_the_wrong_shape_is_refused():
    class NotARule:
        def check(self, h):
            return None

    assert "dataclass subclassing" in registry._CHECKS["health"](NotARule)
    assert registry._CHECKS["health"](type(load_rules(HealthConfig())["clip_high"])) is None


def test_history_reads_only_the_window():
    rows = rows_of(**{"a": [1.0, None, 3.0, float("inf"), 5.0]})
    h = History(rows, end=4)
    assert h.step == 4 and h.last("a", 3) == [3.0] and h.first("a", 2) == [1.0, 3.0]
