"""What the health checks cost per PPO step.

1. The live monitor alone: every built-in rule judged after each step of a long synthetic run
   (realistic metric rows, 30 metrics each), per-step time over the first and the last 1000
   steps (it must not grow with the run), and `rlpipe doctor`'s replay of the whole history.
2. Whole runs: the tiny example, alternating runs with ``health.enabled`` true and false (the
   order flipping every pair), mean ``time/step_s`` of each run after its first step; the ratio.

    python benchmarks/health.py          # writes benchmarks/results/health.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, TINY, machine, now, write_json  # noqa: E402

from rlpipe.core.config.settings import HealthConfig, load_config  # noqa: E402
from rlpipe.core.observe.health import Monitor, load_rules  # noqa: E402
from rlpipe.core.run.pipeline import train  # noqa: E402
from rlpipe.tools.doctor import examine  # noqa: E402


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` metric rows like a healthy run's: noise around plausible levels."""
    rng = random.Random(seed)
    level = {"reward/score": 0.0, "reward/reward_model": 0.0, "reward/length": 0.0,
             "reward/loop": 0.0, "kl/ref": 2.0, "response/length": 30.0, "value/loss": 0.5,
             "value/explained_var": 0.3, "policy/entropy": 2.0, "train/grad_norm": 1.0,
             "train/critic_grad_norm": 2.0}
    rows = []
    for step in range(1, n + 1):
        noisy = {k: v + rng.gauss(0, 0.05) * (abs(v) + 0.1) for k, v in level.items()}
        row = {"step": step, **noisy, "kl/coef": 0.05, "policy/clipfrac": rng.uniform(0.05, 0.2),
               "policy/approx_kl": rng.uniform(0, 0.02), "policy/loss": rng.gauss(0, 0.1),
               "response/finished_frac": rng.uniform(0.8, 1.0), "train/skipped_minibatches": 0}
        row["kl/ref"] = row["kl/ref"] if step > 1 else 0.0  # actor == reference at step 1
        row.update({f"extra/m{i}": rng.random() for i in range(30 - len(row))})
        rows.append(row)
    return rows


def time_monitor(n: int) -> dict:
    rules = load_rules(HealthConfig())
    rows = synthetic_rows(n)
    monitor = Monitor(rules, echo=None)
    per_step = []
    for row in rows:
        t0 = time.perf_counter_ns()
        monitor.observe(dict(row))
        per_step.append((time.perf_counter_ns() - t0) / 1e3)
    t0 = time.perf_counter()
    findings = examine(rows, rules)
    replay = time.perf_counter() - t0
    return {"steps": n, "rules": len(rules),
            "us_per_step_median": statistics.median(per_step),
            "us_first_1000_median": statistics.median(per_step[:1000]),
            "us_last_1000_median": statistics.median(per_step[-1000:]),
            "us_per_step_mean": statistics.fmean(per_step),
            "us_p99": sorted(per_step)[int(0.99 * n)],
            "doctor_replay_s": replay, "fired_on_healthy_history": [f.rule for f in findings]}


def time_runs(pairs: int, steps: int) -> dict:
    """Alternating tiny runs with the checks on and off; mean step time after the first step."""
    out: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(pairs):
        for enabled in ([True, False] if i % 2 == 0 else [False, True]):
            folder = Path(tempfile.mkdtemp()) / "run"
            cfg = load_config(TINY / "config.yaml", [f"run.output_dir={folder}", f"run.steps={steps}",
                                                     f"health.enabled={str(enabled).lower()}",
                                                     "log.progress=false"])
            run_dir = train(cfg, progress=False)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            out["on" if enabled else "off"].append(statistics.fmean(r["time/step_s"] for r in rows[1:]))
    ratios = [a / b for a, b in zip(out["on"], out["off"])]
    return {"pairs": pairs, "steps": steps, "step_s_on": out["on"], "step_s_off": out["off"],
            "ratio_on_off_per_pair": ratios, "ratio_median": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000, help="synthetic history length")
    parser.add_argument("--pairs", type=int, default=4, help="alternating tiny-run pairs")
    parser.add_argument("--run-steps", type=int, default=5, help="PPO steps per tiny run")
    parser.add_argument("--out", default=str(RESULTS / "health.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    print(f"health checks cost; {now()}; load average before: {load_before}")
    monitor = time_monitor(args.steps)
    print(f"monitor, {monitor['rules']} rules over {args.steps} synthetic steps: "
          f"{monitor['us_per_step_median']:.1f} us median per step (first 1000: "
          f"{monitor['us_first_1000_median']:.1f} us, last 1000: {monitor['us_last_1000_median']:.1f} "
          f"us; mean {monitor['us_per_step_mean']:.1f} us, p99 {monitor['us_p99']:.1f} us); doctor "
          f"replay {monitor['doctor_replay_s']:.2f} s; "
          f"fired on the healthy history: {monitor['fired_on_healthy_history'] or 'none'}")
    runs = time_runs(args.pairs, args.run_steps)
    print(f"tiny runs, {args.pairs} alternating pairs of {args.run_steps} steps: step time on/off "
          f"ratios {[round(r, 3) for r in runs['ratio_on_off_per_pair']]}, median "
          f"{runs['ratio_median']:.3f}")
    load_after = os.getloadavg()
    print(f"load average after: {load_after}")
    write_json(args.out, {"machine": machine(), "load_before": load_before,
                          "load_after": load_after, "monitor": monitor, "runs": runs})


if __name__ == "__main__":
    main()
