"""Where a PPO step of the vs_trl.py workload spends its time: torch.profiler over one step.

    python benchmarks/profile_ppo.py --model smollm2 [--rows 25] [--rlpipe-override KEY=VALUE]

Builds the same models and rlpipe config as vs_trl.py, runs one warm-up step, then profiles one
step and prints the operators with the most self CPU time, overall and inside the update
(stage 7) and the scoring passes (stage 2). The table is what a speed-up should start from.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import vs_trl
from common import workdir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--rlpipe-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--trace", default=None, help="also write Chrome traces PREFIX.{update,scoring}.json")
    args = p.parse_args()
    bench = vs_trl.parse_args(["--model", args.model])
    torch.set_num_threads(bench.threads)
    from rlpipe import load_config
    from rlpipe.core.run.pipeline import Pipeline

    policy, rm = vs_trl.make_models(bench.cache.expanduser() / args.model, args.model)
    work = workdir()
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(vs_trl.PROMPTS.read_text().splitlines()[:bench.batch]) + "\n")
    path = vs_trl.rlpipe_config(work, policy, rm, prompts, bench)
    os.chdir(work)
    pipe = Pipeline(load_config(path, args.rlpipe_override), overwrite=True, progress=False)
    pipe.step()  # warm-up
    tables = {}

    def profiled(fn, label):
        def run(*a, **k):
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                out = fn(*a, **k)
            tables[label] = (time.perf_counter() - t0, prof)
            return out
        return run

    pipe.updater.update = profiled(pipe.updater.update, "update (stage 7)")
    pipe._score_tokens = profiled(pipe._score_tokens, "scoring passes (stage 2)")
    _, metrics = pipe.step()
    print(f"profiled step: {metrics['time/step_s']:.2f} s, load {os.getloadavg()[0]:.2f}")
    for label, (seconds, prof) in tables.items():
        print(f"\n== {label}: {seconds:.2f} s under the profiler")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=args.rows // 2))
        if args.trace:
            prof.export_chrome_trace(f"{args.trace}.{label.split()[0]}.json")

if __name__ == "__main__":
    main()
