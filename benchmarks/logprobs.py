"""Token log-probs over a 151,936-entry vocabulary, forward and backward, side by side with what
users would otherwise run.

    python benchmarks/logprobs.py                       # CPU: 1 x 512 positions, ~1 min
    python benchmarks/logprobs.py --device cuda         # GPU: the update's micro-batch, 16 x 523

Each variant computes the log-prob of the sampled token at every position and the entropy as a
metric (no gradient), as the PPO update does, then backward from the log-probs. bf16 logits
(the actor's LM head in bf16), float32 log-probs:

- ``log_softmax``: ``log_softmax(logits.float()).gather(...)`` through autograd, the entropy
  from the same tensor: the textbook line (TRL's PPOTrainer, OpenRLHF without flash-attn);
- ``row_loop``: TRL's ``selective_log_softmax`` formulation for bf16 logits, one row at a time,
  ``log_softmax(row).gather(...)``, autograd; the entropy row by row under ``no_grad``;
- ``rlpipe``: `rlpipe.core.base.ops.token_logprobs`, chunked, its own backward;
- ``rlpipe_compiled``: the same with ``compiled=True`` (``models.compile_logprobs``).

Variants alternate, ``--reps`` rounds; the median per variant, and peak memory on CUDA (the
first call of each is its warm-up, compilation included, and is reported apart).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import machine, memory_mib, now, print_header, reset_peak, sync, write_json
from rlpipe.core.base.ops import token_logprobs

VOCAB = 151_936


def log_softmax(logits, ids):
    lsm = torch.log_softmax(logits.float(), -1)
    with torch.no_grad():
        entropy = -(lsm.exp() * lsm).sum(-1)
    return lsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1), entropy


def row_loop(logits, ids):
    logp, entropy = [], []
    for row, row_ids in zip(logits, ids):
        lsm = torch.log_softmax(row.float(), -1)
        logp.append(lsm.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1))
        with torch.no_grad():
            entropy.append(-(lsm.exp() * lsm).sum(-1))
    return torch.stack(logp), torch.stack(entropy)


VARIANTS = {
    "log_softmax": log_softmax,
    "row_loop": row_loop,
    "rlpipe": lambda x, ids: token_logprobs(x, ids, 0, with_entropy=True),
    "rlpipe_compiled": lambda x, ids: token_logprobs(x, ids, 0, with_entropy=True, compiled=True),
}


def one_pass(fn, logits, ids, device) -> tuple[float, float]:
    """Seconds and peak MiB (CUDA; 0 on CPU) of forward + backward of ``fn``."""
    logits.grad = None
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    logp, _ = fn(logits, ids)
    logp.sum().backward()
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, memory_mib(device)[1] if device.startswith("cuda") else 0.0


def run(device: str, rows: int, positions: int, reps: int) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    logits = torch.randn(rows, positions, VOCAB, generator=gen, device=device,
                         dtype=torch.bfloat16).mul_(3).requires_grad_()
    ids = torch.randint(VOCAB, (rows, positions), generator=gen, device=device)
    out = {name: {"first_s": one_pass(fn, logits, ids, device)[0], "s": []}
           for name, fn in VARIANTS.items()}
    for _ in range(reps):
        for name, fn in VARIANTS.items():
            seconds, peak = one_pass(fn, logits, ids, device)
            out[name]["s"].append(seconds)
            out[name]["peak_mib"] = peak
    for row in out.values():
        row["median_s"] = statistics.median(row["s"])
    base = out["log_softmax"]["median_s"]
    for row in out.values():
        row["speedup_vs_log_softmax"] = base / row["median_s"]
    return {"rows": rows, "positions": positions, "vocab": VOCAB, "variants": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--positions", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    rows = args.rows or (16 if gpu else 1)
    positions = args.positions or (523 if gpu else 512)
    info = machine(args.device)
    print_header("token log-probs, forward + backward, bf16 logits", info)
    result = {"machine": info, "started": now(), "load_before": os.getloadavg(),
              **run(args.device, rows, positions, args.reps)}
    result["load_after"] = os.getloadavg()
    for name, row in result["variants"].items():
        peak = f", peak {row['peak_mib']:.0f} MiB" if gpu else ""
        print(f"{name:16s} {row['median_s']:.3f} s median ({row['speedup_vs_log_softmax']:.2f}x "
              f"log_softmax), first call {row['first_s']:.1f} s{peak}")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
