"""An ablation of rlpipe against itself: the same config with one setting switched, variants
alternating in one process, median phase times over each variant's steps after the first.

    python benchmarks/ablation.py shared_prompts [--config examples/arithmetic/config.yaml]
    python benchmarks/ablation.py packing [--config examples/quickstart/config.yaml]
                                          [--steps 3] [--rounds 1] [--out PATH]

- ``shared_prompts``: what sharing prompt tokens saves in a GRPO run: `models.shared_prefix`
  off, sharing only the prefix common to every row ("common prefix only", the previous release's
  sharing, reproduced by making every row its own prompt for
  `rlpipe.core.models.prefix.distinct_prompts`: a patch in this script only), and the default (each
  distinct prompt run once for its samples, its own common prefix once).
- ``packing``: rows with their padding (`models.packed=false`) and without (the default), on the
  quickstart's PPO config, whose reward model ``python examples/quickstart/run.py`` trains
  first (into ``runs/quickstart/reward_model``).

Not a peer comparison. Prints the median step, rollout, scoring and update seconds of each
variant, the first variant's speed over each, and the reward and reference KL per step (equal
to round-off until sampling parts the runs).
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
EXAMPLES = ROOT / "examples"
# each ablation: its default config, then each variant's overrides
ABLATIONS = {
    "shared_prompts": (EXAMPLES / "arithmetic" / "config.yaml", {
        "whole": ["models.shared_prefix=false"],
        "common prefix only": ["models.shared_prefix=true"],
        "shared prompts": ["models.shared_prefix=true"]}),
    "packing": (EXAMPLES / "quickstart" / "config.yaml", {
        "padded": ["models.packed=false"], "packed": ["models.packed=true"]}),
}
PHASES = ("step", "rollout", "score", "update")


def each_row_its_own_prompt(prompt_ids, prompt_mask):
    rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
    return rows, rows


def run_variant(name: str, overrides: list, config: Path, steps: int, out: Path) -> dict:
    from rlpipe.core.models import prefix
    from rlpipe.core.config.settings import load_config
    from rlpipe.core.run.pipeline import Pipeline

    real = prefix.distinct_prompts
    prefix.distinct_prompts = each_row_its_own_prompt if name == "common prefix only" else real
    try:
        cfg = load_config(config, [f"run.output_dir={out}", f"run.steps={steps}",
                                   "eval.prompts=null", *overrides])
        Pipeline(cfg, progress=False).train()
    finally:
        prefix.distinct_prompts = real
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "time/step_s" in r]
    return {**{p: [r[f"time/{p}_s"] for r in rows] for p in PHASES},
            "reward": [r["reward/score"] for r in rows], "kl": [r["kl/ref"] for r in rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ablation", choices=list(ABLATIONS))
    p.add_argument("--config", type=Path, default=None, help="default: the ablation's own")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None,
                   help="default: benchmarks/results/ABLATION.json")
    args = p.parse_args()
    config, variants = ABLATIONS[args.ablation]
    config, out = (args.config or config).resolve(), (
        args.out or ROOT / "benchmarks" / "results" / f"{args.ablation}.json").resolve()
    info = machine()
    print_header(f"ablation {args.ablation}, {config.parent.name}/{config.name}, {args.rounds} "
                 f"round(s) x {args.steps} steps", info)
    work, results, load = workdir(), {name: [] for name in variants}, []
    first = next(iter(variants))
    for r in range(args.rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            results[name].append(run_variant(name, variants[name], config, args.steps,
                                             work / f"{name.replace(' ', '_')}_{r}"))
            load.append(os.getloadavg()[0])
            print(f"round {r + 1}: {name} done (load {load[-1]:.2f})", flush=True)
    print(f"\n{'variant':<20}" + "".join(f"{p + ' s':>11}" for p in PHASES) + f"  speed/{first}")
    medians = {name: {p: statistics.median(x for run in runs for x in run[p][1:]) for p in PHASES}
               for name, runs in results.items()}
    for name, m in medians.items():
        print(f"{name:<20}" + "".join(f"{m[p]:>11.2f}" for p in PHASES)
              + f"  {medians[first]['step'] / m['step']:>10.2f}x")
    for name, runs in results.items():
        print(f"{name:<20} reward/step " + " ".join(f"{x:+.4f}" for x in runs[0]["reward"])
              + "   KL/step " + " ".join(f"{x:.4f}" for x in runs[0]["kl"]))
    write_json(out, {"machine": info, "load_after_each": load, "args": {
        k: str(v) for k, v in vars(args).items()}, "medians": medians, "results": results})


if __name__ == "__main__":
    main()
