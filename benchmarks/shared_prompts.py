"""What sharing prompt tokens saves in a GRPO run: `models.shared_prefix` off, sharing only the
prefix common to every row, and the default (each distinct prompt run once for its samples, its
own common prefix once), alternating in one process on the same config.

    python benchmarks/shared_prompts.py [--config examples/arithmetic/config.yaml] [--steps 3]
                                        [--rounds 1] [--out PATH]

An ablation of rlpipe against itself, not a peer comparison: "common prefix only" is the
previous release's sharing, reproduced by making every row its own prompt for
`rlpipe.core.prefix.distinct_prompts` (a patch in this script only). Prints the median step,
rollout, scoring and update seconds of each variant over its steps after the first, and the
reward and reference KL per step (equal to round-off until sampling parts the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from common import machine, print_header, workdir, write_json

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"whole": "false", "common prefix only": "true", "shared prompts": "true"}
PHASES = ("step", "rollout", "score", "update")


def each_row_its_own_prompt(prompt_ids, prompt_mask):
    rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
    return rows, rows


def run_variant(name: str, config: Path, steps: int, out: Path) -> dict:
    from rlpipe.core import prefix
    from rlpipe.core.config import load_config
    from rlpipe.core.pipeline import Pipeline

    real = prefix.distinct_prompts
    prefix.distinct_prompts = each_row_its_own_prompt if name == "common prefix only" else real
    try:
        cfg = load_config(config, [f"run.output_dir={out}", f"run.steps={steps}",
                                   "eval.prompts=null", f"models.shared_prefix={VARIANTS[name]}"])
        Pipeline(cfg, progress=False).train()
    finally:
        prefix.distinct_prompts = real
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "time/step_s" in r]
    return {**{p: [r[f"time/{p}_s"] for r in rows] for p in PHASES},
            "reward": [r["reward/score"] for r in rows], "kl": [r["kl/ref"] for r in rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "arithmetic" / "config.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "shared_prompts.json")
    args = p.parse_args()
    info = machine()
    print_header(f"shared prompt tokens, {args.config.name}, {args.rounds} round(s) x "
                 f"{args.steps} steps", info)
    work, results, load = workdir(), {name: [] for name in VARIANTS}, []
    for r in range(args.rounds):
        names = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in names:
            results[name].append(run_variant(name, args.config.resolve(), args.steps,
                                             work / f"{name.replace(' ', '_')}_{r}"))
            load.append(os.getloadavg()[0])
            print(f"round {r + 1}: {name} done (load {load[-1]:.2f})", flush=True)
    print(f"\n{'variant':<20}" + "".join(f"{p + ' s':>11}" for p in PHASES) + "  speed/whole")
    medians = {name: {p: statistics.median(x for run in runs for x in run[p][1:]) for p in PHASES}
               for name, runs in results.items()}
    for name, m in medians.items():
        print(f"{name:<20}" + "".join(f"{m[p]:>11.2f}" for p in PHASES)
              + f"  {medians['whole']['step'] / m['step']:>10.2f}x")
    for name, runs in results.items():
        print(f"{name:<20} reward/step " + " ".join(f"{x:+.4f}" for x in runs[0]["reward"])
              + "   KL/step " + " ".join(f"{x:.4f}" for x in runs[0]["kl"]))
    write_json(args.out, {"machine": info, "load_after_each": load, "args": {
        k: str(v) for k, v in vars(args).items()}, "medians": medians, "results": results})


if __name__ == "__main__":
    main()
