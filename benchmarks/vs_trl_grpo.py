"""rlpipe against TRL 1.12's GRPOTrainer, side by side on one machine: a GRPO run with LoRA.

    python benchmarks/vs_trl_grpo.py                    # about 12 minutes
    python benchmarks/vs_trl_grpo.py --variant "no shared prompts=models.shared_prefix=false"

TRL runs in its own virtual environment, as for benchmarks/vs_trl.py, with peft added:

    python3 -m venv .venv-trl
    .venv-trl/bin/python -m pip install torch==2.13.0 trl==1.12.0 "transformers==5.23.*" peft==0.21.2 requests

The workload: the arithmetic example's task (examples/arithmetic/train.jsonl: chat-message word
problems, a numeric ``answer``) on SmolLM2-135M-Instruct with LoRA r 16, alpha 32 on every
linear layer; 8 prompts x 8 samples per iteration at temperature 1.0, exactly 24 new tokens
(EOS suppressed until then, on both sides); reward 1 when the last number of the completion is
the answer; group-normalised advantages; clipped policy loss (0.2), token mean over each of the
2 minibatches, one optimizer step each; KL to the reference (the actor with adapters disabled)
as k3 x 0.02 in the loss; AdamW lr 5e-4 constant, gradient clipping at 1.0; float32. TRL's
defaults that would break a fair float32 CPU comparison are overridden (bf16, gradient
checkpointing, LR decay); its loss is ``bnpo`` (token mean over the local batch), which is
rlpipe's token mean here. rlpipe takes the old log-probs from the sampling pass; TRL recomputes
them with a forward, as it does when a generation batch feeds several optimizer steps.

Both sides are fresh processes, started alternately (``--rounds``, order flipped every round),
one warm-up iteration and ``--iters`` timed ones each, the same ``--threads``. Reported: median
s/iter and phases (rollout; scoring: old log-probs, reference, rewards, advantages; update), the
speed ratio, peak RSS, reward and KL per iteration. What the speed buys in held-out accuracy
after the same training time: benchmarks/race_trl_grpo.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml

from common import ROOT, machine, print_header, workdir, write_json
from vs_trl import TRL_PYTHON, make_models, run_child, run_rlpipe, summary

DATA = ROOT / "examples" / "arithmetic" / "train.jsonl"


def rlpipe_config(folder: Path, policy: Path, args) -> Path:
    raw = {
        "run": {"steps": 1 + args.iters, "seed": 0, "output_dir": "run", "device": "cpu"},
        "models": {"actor": {"path": str(policy),
                             "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"}}},
        "data": {"prompts": str(DATA), "batch_size": args.prompts},
        "collector": {"name": "hf", "max_new_tokens": args.new_tokens,
                      "min_new_tokens": args.new_tokens, "temperature": 1.0, "top_k": 0,
                      "top_p": 1.0, "n": args.samples,
                      "micro_batch_size": args.prompts},
        "rewards": [{"name": "answer_match", "column": "answer"}],
        "advantage": {"name": "grpo"},
        "loss": {"name": "ppo", "clip_low": 0.2},
        "kl": {"coef": 0.02, "estimator": "k3", "in": "loss"},
        "train": {"epochs": 1, "minibatches": 2, "grad_accum": 1, "lr": 5e-4,
                  "schedule": "constant", "max_grad_norm": 1.0},
        "log": {"progress": False},
    }
    path = folder / "rlpipe_grpo.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_trl(folder: Path, policy: Path, args) -> dict:
    out = folder / "trl_grpo.json"
    wall, rss = run_child([str(args.trl_python), str(Path(__file__).parent / "vs_trl_grpo_worker.py"),
                           "--policy", str(policy), "--data", str(DATA),
                           "--iters", str(args.iters), "--prompts", str(args.prompts),
                           "--samples", str(args.samples), "--new-tokens", str(args.new_tokens),
                           "--threads", str(args.threads), "--out", str(out)],
                          args.threads, folder)
    data = json.loads(out.read_text())
    return {"iters": data["iters"], "rss_gib": rss, "wall_s": wall,
            "versions": {k: data[k] for k in ("trl", "transformers", "torch", "optimizer")}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=3, help="timed iterations per process")
    p.add_argument("--rounds", type=int, default=2, help="alternating processes per side")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                   help="an extra rlpipe run with these overrides (repeatable)")
    p.add_argument("--trl-python", type=Path, default=TRL_PYTHON)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/rlpipe/bench-vs-trl"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vs_trl_grpo.json")
    args = p.parse_args(argv)
    if not args.trl_python.exists():
        sys.exit(f"{args.trl_python} is missing; make it as the docstring of {__file__} says")
    torch.set_num_threads(args.threads)
    variants = {"rlpipe": []}
    for spec in args.variant:
        name, _, sets = spec.partition("=")
        variants[f"rlpipe {name}"] = [s for s in sets.split(",") if s]
    info = machine()
    print_header(f"rlpipe vs TRL GRPO, smollm2 + LoRA, {args.rounds} rounds x {args.iters} iters",
                 info)
    policy, _ = make_models(args.cache.expanduser() / "smollm2", "smollm2")
    work = workdir()
    config = rlpipe_config(work, policy, args)
    sides = ["trl", *variants]
    runs: dict[str, list] = {name: [] for name in sides}
    loads = [os.getloadavg()]
    for r in range(args.rounds):
        for name in (sides if r % 2 == 0 else sides[::-1]):
            t0 = time.perf_counter()
            runs[name].append(run_trl(work, policy, args) if name == "trl" else
                              run_rlpipe(work, config, variants[name], args))
            loads.append(os.getloadavg())
            print(f"round {r + 1}: {name} done in {time.perf_counter() - t0:.0f} s "
                  f"(load {loads[-1][0]:.2f})", flush=True)
    results = {name: {"runs": rs, "summary": summary(rs)} for name, rs in runs.items()}
    trl = results["trl"]["summary"]
    print(f"\n{'side':<28}{'s/iter':>8}{'rollout':>9}{'score':>8}{'update':>8}{'speed/TRL':>10}"
          f"{'RSS GiB':>9}")
    for name, res in results.items():
        s = res["summary"]
        print(f"{name:<28}{s['step_s']:8.2f}{s['rollout_s']:9.2f}{s['score_s']:8.2f}"
              f"{s['update_s']:8.2f}{trl['step_s'] / s['step_s']:10.2f}{s['rss_gib']:9.2f}")
    for name, res in results.items():
        print(f"{name:<28} reward/iter {' '.join(f'{x:+.3f}' for x in res['summary']['reward'][0])}"
              f"   KL/iter {' '.join(f'{x:.4f}' for x in res['summary']['kl'][0])}")
    write_json(args.out, {"machine": info, "load_avg": loads,
                          "args": {k: str(v) for k, v in vars(args).items()},
                          "rlpipe_overrides": variants, "results": results})


if __name__ == "__main__":
    main()
