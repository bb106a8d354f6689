"""How close the vs_trl.py SmolLM2 workload's two hot loops are to this machine's matmul speed.

    python benchmarks/anatomy.py [--compile] [--json PATH]          # ~2 min (+1 min with --compile)

1. **Update**: one actor micro-step of the update (8 rows x 24 prompt + 33 response tokens,
   forward, `token_logprobs` at temperature 0.7, backward), timed whole, against the same
   matmuls replayed alone. The matmuls are recorded from the real pass (shapes and strides, with
   a `TorchDispatchMode`) and each is replayed on its own tensors; a replayed weight stays in
   cache, so "matmuls alone" is a floor, not a share.
2. **Decode**: one decoding step of the rollout (16 rows, cache of 44 tokens), timed whole, its
   linear layers alone (forward hooks), and the bytes of weights it must read against the
   machine's read bandwidth (a sum over a 540 MB tensor).
3. With ``--compile``: the same micro-step with the backbone under ``torch.compile`` (inductor),
   to see whether fusing the elementwise work pays on this CPU.

Float32, the machine's threads (2 on the CI VMs). Nothing is downloaded: the model is the
quickstart's SmolLM2-135M package, converted once by vs_trl.py's `make_models`.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vs_trl
from common import machine, print_header, write_json

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def median_time(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


class RecordMatmuls(TorchDispatchMode):
    """Counts each (op, operand shapes and strides) of the matmuls that run inside the block."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]
            self.calls[(func, tuple((tuple(x.shape), tuple(x.stride())) for x in operands))] += 1
        return func(*args, **(kwargs or {}))


def replay(calls) -> tuple[float, float]:
    """(seconds, FLOP) of the recorded matmuls, each timed alone on fresh operands."""
    seconds = flop = 0.0
    for (func, operands), count in calls.items():
        a, b = [torch.empty_strided(shape, stride).normal_() for shape, stride in operands]
        run = (lambda: torch.addmm(torch.zeros(b.shape[-1]), a, b)) if func == MATMULS[1] else \
            (lambda: torch.bmm(a, b) if a.dim() == 3 else torch.mm(a, b))
        seconds += count * median_time(run)
        flop += count * 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
    return seconds, flop


def update_step(model, prompt: int = 24, response: int = 33, rows: int = 8):
    from rlpipe.core.base.ops import token_logprobs

    ids = torch.randint(0, model.config.vocab_size, (rows, prompt + response),
                        generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[: rows // 3, : prompt // 6] = 0  # some left padding, as a rollout has

    def step():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False,
                       logits_to_keep=response + 1).logits
        logp, _ = token_logprobs(logits, ids[:, prompt:], 0, 0.7)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)
    return step


def decode_step(model, rows: int = 16, cached: int = 44):
    from transformers import DynamicCache

    cache = DynamicCache()
    mask = torch.ones(rows, cached + 1, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=torch.randint(0, model.config.vocab_size, (rows, cached)),
              attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = torch.randint(0, model.config.vocab_size, (rows, 1))
    position = torch.full((rows, 1), cached)

    @torch.no_grad()
    def step():
        model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
              use_cache=True)
        cache.crop(-1)
    return step


def linear_seconds(model, fn) -> float:
    """Seconds spent inside the model's nn.Linear modules during one ``fn()``."""
    spent = [0.0]
    starts = {}
    hooks = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(
                lambda m, a: starts.__setitem__(m, time.perf_counter())))
            hooks.append(module.register_forward_hook(
                lambda m, a, o: spent.__setitem__(0, spent[0] + time.perf_counter() - starts[m])))
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return spent[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compile", action="store_true", help="also time the backbone under torch.compile")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from rlpipe.core.models.cpu_memory import keep_freed_memory

    keep_freed_memory(True)  # as rlpipe runs
    bench = vs_trl.parse_args(["--model", "smollm2"])
    policy, _ = vs_trl.make_models(bench.cache.expanduser() / "smollm2", "smollm2")
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    info = machine()
    print_header("anatomy of the SmolLM2 update and decode step", info)
    out = {"machine": info}

    model.train()
    step = update_step(model)
    whole = median_time(step)
    recorder = RecordMatmuls()
    with recorder:
        step()
    alone, flop = replay(recorder.calls)
    out["update"] = {"whole_s": whole, "matmuls_alone_s": alone, "gflop": flop / 1e9}
    print(f"update micro-step: {whole:.3f} s whole, its matmuls alone {alone:.3f} s "
          f"({flop / 1e9:.0f} GFLOP at {flop / alone / 1e9:.0f} GFLOP/s alone, "
          f"{flop / whole / 1e9:.0f} in the pass): the rest is {whole - alone:.3f} s")

    model.eval()
    step = decode_step(model)
    whole = median_time(step, 9)
    linear = statistics.median(linear_seconds(model, step) for _ in range(5))
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                  if isinstance(m, torch.nn.Linear))
    big = torch.ones(135_000_000)
    read = big.numel() * 4 / median_time(big.sum)
    out["decode"] = {"whole_s": whole, "linear_s": linear, "weight_bytes": weights,
                     "read_bytes_per_s": read}
    print(f"decode step: {whole * 1e3:.1f} ms whole, {linear * 1e3:.1f} ms in its linear layers, "
          f"which read {weights / 1e6:.0f} MB of weights ({weights / linear / 1e9:.1f} GB/s; a "
          f"plain sum reads {read / 1e9:.1f} GB/s here)")
    del big

    if args.compile:
        model.train()
        eager = median_time(update_step(model))
        model.model = torch.compile(model.model, dynamic=False)
        step = update_step(model)
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        compiled = median_time(step)
        out["compile"] = {"eager_s": eager, "compiled_s": compiled, "first_call_s": first}
        print(f"torch.compile of the backbone: micro-step {compiled:.3f} s against {eager:.3f} s "
              f"eager (first call {first:.0f} s)")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
