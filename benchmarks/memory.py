"""Peak memory of one rlpipe PPO step: LoRA actor + adapter-disabled reference vs full
fine-tuning with full copies (a frozen reference copy and a full critic), same model.

    python benchmarks/memory.py [--reps 3] [--size medium]            # CPU: peak RSS
    python benchmarks/memory.py --device cuda --size 300m              # GPU: peak allocated

Each measurement runs in a fresh Python process (``--child``), the variants alternating, so no
allocator state carries over. A child builds the pipeline (a Llama-style model with random
weights that the parent saved once, benchmarks/common.py), runs two PPO steps (batch 16 x 64
tokens, every response full length, 1 epoch x 2 minibatches: the optimizer states exist after
the first minibatch, more epochs add time, not memory) and reports, in MiB:

- ``baseline``: resident after importing torch/transformers/rlpipe (CPU) or 0 (GPU);
- ``models``: the rise from building actor, reference and critic;
- ``first_peak``: the peak over building and the first step (on CPU this also counts library
  code paged in on first use, ~0.5 GiB here, the same for every variant);
- ``peak``: the peak during the second step (VmHWM reset by clear_refs before it, or
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``): models, optimizer
  states, and the step's transient memory (rollout, activations, gradients) -- the headline;
- ``step``: that peak minus what was resident just before the second step.

Variants: ``full`` (actor, frozen reference copy, critic = a copy of the actor's backbone + value
head, all parameters trained with AdamW); ``full+ckpt`` (the same with activation checkpointing
of actor and critic); ``lora`` (``models.actor.lora = {r: 8, alpha: 16}``: the reference is the
actor with its adapters disabled; the critic is a full copy of the base backbone + head, fully
trained, as with ``full``); ``lora+shared`` (also ``models.critic.shared_backbone: true``: the
value head sits on the actor's own backbone, no second copy). With ``--variants``, also
``full+savers`` (``full+ckpt`` plus ``models.reference.offload``: the frozen reference waits on
CPU), ``lora+shared+ckpt`` and ``full+all`` (every saver a full-parameter actor can have:
checkpointing, the critic on the actor's backbone, the reference offloaded). ``full`` is always
measured: the table is relative to it. The table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CKPT = {"gradient_checkpointing": True}
VARIANTS = {"full": {}, "full+ckpt": {"actor": CKPT, "critic": CKPT}, "lora": {"lora": True},
            "lora+shared": {"lora": True, "critic": {"shared_backbone": True}},
            "full+savers": {"actor": CKPT, "critic": CKPT, "reference": {"offload": True}},
            "lora+shared+ckpt": {"lora": True, "actor": CKPT,
                                 "critic": {"shared_backbone": True}},
            "full+all": {"actor": CKPT, "critic": {"shared_backbone": True},
                         "reference": {"offload": True}}}


def child(args) -> None:
    """Measure one variant in this (fresh) process; print one JSON line."""
    import torch

    from common import build_pipeline, make_config, memory_mib, reset_peak

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    baseline = 0.0 if cuda else memory_mib()[0]
    # the parent's models, saved once (`assets`); the reward model is the fourth, offloaded to
    # CPU between uses with the savers
    rm = {"dtype": args.dtype, "offload": "savers" in args.child} if args.reward_model else None
    cfg = make_config(Path(args.assets), batch=args.batch, new_tokens=args.new_tokens,
                      device=args.device, dtype=args.dtype, epochs=1, minibatches=2, reward_model=rm,
                      init="pretrained", **VARIANTS[args.child])
    pipe = build_pipeline(cfg)
    resident, _ = memory_mib(args.device)
    start = time.perf_counter()
    pipe.step()  # first step: allocates the optimizer states, pages in library code
    seconds = time.perf_counter() - start
    _, first_peak = memory_mib(args.device)
    before, _ = memory_mib(args.device)
    reset_peak(args.device)
    batch, _ = pipe.step()
    _, peak = memory_mib(args.device)
    m = pipe.models
    modules = [m.actor, m.critic] + ([m.frozen_reference] if m.frozen_reference is not None else [])
    params = {id(p): p for mod in modules for p in mod.parameters()}
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)  # a shared backbone once
    opt_states = sum(t.numel() * t.element_size() for o in pipe.updater.opts.values()
                     for s in o.state.values() for t in s.values() if torch.is_tensor(t))
    print(json.dumps({
        "baseline": baseline, "models": resident - baseline, "first_peak": first_peak,
        "peak": peak, "step": peak - before, "step_s": seconds,
        "params_held": sum(p.numel() for p in params.values()), "trainable": trainable,
        "param_mib": sum(p.numel() * p.element_size() for p in params.values()) / 2**20,
        "optimizer_state_mib": opt_states / 2**20,
        "response_tokens": int(batch["response_mask"].sum())}))


def assets(args) -> Path:
    """The models every child loads: actor (random weights, saved) and reward model, built once
    here (each child building 1.5B-parameter models afresh took most of a GPU run's time)."""
    from common import make_assets, make_reward_model, workdir

    folder = make_assets(workdir(), args.size, weights=args.dtype)
    if args.reward_model:
        make_reward_model(folder, args.size, args.dtype)
    return folder


def run_child(args, variant: str, folder: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--device", args.device, "--size",
           args.size, "--dtype", args.dtype, "--batch", str(args.batch), "--new-tokens",
           str(args.new_tokens), "--threads", str(args.threads), "--assets", str(folder),
           *(["--reward-model"] if args.reward_model else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"child {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default=None,
                        help="medium (CPU default) | small | 300m | qwen2.5-0.5b | qwen2.5-1.5b "
                             "| qwen2.5-3b | qwen2.5-7b")
    parser.add_argument("--variants", default="full,full+ckpt,lora,lora+shared",
                        help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (GPU)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: see BENCHMARKS.md; 0: torch's default)")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--reward-model", action="store_true",
                        help="add a sequence-classification reward model of the same architecture "
                             "(offloaded in the *savers variants)")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--assets", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.size = args.size or ("300m" if cuda else "medium")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.child:
        return child(args)

    import torch

    from common import default_json, machine, print_header, write_json

    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    info = machine(args.device)
    info["torch_threads"] = args.threads or torch.get_num_threads()
    what = "peak GPU memory allocated" if cuda else "peak RSS"
    print_header(f"{what} of one PPO step, model {args.size} {args.dtype} on {args.device}, "
                 f"batch {args.batch} x {args.new_tokens} tokens, a fresh process each", info)
    load_before = os.getloadavg()
    chosen = ["full", *(v for v in args.variants.split(",") if v != "full")]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    samples = {v: [] for v in chosen}
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = assets(args)
    for rep in range(args.reps):
        names = list(chosen)
        for variant in names[rep % len(names):] + names[:rep % len(names)]:
            samples[variant].append(run_child(args, variant, folder))
            m = samples[variant][-1]
            print(f"rep {rep + 1} {variant:<12}: step peak {m['peak']:6.0f} MiB (first step "
                  f"{m['first_peak']:6.0f}), models {m['models']:5.0f}, step rise {m['step']:5.0f}, "
                  f"first step {m['step_s']:.1f} s, "
                  f"load {os.getloadavg()[0]:.2f}")
    load_after = os.getloadavg()
    med = {v: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
           for v, runs in samples.items()}
    full = med["full"]
    print(f"\n| variant (median of {args.reps}) | params held | trainable | weights MiB | "
          f"AdamW state MiB | baseline MiB | models MiB | first-step peak MiB | step rise MiB "
          f"| step peak MiB | peak vs full |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v, m in med.items():
        print(f"| {v} | {m['params_held'] / 1e6:.1f}M | {m['trainable'] / 1e6:.2f}M | "
              f"{m['param_mib']:.0f} | {m['optimizer_state_mib']:.0f} | {m['baseline']:.0f} | "
              f"{m['models']:.0f} | {m['first_peak']:.0f} | {m['step']:.0f} | {m['peak']:.0f} | "
              f"{m['peak'] / full['peak']:.2f} |")
    base = full["baseline"]
    print("above the baseline: " + ", ".join(
        f"{v} {(m['peak'] - base) / (full['peak'] - base):.2f}x of full" for v, m in med.items()))
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*load_after))
    write_json(default_json("memory", args.device) if args.json is None else args.json, {
        "machine": info, "load_before": load_before, "load_after": load_after,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
        "median": med, "samples": samples})


if __name__ == "__main__":
    main()
