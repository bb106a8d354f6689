"""The tiny example is doctor-clean with margin, not by luck: seeds 0, 1 and 2 under each of
ATen's CPU kernel paths this CPU can run (``ATEN_CPU_CAPABILITY`` default, avx2, avx512) give
``rlpipe doctor`` exit 0, and every rule's statistic is at most `MARGIN` of its threshold.

A rule's statistic over its threshold is measured with the rule's own ``check``: the smallest
factor ``f`` by which the rule can be made stricter (`stricter`) and still stay quiet at every
step of the run. A rule that fires when a statistic rises above ``threshold`` is made ``f`` times
as strict with ``threshold * f``; one that fires when a statistic falls below a floor is made so
with the floor's reciprocal (``threshold / f``) or, for the explained-variance floor, with the
unexplained fraction ``1 - floor`` (``1 - f * (1 - floor)``: at ``f = 0.7`` the critic must explain
at least 30% of the returns' variance).

12 steps x 9 runs take about 90 s on a quiet 2-core CPU and several minutes on a shared one, so
`.ci/run` runs this file in its own tier (``RLPIPE_TINY_MARGINS=1``); the default run skips it.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlpipe.core.contracts.rule import History
from rlpipe.core.observe.health.monitor import HealthConfig, judge, load_rules
from rlpipe.core.observe.metrics import load_metrics

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
MARGIN = 0.7  # the target: each rule's statistic at most 70% of its threshold
# How each parameter of a built-in rule moves when the rule is made f times as strict: "x" a
# ceiling (threshold * f), "/" a floor on a ratio (threshold / f), "1-" the explained-variance
# floor (1 - f * (1 - threshold)). nan_skips fires on any skipped minibatch: nothing to scale.
SCALE = {
    "kl_explosion": {"threshold": "x", "rate": "x"},
    "kl_nonzero_at_start": {"threshold": "x"},
    "reward_hacking_length": {"threshold": "x", "drop": "x"},
    "reward_hacking_loop": {"threshold": "x"},
    "value_not_learning": {"threshold": "1-", "flat": "/"},
    "clip_high": {"threshold": "x"},
    "entropy_collapse": {"threshold": "/"},
    "grad_spikes": {"threshold": "x"},
    "truncation": {"threshold": "x"},
    "nan_skips": {},
    "flat_groups": {"threshold": "x"},
}
# ATen's kernel paths, lowest first, as torch.backends.cpu.get_cpu_capability() names them.
PATHS = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}


def stricter(rule, name: str, f: float):
    """``rule`` made ``f`` times as strict (``f`` < 1) by `SCALE`."""
    moves = {"x": lambda p: p * f, "/": lambda p: p / f, "1-": lambda p: 1 - f * (1 - p)}
    params = {k: moves[how](getattr(rule, k)) for k, how in SCALE[name].items()}
    return dataclasses.replace(rule, **params)


def quiet(rows: list[dict], rule) -> bool:
    """``rule`` fires at no step of ``rows`` (as ``rlpipe doctor`` judges it)."""
    return all(judge(rule, History(rows, end)) is None for end in range(1, len(rows) + 1))


def closeness(rows: list[dict], rule, name: str) -> float:
    """The rule's statistic over its threshold, at its closest step: the smallest ``f`` (to
    0.001, up to 2) at which `stricter` still keeps it quiet; 0 for a rule whose condition
    never began to hold.

    >>> rows = [{"step": s, "policy/clipfrac": c} for s, c in enumerate([0.1, 0.2, 0.3], 1)]
    >>> rule = load_rules(HealthConfig())["clip_high"]  # mean of 3 steps > 0.5
    >>> round(closeness(rows, rule, "clip_high"), 2)    # 0.2 / 0.5
    0.4
    """
    lo, hi = 0.0, 2.0
    if quiet(rows, stricter(rule, name, 1e-6)):
        return 0.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if quiet(rows, stricter(rule, name, mid)) else (mid, hi)
    return hi


def margins(run_dir: Path) -> dict[str, float]:
    """``{rule: closeness}`` for the built-in rules over ``run_dir``'s metrics (the tiny config
    has no ``health`` section: default parameters)."""
    rows, rules = load_metrics(run_dir), load_rules(HealthConfig())
    assert set(rules) >= set(SCALE), f"rules without a SCALE entry: {set(SCALE) - set(rules)}"
    return {name: closeness(rows, rules[name], name) for name in SCALE}


def runnable(path: str) -> str | None:
    """Why this CPU cannot run ATen's ``path`` kernels, or None: ATen falls back to the best path
    the CPU has, so a path above the native one is not run."""
    native, order = torch.backends.cpu.get_cpu_capability(), list(PATHS.values())
    if path == "default" or (native in order and order.index(PATHS[path]) <= order.index(native)):
        return None
    return f"this CPU's best kernel path is {native}, below {PATHS[path]}"


@pytest.mark.skipif(os.environ.get("RLPIPE_TINY_MARGINS") != "1",
                    reason="minutes on 2 cores: .ci/run's tiny-margins tier sets "
                           "RLPIPE_TINY_MARGINS=1")
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("path", list(PATHS))
def test_tiny_example_is_doctor_clean_with_margin(path, seed, tmp_path):
    if (why := runnable(path)) is not None:
        pytest.skip(why)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": path, "RLPIPE_DEVICE": "cpu"}
    check = subprocess.run([sys.executable, "-c", "import torch; print("
                            "torch.backends.cpu.get_cpu_capability())"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.stdout.strip() == PATHS[path], check.stdout + check.stderr  # the path took
    out = tmp_path / "run"
    cli = [sys.executable, "-m", "rlpipe.cli"]
    ran = subprocess.run([*cli, "run", str(CONFIG), f"run.output_dir={out}", f"run.seed={seed}",
                          "--no-progress"], env=env, capture_output=True, text=True,
                         timeout=900, stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    doctor = subprocess.run([*cli, "doctor", str(out)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    close = margins(out)
    name = max(close, key=close.get)
    assert close[name] <= MARGIN, f"{name} at {close[name]:.2f} of its threshold: {close}"
