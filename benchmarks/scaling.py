"""How rlpipe's PPO step time grows with the work: response length and batch size.

    python benchmarks/scaling.py [--reps 3] [--lengths 64 128 256 512] [--batches 4 8 16 32]

The step of benchmarks/ppo_step.py (same small random-init Llama, length reward, GAE, 4 epochs x
2 minibatches, every response exactly its token budget) at response lengths ``--lengths`` (batch
16) and batch sizes ``--batches`` (64 tokens). One pipeline per setting, built up front; one
warm-up step of the first, then ``--reps`` rounds in which every setting runs one step, the
order rotating each round (a setting's first step also allocates its AdamW states; the median
drops it when it is the slowest). The tables hold medians, the time per response token, and that time
relative to the batch 16 x 64 tokens step: flat means cost linear in the work, rising means
worse than linear (attention and the KV cache grow with length), falling means fixed per-step
overheads being amortised.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from common import (build_pipeline, default_json, machine, make_assets, make_config,
                    print_header, sync, workdir, write_json)
from rlpipe.core.base.schema import RESPONSE_MASK

BASE = (16, 64)   # (batch, new tokens) shared by both sweeps


def run_step(pipe, device) -> dict:
    sync(device)
    batch, m = pipe.step()
    return {"step": m["time/step_s"], "rollout": m["time/rollout_s"],
            "update": m["time/update_s"],
            "score": m["time/step_s"] - m["time/rollout_s"] - m["time/update_s"],
            "tokens": int(batch[RESPONSE_MASK].sum()), "load": os.getloadavg()[0]}


def print_table(title, settings, med, base_per_token):
    print(f"\n{title}")
    print("| batch | new tokens | response tokens | step s | rollout s | scoring s | update s "
          "| ms / token | per token vs 16x64 |")
    print("|------:|-----------:|----------------:|-------:|----------:|----------:|---------:"
          "|-----------:|-------------------:|")
    for key in settings:
        m = med[key]
        per_token = m["step"] / m["tokens"] * 1e3
        relative = f"{per_token / base_per_token:18.2f}" if base_per_token else f"{'-':>18}"
        print(f"| {key[0]:5d} | {key[1]:10d} | {m['tokens']:15.0f} | {m['step']:6.2f} | "
              f"{m['rollout']:9.2f} | {m['score']:9.2f} | {m['update']:8.2f} | {per_token:10.2f} "
              f"| {relative} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="small")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (GPU)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: see BENCHMARKS.md; 0: torch's default)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine(args.device)
    print_header(f"rlpipe PPO step scaling, model {args.size} {args.dtype} on {args.device}, "
                 f"{args.reps} reps", info)
    load_before = os.getloadavg()

    folder = make_assets(workdir(), args.size)
    by_length = [(BASE[0], n) for n in args.lengths]
    by_batch = [(b, BASE[1]) for b in args.batches]
    settings = list(dict.fromkeys(by_length + by_batch))
    pipes = {}
    for batch, new_tokens in settings:
        cfg = make_config(folder, batch=batch, new_tokens=new_tokens, device=args.device,
                          dtype=args.dtype)
        pipes[(batch, new_tokens)] = build_pipeline(cfg)
    run_step(pipes[settings[0]], args.device)  # warm-up of the process (imports, allocator)
    samples = {key: [] for key in settings}
    for rep in range(args.reps):
        order = settings[rep % len(settings):] + settings[:rep % len(settings)]
        for key in order:
            m = run_step(pipes[key], args.device)
            samples[key].append(m)
            print(f"rep {rep + 1} batch {key[0]:3d} x {key[1]:4d} tokens: step {m['step']:6.2f} s "
                  f"(rollout {m['rollout']:.2f}, scoring {m['score']:.2f}, update "
                  f"{m['update']:.2f}), load {m['load']:.2f}")
    load_after = os.getloadavg()
    med = {key: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
           for key, runs in samples.items()}
    base_per_token = med[BASE]["step"] / med[BASE]["tokens"] * 1e3 if BASE in med else None
    print_table(f"response length (batch {BASE[0]})", by_length, med, base_per_token)
    print_table(f"batch size ({BASE[1]} new tokens)", by_batch, med, base_per_token)
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*load_after))
    key_name = lambda key: f"{key[0]}x{key[1]}"  # noqa: E731
    write_json(default_json("scaling", args.device) if args.json is None else args.json, {
        "machine": info, "load_before": load_before, "load_after": load_after,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "median": {key_name(k): v for k, v in med.items()},
        "samples": {key_name(k): v for k, v in samples.items()}})


if __name__ == "__main__":
    main()
