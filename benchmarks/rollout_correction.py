"""Cost of ``rollout_correction.mode: bypass`` against the trainer's recompute (``none`` with
``old_log_prob: recompute``; its default, ``auto``, skips that forward too on this HF model), and of
the mismatch preflight, on the CPU benchmark model (benchmarks/common.py ``small``).

    python benchmarks/rollout_correction.py [--reps 3] [--batch 16] [--new-tokens 64] [--epochs 1]

Two pipelines from the same config and weights, one per mode; each rep times, alternating which
goes first: the scoring stage (`Pipeline._score_tokens` on one collected batch: actor + reference
+ critic forwards, or reference + critic under bypass), a whole PPO step, and the preflight
(`rlpipe.core.run.preflight.check`: one rollout + one actor forward). Medians; ratios are what to
read on a loaded machine (the load is recorded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import build_pipeline, default_json, machine, make_assets, make_config, print_header
from common import workdir, write_json
from rlpipe.core.run import preflight


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = make_assets(workdir(), "small")
    pipes = {}
    for mode in ("none", "bypass"):
        cfg = make_config(folder, batch=args.batch, new_tokens=args.new_tokens, epochs=args.epochs)
        cfg.rollout_correction.mode = mode
        cfg.rollout_correction.old_log_prob = "recompute"   # none: the trainer's actor forward
        cfg.run.output_dir = str(folder / f"run_{mode}")
        pipes[mode] = build_pipeline(cfg)
    times = {f"{m}/{k}": [] for m in pipes for k in ("score_s", "step_s")}
    times["preflight_s"] = []
    for rep in range(args.reps + 1):                       # rep 0 warms up
        order = list(pipes) if rep % 2 else list(reversed(pipes))
        for mode in order:
            pipe = pipes[mode]
            batch = pipe.plugins.collector.collect(pipe.prompts.next_batch()).to(pipe.device)
            score = timed(lambda: pipe._score_tokens(batch))
            step = timed(pipe.step)
            if rep:
                times[f"{mode}/score_s"].append(score)
                times[f"{mode}/step_s"].append(step)
        flight = timed(lambda: preflight.check(pipes["none"], echo=lambda line: None))
        if rep:
            times["preflight_s"].append(flight)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in times.items() if v),
              flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {"bypass_vs_recompute_score": med["bypass/score_s"] / med["none/score_s"],
              "bypass_vs_recompute_step": med["bypass/step_s"] / med["none/step_s"],
              "preflight_vs_step": med["preflight_s"] / med["none/step_s"]}
    info = {**machine(), "load": os.getloadavg(), "batch": args.batch,
            "new_tokens": args.new_tokens, "epochs": args.epochs, "reps": args.reps}
    print_header("rollout correction: bypass vs recompute, preflight", info)
    for k, v in med.items():
        print(f"{k:24s} {v:8.3f} s")
    for k, v in ratios.items():
        print(f"{k:24s} {v:8.3f}x")
    write_json(args.json or default_json("rollout_correction", "cpu"),
               {"info": info, "median_s": med, "ratios": ratios, "raw_s": times})


if __name__ == "__main__":
    main()
