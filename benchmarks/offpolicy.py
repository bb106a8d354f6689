"""Wall time per PPO step at ``rollout.staleness: 1`` against 0 on the tiny example (HF generate,
CPU), the phase times, and the speed-up that overlapping generation with the update can give.

    python benchmarks/offpolicy.py [--reps 6] [--threads N] [--phases G,S,U]
    VLLM_CPU_OMP_THREADS_BIND=1 python benchmarks/offpolicy.py --config \
        examples/arithmetic/config.yaml --set collector.name=vllm --set collector.kv_cache_gb=1 \
        --variants sync,ahead --threads 1      # vLLM's engine process on core 1, the trainer on 1
    python benchmarks/offpolicy.py --device cuda --size qwen2.5-0.5b --dtype bfloat16 \
        --batch 16 --new-tokens 128                     # a GPU: HF generate beside the update

Three pipelines from the tiny example's config, or ``--config`` with ``--set`` overrides
(``rollout_correction.mode: tis`` in all),
stepped in turn, rotating which goes first, after one warm-up step each:

- ``sync``: staleness 0, today's loop (collect, score, update, sync);
- ``ahead``: staleness 1 with the config's collector: with ``hf`` the next batch is sampled at
  once, on the main thread (the engine is the actor), so nothing overlaps; with ``vllm`` it is
  sampled in a thread that waits on the engine's own process while the update runs;
- ``thread``: staleness 1 with ``hf`` sampling from its own copy of the actor (synced once per
  step) in a thread while the main thread scores and updates: what a thread can overlap when both
  compete for the same CPU cores (``--threads 1``: one torch thread each, so that on 2 cores
  each can have one); ``hf`` only.

The model: where generation (g) and the trainer's work (scoring s + update u) run on separate
resources, a step takes max(g, s + u) instead of g + s + u; ``(g + u) / max(g, u)`` is the bound
verl and AReaL quote. ``--phases G,S,U`` evaluates it for other measured phase times.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import statistics
import time
from pathlib import Path

import torch

from common import (ROOT, default_json, machine, make_assets, make_config, print_header, sync,
                    workdir, write_json)
from rlpipe.core.config.settings import load_config
from rlpipe.core.contracts.collector import close_collector
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.plugins.collectors.hf import HFCollector

TINY = ROOT / "examples" / "tiny" / "config.yaml"
THREADS = [torch.get_num_threads()]   # --threads: intra-op threads of each calling thread
PHASES = ("time/rollout_s", "time/score_s", "time/update_s", "time/rollout_wait_s")


class SnapshotHF(HFCollector):
    """``hf`` on its own copy of the actor, which only `sync_weights` changes: it can sample
    while the actor trains, so it declares ``overlaps_update``."""

    @classmethod
    def contract(cls, **args):
        return dataclasses.replace(super().contract(**args), overlaps_update=True)

    @functools.wraps(HFCollector.__init__)
    def __init__(self, ctx, **args):
        super().__init__(ctx, **args)
        self.model = copy.deepcopy(ctx.actor)

    def sync_weights(self, model):
        self.model.load_state_dict(model.state_dict())

    def collect(self, prompts):
        torch.set_num_threads(THREADS[0])   # torch's thread count is per calling thread
        return super().collect(prompts)


def model(g: float, s: float, u: float) -> dict:
    """Step time sequential vs overlapped, for generation g, scoring s, update u (seconds)."""
    return {"sequential_s": g + s + u, "overlapped_s": max(g, s + u),
            "speedup": (g + s + u) / max(g, s + u), "speedup_g_u": (g + u) / max(g, u)}


def build(base, folder: Path, variant: str, extra: list[str]) -> Pipeline:
    """The pipeline of ``variant`` from the config ``base`` with the ``extra`` overrides."""
    overrides = [*extra, f"run.output_dir={folder / variant}", "run.steps=1000",
                 "rollout_correction.mode=tis", "log.progress=false", "health.enabled=false",
                 f"rollout.staleness={int(variant != 'sync')}"]
    stages = {}
    if variant == "thread":
        stages["collector"] = functools.partial(SnapshotHF, **base.collector.args)
    return Pipeline(load_config(base, overrides), overwrite=True, progress=False, **stages)


def base_config(args, folder: Path):
    """The tiny example, or with ``--size`` a random-init model of that size (common.py)."""
    if args.size is None:
        return load_config(args.config, [f"run.device={args.device}"])
    make_assets(folder, args.size)
    return make_config(folder, batch=args.batch, new_tokens=args.new_tokens, device=args.device,
                       dtype=args.dtype, epochs=args.epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--phases", default=None, help="G,S,U: evaluate the model only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per thread")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default=None, help="a common.py model size (default: tiny)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--config", default=str(TINY), help="a config (default: the tiny example)")
    parser.add_argument("--set", action="append", default=[], help="an override, KEY=VALUE")
    parser.add_argument("--variants", default="sync,ahead,thread", help="which to run, of these")
    args = parser.parse_args()
    if args.threads:
        THREADS[0] = args.threads
        torch.set_num_threads(args.threads)
    if args.phases:
        print(model(*map(float, args.phases.split(","))))
        return
    variants = args.variants.split(",")
    if variants[0] != "sync" or not set(variants) <= {"sync", "ahead", "thread"}:
        parser.error("--variants: sync first (the baseline), then any of ahead, thread")
    folder = workdir()
    base = base_config(args, folder)
    pipes = {v: build(base, folder, v, args.set) for v in variants}
    times = {f"{v}/{k}": [] for v in pipes for k in ("step_s", *PHASES)}
    load = [os.getloadavg()[0]]
    for rep in range(args.reps + 1):                        # rep 0 warms up
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for variant in order:
            sync(args.device)
            start = time.perf_counter()
            _, metrics = pipes[variant].step()
            sync(args.device)
            if rep:
                times[f"{variant}/step_s"].append(time.perf_counter() - start)
                for key in PHASES:
                    if key in metrics:
                        times[f"{variant}/{key}"].append(metrics[key])
        load.append(os.getloadavg()[0])
        print(f"rep {rep}: " + ", ".join(f"{v} {times[f'{v}/step_s'][-1]:.2f}s"
                                         for v in pipes if rep), flush=True)
    for pipe in pipes.values():
        if pipe.offpolicy is not None:
            pipe.offpolicy.close()
        close_collector(pipe.plugins.collector)   # stops a vLLM engine
    med = {k: statistics.median(v) for k, v in times.items() if v}
    g, s, u = (med[f"sync/{k}"] for k in PHASES[:3])
    result = {"median_s": med, "model": model(g, s, u),
              "measured_speedup": {v: med["sync/step_s"] / med[f"{v}/step_s"]
                                   for v in variants[1:]},
              "paired_speedup": {v: statistics.median(   # per rep: the runs side by side
                  a / b for a, b in zip(times["sync/step_s"], times[f"{v}/step_s"]))
                  for v in variants[1:]}}
    info = {**machine(args.device), "load_1min": load, "reps": args.reps, "size": args.size,
            "config": args.config, "overrides": args.set,
            "vllm_cpu_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "dtype": args.dtype, "batch": args.batch, "new_tokens": args.new_tokens}
    print_header(f"one-step off-policy rollouts: wall time per step, {args.config}", info)
    for k, v in med.items():
        print(f"{k:28s} {v:8.3f} s")
    for k, v in result["model"].items():
        print(f"{k:28s} {v:8.3f}")
    for kind in ("measured_speedup", "paired_speedup"):
        for k, v in result[kind].items():
            print(f"{kind} {k:13s} {v:8.3f}x")
    write_json(args.json or default_json("offpolicy", args.device),
               {"info": info, **result, "raw_s": times})


if __name__ == "__main__":
    main()
