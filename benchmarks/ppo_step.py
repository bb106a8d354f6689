"""One full PPO step of rlpipe against the same step written plainly (benchmarks/plain_ppo.py).

    python benchmarks/ppo_step.py [--reps 5]                                    # CPU, ~5M model
    python benchmarks/ppo_step.py --device cuda --size 300m --dtype bfloat16    # GPU, ~323M

Both start from the same random-init Llama weights (benchmarks/common.py: hidden 256, 4 layers,
vocab 4096 for ``small``) and run the same step: batch 16 prompts, 64 sampled tokens each
(temperature 1, full vocabulary; EOS masked until the budget, so every response has exactly
``--new-tokens`` tokens in both), log-probs of actor and reference, critic values, a length
reward, k1 KL in the reward, GAE (gamma 1, lambda 0.95, whitened), PPO with 4 epochs x 2
minibatches, AdamW on actor and critic. One warm-up step each, then ``--reps`` steps each,
alternating which goes first; the table holds medians. Memory is the peak during the step (RSS
on CPU via /proc VmHWM reset by clear_refs; ``torch.cuda.max_memory_allocated`` on GPU) and the
rise above what was resident before the step; both implementations' models live in this one
process, so compare the rises (memory.py gives per-configuration totals in fresh processes).
Update-phase FLOP/s count 6 * N * tokens, N = actor + critic parameters without the input
embeddings, tokens = prompt + response tokens x epochs; MFU divides by ``--peak-tflops``
(H100 dense bf16: 989).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics

import torch

from common import (LENGTH_REWARD, build_pipeline, default_json, machine, make_assets,
                    make_config, memory_mib, print_header, reset_peak, sync, workdir, write_json)
from plain_ppo import PlainPPO
from rlpipe.core.data.streams import load_prompts
from rlpipe.core.base.schema import PROMPT_MASK, RESPONSE_MASK

PHASES = ["time/rollout_s", "time/score_s", "time/update_s", "time/step_s"]


def flop_params(*modules) -> int:
    """Parameters that take part in matmuls: all but the input embedding tables."""
    total = 0
    for module in modules:
        embeds = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding)
                  for p in m.parameters()}
        total += sum(p.numel() for p in module.parameters() if id(p) not in embeds)
    return total


def rlpipe_step(pipe, device):
    sync(device)
    batch, m = pipe.step()
    tokens = int(batch[RESPONSE_MASK].sum())
    all_tokens = tokens + int(batch[PROMPT_MASK].sum())
    score = m["time/step_s"] - m["time/rollout_s"] - m["time/update_s"]
    return {"time/rollout_s": m["time/rollout_s"], "time/score_s": score,
            "time/update_s": m["time/update_s"], "time/step_s": m["time/step_s"],
            "tokens": tokens, "all_tokens": all_tokens, "reward/score": m["reward/score"]}


def plain_step(plain, prompts, device):
    m = plain.step(prompts, sync=lambda: sync(device))
    m["all_tokens"] = m["tokens"] + sum(len(plain.tokenizer(p).input_ids) for p in prompts)
    return m


def measure(name, fn, device):
    """Run one step under a fresh peak-memory window; add memory figures to its metrics."""
    reset_peak(device)
    before, _ = memory_mib(device)
    m = fn()
    _, peak = memory_mib(device)
    m.update({"mem/peak_mib": peak, "mem/rise_mib": peak - before, "load": os.getloadavg()[0]})
    return m


def table(samples, args, n_flop):
    med = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0] if k != "reward/score"}
           for name, runs in samples.items()}
    r, p = med["rlpipe"], med["plain"]
    for m in (r, p):
        m["perf/tokens_per_s"] = m["tokens"] / m["time/step_s"]
        m["update_tflops"] = 6 * n_flop * m["all_tokens"] * args.epochs / m["time/update_s"] / 1e12
        if args.device.startswith("cuda"):
            m["update_mfu"] = m["update_tflops"] / args.peak_tflops
    print(f"\n| {'median of ' + str(args.reps) + ' steps':<44} | {'rlpipe':>9} | {'plain':>9} "
          f"| rlpipe advantage |")
    print(f"|{'-' * 46}|----------:|----------:|-----------------:|")
    rows = [("rollout: generate (s)", "time/rollout_s"),
            ("scoring: log-probs, values, reward, GAE (s)", "time/score_s"),
            (f"update: {args.epochs} epochs x {args.minibatches} minibatches (s)", "time/update_s"),
            ("whole step (s)", "time/step_s")]
    for label, key in rows:  # lower is better: advantage = plain / rlpipe
        print(f"| {label:<44} | {r[key]:9.3f} | {p[key]:9.3f} | {p[key] / r[key]:15.2f}x |")
    mem = "peak GPU allocated" if args.device.startswith("cuda") else "peak RSS"
    for label, key in ((f"{mem} during the step (MiB)", "mem/peak_mib"),
                       ("rise above resident before the step (MiB)", "mem/rise_mib")):
        print(f"| {label:<44} | {r[key]:9.0f} | {p[key]:9.0f} | {'':>16} |")
    for label, key in (("response tokens / s, end to end", "perf/tokens_per_s"),
                       ("update phase TFLOP/s (6 N tokens)", "update_tflops")):
        print(f"| {label:<44} | {r[key]:9.4g} | {p[key]:9.4g} | {r[key] / p[key]:15.2f}x |")
    if args.device.startswith("cuda"):
        print(f"| {'update phase MFU':<44} | {r['update_mfu']:9.1%} | {p['update_mfu']:9.1%} | "
              f"{'':>16} |")
    speedup = r["perf/tokens_per_s"] / p["perf/tokens_per_s"]
    pairs = sorted(b["time/step_s"] / a["time/step_s"]
                   for a, b in zip(samples["rlpipe"], samples["plain"]))
    med["pair_ratios"] = pairs
    print(f"\nrlpipe / plain tokens/s: {speedup:.2f}x (per repetition {pairs[0]:.2f}x .. "
          f"{pairs[-1]:.2f}x; target >= 2x on CPU: {'met' if speedup >= 2 else 'NOT met'})")
    if args.device.startswith("cuda"):
        print(f"update-phase MFU {r['update_mfu']:.1%} (target >= 35%: "
              f"{'met' if r['update_mfu'] >= 0.35 else 'NOT met'})")
    return med, speedup


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default=None, help="small (CPU default) | medium | 300m (GPU)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (GPU default)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: see BENCHMARKS.md; 0: torch's default)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    if args.reps < 3:
        parser.error("--reps must be at least 3")
    args.size = args.size or ("300m" if cuda else "small")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine(args.device)
    print_header(f"PPO step: rlpipe vs plain transformers+torch loop, model {args.size} "
                 f"{args.dtype} on {args.device}, batch {args.batch} x {args.new_tokens} new tokens, "
                 f"{args.epochs} epochs x {args.minibatches} minibatches", info)
    load_before = os.getloadavg()

    folder = make_assets(workdir(), args.size)
    cfg = make_config(folder, batch=args.batch, new_tokens=args.new_tokens, device=args.device,
                      dtype=args.dtype, epochs=args.epochs, minibatches=args.minibatches)
    pipe = build_pipeline(cfg)
    plain = PlainPPO(str(folder / "model"), args.device, getattr(torch, args.dtype),
                     batch_size=args.batch, max_new_tokens=args.new_tokens, epochs=args.epochs,
                     minibatches=args.minibatches, reward=LENGTH_REWARD)
    plain.load_weights(pipe.models.actor.state_dict())
    n_flop = flop_params(pipe.models.actor, pipe.models.critic)
    n_params = sum(p.numel() for p in pipe.models.actor.parameters())
    print(f"actor parameters: {n_params / 1e6:.2f}M; actor + critic in matmuls: {n_flop / 1e6:.2f}M")
    prompts = itertools.cycle(load_prompts(cfg.data.prompts))  # rlpipe's order (no shuffle)
    run = {"rlpipe": lambda: rlpipe_step(pipe, args.device),
           "plain": lambda: plain_step(plain, [next(prompts) for _ in range(args.batch)],
                                       args.device)}

    for name in run:  # warm-up (allocator, kernels, lazy imports)
        m = run[name]()
        print(f"warm-up {name}: {m['time/step_s']:.2f} s, {m['tokens']} response tokens")
    samples = {name: [] for name in run}
    for rep in range(args.reps):
        for name in (["rlpipe", "plain"] if rep % 2 == 0 else ["plain", "rlpipe"]):
            m = measure(name, run[name], args.device)
            samples[name].append(m)
            print(f"rep {rep + 1} {name:<6}: step {m['time/step_s']:6.2f} s (rollout "
                  f"{m['time/rollout_s']:.2f}, scoring {m['time/score_s']:.2f}, update "
                  f"{m['time/update_s']:.2f}), {m['tokens']} tokens, load {m['load']:.2f}")
    counts = {s["tokens"] for runs in samples.values() for s in runs}
    if len(counts) != 1:
        print(f"WARNING: response token counts differ between steps: {sorted(counts)}")
    load_after = os.getloadavg()
    med, speedup = table(samples, args, n_flop)
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*load_after))
    write_json(default_json("ppo_step", args.device) if args.json is None else args.json, {
        "machine": info, "load_before": load_before, "load_after": load_after,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "actor_params": n_params, "flop_params": n_flop, "median": med,
        "speedup_tokens_per_s": speedup, "samples": samples,
        "target_met": {"cpu_2x": speedup >= 2,
                       **({"update_mfu_35": med["rlpipe"]["update_mfu"] >= 0.35} if cuda else {})}})


if __name__ == "__main__":
    main()
