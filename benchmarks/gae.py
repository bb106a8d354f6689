"""Time GAE on a [256, 1024] float32 batch: rlpipe's `masked_gae` against a TRL-style Python
loop over T and TorchRL's vectorised and looped functionals.

    python benchmarks/gae.py [--device cpu|cuda] [--reps 21] [--threads N]

Responses are right-padded, lengths uniform in [256, 1024], gamma 1.0, lambda 0.95. Every
method starts from the same raw (reward, value, mask), masks them its own way and returns
(advantage, value target); TorchRL gets done = terminated = the last valid token. The methods
run interleaved, after two warm-up calls each; the table shows the median (and minimum) of
``--reps`` repetitions, each median divided by rlpipe's (``/ rlpipe``), and the largest
deviation of the advantage from a float64 plain-loop reference (TorchRL's looped GAE). The
machine and its load average before and after are printed and written with every sample to
``benchmarks/results/gae.json`` (``gae_cuda.json`` for ``--device cuda``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torchrl
from torchrl.objectives.value.functional import (generalized_advantage_estimate,
                                                 vec_generalized_advantage_estimate)

from common import default_json, machine, now, sync, write_json
from rlpipe.plugins.advantages.gae import masked_gae

BATCH, LENGTH, MIN_LENGTH, GAMMA, LMBDA = 256, 1024, 256, 1.0, 0.95


def make_batch(device: str, dtype=torch.float32, seed: int = 0):
    """Random reward/value with garbage on padding and a right-padded mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(MIN_LENGTH, LENGTH + 1, (BATCH,), generator=gen)
    mask = torch.arange(LENGTH) < lengths.unsqueeze(-1)
    reward = torch.randn(BATCH, LENGTH, generator=gen, dtype=dtype)
    value = torch.randn(BATCH, LENGTH, generator=gen, dtype=dtype)
    return reward.to(device), value.to(device), mask.to(device)


def trl_loop(reward, value, mask):
    """TRL's PPO trainer: mask, then a reversed Python loop over T with list append + stack."""
    value, reward = value.masked_fill(~mask, 0), reward.masked_fill(~mask, 0)
    lastgaelam, advantages_reversed, length = 0, [], reward.shape[1]
    for t in reversed(range(length)):
        nextvalues = value[:, t + 1] if t < length - 1 else 0.0
        delta = reward[:, t] + GAMMA * nextvalues - value[:, t]
        lastgaelam = delta + GAMMA * LMBDA * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + value


def torchrl_inputs(reward, value, mask):
    """[B, T, 1] value, next value, reward and done = terminated at the last valid token."""
    value = value.masked_fill(~mask, 0)
    next_value = torch.nn.functional.pad(value[:, 1:], (0, 1))
    last = mask.sum(-1, keepdim=True) - 1
    done = torch.arange(mask.shape[1], device=mask.device) == last
    return (value.unsqueeze(-1), next_value.unsqueeze(-1),
            reward.masked_fill(~mask, 0).unsqueeze(-1), done.unsqueeze(-1))


def torchrl_method(fn):
    def run(reward, value, mask):
        state, next_state, rew, done = torchrl_inputs(reward, value, mask)
        advantage, target = fn(GAMMA, LMBDA, state, next_state, rew, done=done, terminated=done)
        return advantage.squeeze(-1), target.squeeze(-1)
    return run


METHODS = {
    "rlpipe masked_gae": lambda r, v, m: masked_gae(r, v, m, GAMMA, LMBDA),
    "TRL-style Python loop": trl_loop,
    "TorchRL vec_generalized_advantage_estimate": torchrl_method(
        vec_generalized_advantage_estimate),
    "TorchRL generalized_advantage_estimate": torchrl_method(generalized_advantage_estimate),
}


def time_methods(inputs, reps: int, device: str) -> dict[str, list[float]]:
    """Milliseconds per call of each method after two warm-up calls each; the methods take
    turns, and the order rotates every repetition so that none always runs right after the
    Python loops (which leave the caches cold)."""
    for fn in METHODS.values():
        fn(*inputs), fn(*inputs)
    samples, names = {name: [] for name in METHODS}, list(METHODS)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            sync(device)
            start = time.perf_counter()
            METHODS[name](*inputs)
            sync(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def max_errors(inputs) -> dict[str, float]:
    """Largest |advantage - float64 reference| on valid tokens, per method."""
    reward, value, mask = inputs
    state, next_state, rew, done = torchrl_inputs(reward.double().cpu(), value.double().cpu(),
                                                  mask.cpu())
    reference = generalized_advantage_estimate(GAMMA, LMBDA, state, next_state, rew, done=done,
                                               terminated=done)[0].squeeze(-1)
    errors = {}
    for name, fn in METHODS.items():
        advantage = fn(*inputs)[0].double().cpu()
        errors[name] = (advantage - reference).abs()[mask.cpu()].max().item()
    return errors


def report(samples, errors, info, load_before, load_after) -> dict:
    medians = {name: statistics.median(ms) for name, ms in samples.items()}
    base = medians["rlpipe masked_gae"]
    print(f"GAE [{BATCH}, {LENGTH}] float32 on {info['device']}, gamma {GAMMA}, lambda {LMBDA}, "
          f"{len(next(iter(samples.values())))} reps")
    gpu = f", {info['gpu']}" if "gpu" in info else ""
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
          f"torch {info['torch']}, torchrl {info['torchrl']}{gpu}; {now()}")
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*load_before))
    print(f"| {'method':<42} | median ms |   min ms | / rlpipe | max abs err |")
    print(f"|{'-' * 44}|----------:|---------:|---------:|------------:|")
    for name, ms in samples.items():
        print(f"| {name:<42} | {medians[name]:9.3f} | {min(ms):8.3f} | "
              f"{medians[name] / base:8.1f} | {errors[name]:11.2e} |")
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*load_after))
    loop = medians["TRL-style Python loop"] / base
    vec = medians["TorchRL vec_generalized_advantage_estimate"] / base
    print(f"target: >= 20x faster than the Python loop ({loop:.1f}x: "
          f"{'met' if loop >= 20 else 'NOT met'}), faster than TorchRL vec ({vec:.1f}x: "
          f"{'met' if vec > 1 else 'NOT met'})")
    return {"median_ms": medians, "min_ms": {n: min(ms) for n, ms in samples.items()},
            "ratio_vs_rlpipe": {n: m / base for n, m in medians.items()},
            "max_abs_err": errors, "samples_ms": samples,
            "target_met": {"loop_20x": loop >= 20, "faster_than_torchrl_vec": vec > 1}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be at least 5")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    if args.threads:
        torch.set_num_threads(args.threads)
    inputs = make_batch(args.device)
    info = {**machine(args.device), "torchrl": torchrl.__version__}
    load_before = os.getloadavg()
    samples = time_methods(inputs, args.reps, args.device)
    load_after = os.getloadavg()
    result = report(samples, max_errors(inputs), info, load_before, load_after)
    write_json(args.out or default_json("gae", args.device), {
        "shape": [BATCH, LENGTH], "min_length": MIN_LENGTH, "gamma": GAMMA, "lmbda": LMBDA,
        "machine": info, "load_before": load_before, "load_after": load_after, **result})


if __name__ == "__main__":
    main()
