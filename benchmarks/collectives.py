"""Collectives of a 2-process run (gloo, CPU): the rollout gather and the checkpoint.

1. Rollout gather: rlpipe's tensor all-gather (`Dist.gather`) against the previous
   implementation, `all_gather_object` of whole TensorDicts (pickled through host memory), at
   the tiny example's shape, the quickstart's, and a long-context one. Interleaved, medians.
2. Checkpoint of actor + AdamW state: the full state gathered on rank 0 and written there (what
   `Pipeline.save_checkpoint` does) against `torch.distributed.checkpoint` (DCP), each rank
   writing its own shard, at the tiny model's size and SmolLM2-135M's (random weights).
   Wall time and rank 0's resident-memory growth.

    python benchmarks/collectives.py          # writes benchmarks/results/collectives.json
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import NonTensorStack, TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, now, write_json  # noqa: E402

from rlpipe.core.base import schema as S  # noqa: E402
from rlpipe.core.models.distributed import Dist, _pad, shard  # noqa: E402

SHAPES = {"tiny": (8, 16, 24), "quickstart": (8, 64, 40), "long": (32, 512, 1024)}  # rows/rank, P, R
MODELS = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (64, 2, 4, 2, 128, 2048),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152),
}


def rollout(rows: int, p: int, r: int, rank: int) -> TensorDict:
    g = torch.Generator().manual_seed(rank)
    floats = {k: torch.randn(rows, r, generator=g) for k in
              (S.OLD_LOG_PROB, S.REF_LOG_PROB, S.VALUE, S.ENGINE_LOG_PROB)}
    td = TensorDict({S.PROMPT_IDS: torch.randint(0, 1000, (rows, p), generator=g),
                     S.PROMPT_MASK: torch.ones(rows, p, dtype=torch.bool),
                     S.RESPONSE_IDS: torch.randint(0, 1000, (rows, r), generator=g),
                     S.RESPONSE_MASK: torch.ones(rows, r, dtype=torch.bool),
                     S.GROUP_ID: torch.arange(rows), S.FINISHED: torch.ones(rows, dtype=torch.bool),
                     S.SCORE: torch.randn(rows, generator=g), **floats}, batch_size=[rows])
    td[S.SCORE_PARTS, "length"] = torch.randn(rows, generator=g)
    td[S.PROMPT_TEXT] = NonTensorStack(*["a prompt " * 8] * rows)
    td[S.RESPONSE_TEXT] = NonTensorStack(*["a response " * 20] * rows)
    return td


def gather_objects(td: TensorDict, world: int) -> TensorDict:
    """The previous `Dist.gather`: pickle whole TensorDicts through `all_gather_object`."""
    parts: list = [None] * world
    dist.all_gather_object(parts, td.cpu())
    width_p = max(x[S.PROMPT_IDS].shape[1] for x in parts)
    width_r = max(x[S.RESPONSE_IDS].shape[1] for x in parts)
    padded = []
    for part in parts:
        r = part[S.RESPONSE_IDS].shape[1]
        for key in list(part.keys(include_nested=True, leaves_only=True)):
            value = part.get(key)
            if isinstance(value, torch.Tensor):
                part.set(key, _pad(value, key, width_p, width_r, r))
        padded.append(part)
    return torch.cat(padded)


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def bench_gather(d: Dist, reps: int) -> dict:
    results = {}
    for name, (rows, p, r) in SHAPES.items():
        td = rollout(rows, p, r, d.rank)
        new = d.gather(td)
        old = gather_objects(td, d.world)
        assert torch.equal(new[S.OLD_LOG_PROB], old[S.OLD_LOG_PROB])  # same result
        times = {"tensor": [], "object": []}
        for i in range(reps):  # interleaved, order alternating
            order = ("tensor", "object") if i % 2 == 0 else ("object", "tensor")
            for method in order:
                fn = (lambda: d.gather(td)) if method == "tensor" else (lambda: gather_objects(td, d.world))
                times[method] += timed(fn, 1)
        mb = sum(v.numel() * v.element_size() for v in new.values(True, True)
                 if isinstance(v, torch.Tensor)) / 2**20
        results[name] = {"rows_per_rank": rows, "P": p, "R": r, "gathered_MiB": round(mb, 2),
                         **{f"{k}_median_ms": 1e3 * statistics.median(v) for k, v in times.items()}}
    return results


def build_model(name: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter, vocab = MODELS[name]
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=True)).eval()


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_checkpoint(d: Dist, folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    results = {}
    for name in MODELS:
        model = shard(build_model(name))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        model(input_ids=torch.ones(2, 8, dtype=torch.long)).logits.sum().backward()
        opt.step()  # optimizer state exists
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        row = {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
        for method in ("full_on_rank0", "dcp_sharded"):
            target = folder / f"{name}-{method}"
            before = rss_mib()
            dist.barrier()
            t0 = time.perf_counter()
            if method == "full_on_rank0":
                weights = get_model_state_dict(model, options=full)
                optim = get_optimizer_state_dict(model, opt, options=full)
                if d.is_main:
                    target.mkdir()
                    save_file({k: v.contiguous() for k, v in weights.items()},
                              str(target / "actor.safetensors"))
                    torch.save(optim, target / "state.pt")
                del weights, optim
            else:
                state = {"model": get_model_state_dict(model),
                         "optim": get_optimizer_state_dict(model, opt)}
                dcp.save(state, checkpoint_id=str(target))
            dist.barrier()
            row[f"{method}_s"] = time.perf_counter() - t0
            row[f"{method}_rank0_peak_rss_growth_MiB"] = max(0.0, rss_mib() - before)
        results[name] = row
        del model, opt
    return results


def worker(rank: int, world: int, port: int, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    d = Dist(rank, world, rank)
    folder = Path(tempfile.mkdtemp()) if rank == 0 else None
    folder = Path(d.gather_object(str(folder))[0])
    gather = bench_gather(d, reps)
    ckpt = bench_checkpoint(d, folder)
    if d.is_main:
        write_json(out, {"date": now(), "machine": machine(), "world": world,
                         "load_avg": os.getloadavg(), "gather": gather, "checkpoint": ckpt})
        for name, row in [*((f"gather/{k}", v) for k, v in gather.items()),
                          *((f"checkpoint/{k}", v) for k, v in ckpt.items())]:
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--out", default=str(RESULTS / "collectives.json"))
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print("load average before:", os.getloadavg())
    mp.spawn(worker, args=(2, port, args.reps, args.out), nprocs=2)


if __name__ == "__main__":
    main()
