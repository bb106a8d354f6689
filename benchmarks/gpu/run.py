"""Every GPU figure of issue 36 in runs of at most ~10 minutes (each part within its own limit,
`LIMIT_S`); results as JSON, written after each part.

    python benchmarks/gpu/run.py --parts variants,logprobs,static   # one call: MFU, then decoding
    python benchmarks/gpu/run.py --smoke         # on CPU: tiny sizes, every code path, nothing kept

On the lent GPU machine (no network; torch, transformers, peft, accelerate installed), from the
repository root, with the missing packages carried as wheels in ``.whl`` (see the device tool;
on 2026-11-25 these were tensordict 0.14.3, torchrl 0.14.1, pyvers, hoptorch, orjson,
importlib_metadata, datasets 5.2.0, dill, multiprocess, fsspec, and transformers 5.24.0, peft
0.21.2 and regex to match CI; 20 MB in all):

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    pip install -q --no-deps --no-build-isolation -e . && python benchmarks/gpu/run.py

The CUDA test suite is a separate command; ``-vv`` (the ``-q`` in ``addopts`` cancels one ``-v``)
names each test as it ends, so a run cut by the session's limit still says which failed (the
suite took more than 300 s with 15 workers on the H100, 2026-11-27, and reached 98%):

    RLPIPE_TEST_DEVICE=cuda python3 -m pytest -n 15 --timeout 100 -p no:benchmark -vv --tb=line

Parts (each in a fresh process, so no allocator state carries over):

1. ``phases``: one PPO step of a Qwen2.5-0.5B-architecture actor with its critic (full copies, a
   frozen reference, random weights) in bf16, batch 64 x 512 response tokens (every response full
   length): wall time and peak allocated GPU memory of generation (HF ``generate``), scoring
   (actor, reference, critic forwards), rewards, the PPO update and weight sync; generation
   tokens/s with the dynamic and with a static KV cache; update-phase MFU = 6 x trainable params
   x tokens through the update / time / peak dense bf16 FLOP/s (989 TFLOP/s for H100 and H200
   SXM, the number we use); then the update once more under `torch.profiler` (its costliest
   operators, ``update_profile``).
2. ``variants``: the same update with each MFU change on and off, alternating (`variants`):
   ``models.compile_logprobs``, compiled decoder blocks, both; their MFU and the profile of both.
3. ``logprobs``: `benchmarks/logprobs.py` on the device: rlpipe's log-prob kernels, eager and
   compiled, against the textbook ``log_softmax`` and TRL's row loop at the update's micro-batch.
4. ``static``: part 1 with the ``hf`` collector on ``cache: static`` (transformers compiles the
   decoding step on CUDA): generation through rlpipe's collector and the whole step with it.
5. ``memory``: `benchmarks/memory.py` at the Qwen2.5-1.5B architecture with a reward model of the
   same architecture: full copies against LoRA, a shared-backbone critic, activation
   checkpointing and reference + reward-model offload.
6. ``largest``: Qwen2.5 at 1.5B, 3B and 7B (random weights), a full-parameter PPO step with
   every saver on (checkpointing, the critic on the actor's backbone, the reference offloaded):
   its peak memory, or the out-of-memory error.
7. ``tiny``: the tiny example's ``metrics.jsonl`` on CUDA against CPU (its 12 steps): the largest
   absolute difference of every metric, against a stated tolerance.

``--parts`` picks parts and their order. All seven take more than one 10-minute call; phases,
static, memory and tiny took about 8 minutes on an H200 after the first call's start.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
ROOT = HERE.parents[1]
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}   # dense, SXM
TINY_TOLERANCE = 1e-3   # |cuda - cpu| of a per-step metric over the 12 steps, as tests/test_gpu.py
LIMIT_S = {"phases": 240, "variants": 300, "logprobs": 120, "memory": 240, "tiny": 90}
PARTS = ("phases", "variants", "logprobs", "static", "memory", "largest", "tiny")
ROUNDS = 2   # alternating rounds of the update variants


def phases(args) -> dict:
    """Part 1, in this process: the step's phases, timed and with their peak memory."""

    from common import build_pipeline, make_assets, make_config, memory_mib, reset_peak

    folder = make_assets(Path(tempfile.mkdtemp()), args.size)
    cfg = make_config(folder, batch=args.batch, new_tokens=args.new_tokens, device=args.device,
                      dtype=args.dtype, epochs=1, minibatches=2, collector={"cache": args.cache})
    pipe = build_pipeline(cfg)
    pipe.step()  # warm-up: kernels, allocator, optimizer states
    rows: dict = {}

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            reset_peak(args.device)
            start = time.perf_counter()
            out = inner(*a, **k)
            _, peak = memory_mib(args.device)
            rows[label] = {"s": time.perf_counter() - start, "peak_mib": peak}
            return out
        setattr(owner, name, wrapper)

    p = pipe.plugins
    for owner, name, label in ((p.collector, "collect", "generate"), (pipe, "_score_tokens", "score"),
                               (p.rewards, "forward", "rewards"), (pipe.updater, "update", "update"),
                               (p.collector, "sync_weights", "weight_sync")):
        timed(owner, name, label)
    batch, metrics = pipe.step()
    tokens = int(batch["response_mask"].sum())
    rows["generate"]["tokens_per_s"] = tokens / rows["generate"]["s"]
    update = update_flops(pipe, batch)
    update.update(mfu(update, rows["update"]["s"], args.device))
    name = update["device_name"]
    return {"device_name": name, "size": args.size, "batch": args.batch, "cache": args.cache,
            "new_tokens": args.new_tokens, "dtype": args.dtype, "phases": rows, "update": update,
            "kv_cache": kv_cache(pipe, batch, args), "step_metrics": metrics,
            "update_profile": profile_update(pipe, batch, args)}


def update_flops(pipe, batch) -> dict:
    """The update's model FLOPs: 6 x trainable parameters (actor and critic) x every token of
    ``batch`` (prompt and response: all go through the update) x epochs."""
    from common import count_params

    trainable = sum(count_params(m, trainable=True) for m in (pipe.models.actor, pipe.models.critic))
    tokens = int(batch["prompt_mask"].sum()) + int(batch["response_mask"].sum())
    epochs = pipe.cfg.train.epochs
    return {"trainable_params": trainable, "tokens": tokens, "epochs": epochs,
            "flops": 6 * trainable * tokens * epochs}


def mfu(update: dict, seconds: float, device: str) -> dict:
    """TFLOP/s and MFU of an update of ``update['flops']`` that took ``seconds``, against the
    device's dense bf16 peak (`PEAK_BF16`; None where it is not listed)."""
    import torch

    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return {"device_name": name, "tflops_per_s": update["flops"] / seconds / 1e12,
            "peak_bf16_tflops_used": peak / 1e12 if peak else None,
            "mfu": update["flops"] / seconds / peak if peak else None}


def variants(args) -> dict:
    """Part ``variants`` (its own process): the update of one batch, the workload of ``phases``,
    with each MFU change on and off, alternating, best of ``ROUNDS``: ``eager``;
    ``compiled_logprobs`` (``models.compile_logprobs``); ``compiled_blocks`` (each decoder
    block of actor and critic under ``torch.compile(dynamic=True)``, not yet a config key);
    ``both``. The first call of each is reported apart (compilation). The rollout uses the static
    KV cache: generation is not measured here. Then the profile of ``both``."""
    from common import build_pipeline, make_assets, make_config, sync
    from rlpipe.core.models.distributed import _blocks

    folder = make_assets(Path(tempfile.mkdtemp()), args.size)
    cfg = make_config(folder, batch=args.batch, new_tokens=args.new_tokens, device=args.device,
                      dtype=args.dtype, epochs=1, minibatches=2, collector={"cache": "static"})
    pipe = build_pipeline(cfg)
    pipe.step()
    batch, _ = pipe.step()
    m = pipe.models
    blocks = [b for model in (m.actor, m.critic) for b in _blocks(model)]
    for block in blocks:
        block.compile(dynamic=True)   # lazy: a block compiles at its first compiled call
    impls = [block._compiled_call_impl for block in blocks]

    def update(logprobs: bool, compiled_blocks: bool) -> float:
        m.compile_logprobs = logprobs
        for block, impl in zip(blocks, impls):
            block._compiled_call_impl = impl if compiled_blocks else None
        sync(args.device)
        start = time.perf_counter()
        type(pipe.updater).update(pipe.updater, batch)
        sync(args.device)
        return time.perf_counter() - start

    settings = {"eager": (False, False), "compiled_logprobs": (True, False),
                "compiled_blocks": (False, True), "both": (True, True)}
    out = {name: {"first_s": update(*on)} for name, on in settings.items()}
    for _ in range(ROUNDS):
        for name, on in settings.items():
            out[name]["s"] = min(out[name].get("s", float("inf")), update(*on))
    flops = update_flops(pipe, batch)
    for row in out.values():
        row.update(mfu(flops, row["s"], args.device))
    update(True, True)  # warm for the profile: same shapes, nothing compiles under it
    return {"flops": flops, "variants": out, "profile_both": profile_update(pipe, batch, args)}


def profile_update(pipe, batch, args) -> str:
    """The update of ``batch`` once more, under `torch.profiler`: its 25 costliest operators by
    device time (by CPU time on CPU), as the table torch prints; where the MFU work starts."""
    from torch.profiler import ProfilerActivity, profile

    from common import sync

    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        type(pipe.updater).update(pipe.updater, batch)  # the class's: not the timed wrapper
        sync(args.device)
    key = "cuda_time_total" if cuda else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25)


def kv_cache(pipe, batch, args) -> dict:
    """Generation tokens/s of the actor with transformers' dynamic and static KV caches."""
    import torch

    from common import sync

    actor, out = pipe.models.actor, {}
    ids, mask = batch["prompt_ids"][:args.batch], batch["prompt_mask"][:args.batch].long()
    for cache in ("dynamic", "static"):
        kwargs = {"cache_implementation": "static"} if cache == "static" else {}
        with torch.no_grad():
            for _ in range(2):  # the first call builds (static) caches and kernels
                sync(args.device)
                start = time.perf_counter()
                actor.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                               max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               pad_token_id=pipe.models.tokenizer.pad_token_id, **kwargs)
                sync(args.device)
                seconds = time.perf_counter() - start
        out[cache] = {"s": seconds, "tokens_per_s": ids.shape[0] * args.new_tokens / seconds}
    return out


def child(part: str, args, cache: str = "dynamic") -> dict:
    """Run ``part`` in a fresh process, the collector on a ``cache`` KV cache; its JSON result."""
    cmd = [sys.executable, __file__, "--part", part, "--device", args.device, "--size", args.size,
           "--dtype", args.dtype, "--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
           "--cache", cache]
    out = bounded(cmd, part)
    if "error" in out:
        return out
    return json.loads(out["stdout"].strip().splitlines()[-1])


def bounded(cmd: list, part: str) -> dict:
    """Run ``cmd`` within the part's time limit: its stdout, or the error that stopped it."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                             timeout=LIMIT_S[part])
    except subprocess.TimeoutExpired as exc:
        return {"error": f"cut after {LIMIT_S[part]} s", "stdout": str(exc.stdout or "")[-3000:]}
    if out.returncode:
        return {"error": out.stderr[-3000:]}
    return {"stdout": out.stdout}


def logprobs(args, out_json: Path) -> dict:
    """Part ``logprobs``: `benchmarks/logprobs.py` on the device (rlpipe's kernels, eager and
    compiled, against the textbook ``log_softmax`` and TRL's row loop)."""
    cmd = [sys.executable, str(HERE.parent / "logprobs.py"), "--device", args.device,
           "--json", str(out_json), *(["--positions", "16", "--reps", "1"] if args.smoke else [])]
    out = bounded(cmd, "logprobs")
    return out if "error" in out else json.loads(out_json.read_text())["variants"]


def memory(args, out_json: Path) -> dict:
    """Part 2: `benchmarks/memory.py` in its own processes."""
    size = "small" if args.smoke else "qwen2.5-1.5b"
    # --threads 0: all cores for the random init of four 1.5B models (one thread took ~100 s each)
    cmd = [sys.executable, str(HERE.parent / "memory.py"), "--device", args.device, "--size", size,
           "--dtype", args.dtype, "--reps", "1", "--batch", "4" if args.smoke else "16",
           "--new-tokens", "8" if args.smoke else "256", "--reward-model", "--json", str(out_json),
           "--threads", "0", "--variants", "lora+shared,full+savers,lora+shared+ckpt,full+ckpt"]
    out = bounded(cmd, "memory")   # a cut keeps the variants it printed, in "stdout"
    return out if "error" in out else json.loads(out_json.read_text())["median"]


def largest(args) -> dict:
    """Part ``largest``: which Qwen2.5 architectures (random weights) run a full-parameter PPO step
    on this GPU with every saver on (`memory.py`'s ``full+all``; the length reward, no reward
    model), each in its own process: its peak, or the error that stopped it (an out-of-memory
    error names itself). A size's folder is deleted after it (7B is 15 GB of weights)."""
    import shutil

    import memory as memory_bench

    out = {}
    for size in ("small", "medium") if args.smoke else ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"):
        ns = argparse.Namespace(device=args.device, size=size, dtype=args.dtype, threads=0,
                                batch=4 if args.smoke else 16, reward_model=False,
                                new_tokens=8 if args.smoke else 256)
        start = time.perf_counter()
        folder = memory_bench.assets(ns)
        try:
            out[size] = memory_bench.run_child(ns, "full+all", folder)
        except SystemExit as exc:   # run_child's report of a failed child
            out[size] = {"error": str(exc)[-1500:]}
        shutil.rmtree(folder, ignore_errors=True)
        out[size]["s"] = time.perf_counter() - start
    return out


def tiny(args, folder: Path) -> dict:
    """Part 3: the tiny example on ``args.device`` against CPU, 10 steps, same seed."""
    rows = {}
    for device in (args.device, "cpu"):
        run_dir = folder / f"tiny-{device.replace(':', '')}-{len(rows)}"
        cmd = [sys.executable, "-m", "rlpipe.cli", "run", str(ROOT / "examples/tiny/config.yaml"),
               f"run.device={device}", f"run.output_dir={run_dir}", "--no-progress"]
        out = bounded(cmd, "tiny")
        if "error" in out:
            return out
        rows[len(rows)] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    a, b = rows[0], rows[1]
    keys = [k for k in a[0] if not k.startswith(("time/", "perf/")) and k != "step"]
    diff = {k: max(abs(x[k] - y[k]) for x, y in zip(a, b)) for k in keys}
    return {"steps": len(a), "tolerance": TINY_TOLERANCE, "max_abs_diff": diff,
            "within_tolerance": all(v <= TINY_TOLERANCE for v in diff.values())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the code paths only")
    parser.add_argument("--device", default=None)
    parser.add_argument("--size", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--part", choices=["phases", "variants"], help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="dynamic", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which parts, in order (default: all: {','.join(PARTS)})")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    smoke = {"device": "cpu", "size": "small", "dtype": "float32", "batch": 4, "new_tokens": 8}
    real = {"device": "cuda", "size": "qwen2.5-0.5b", "dtype": "bfloat16", "batch": 64,
            "new_tokens": 512}
    for key, value in (smoke if args.smoke else real).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.part:
        print(json.dumps({"phases": phases, "variants": variants}[args.part](args), default=str))
        return

    import torch

    from common import RESULTS, machine, now, write_json

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device: use --smoke on CPU")
    start, folder = time.perf_counter(), Path(tempfile.mkdtemp(prefix="rlpipe-gpu-"))
    results = {"machine": machine(args.device), "started": now(), "settings": vars(args)}
    name = results["machine"].get("gpu", "cpu").replace(" ", "_")
    out = Path(args.out) if args.out else (folder / "smoke.json" if args.smoke
                                           else RESULTS / f"gpu_{name}.json")
    parts = {"phases": lambda: child("phases", args),
             "static": lambda: child("phases", args, cache="static"),
             "variants": lambda: child("variants", args),
             "logprobs": lambda: logprobs(args, folder / "logprobs.json"),
             "memory": lambda: memory(args, folder / "memory.json"), "largest": lambda: largest(args),
             "tiny": lambda: tiny(args, folder)}
    chosen = args.parts.split(",")
    if any(p not in parts for p in chosen):
        parser.error(f"--parts: choose from {','.join(PARTS)}")
    for part in chosen:   # written after each part: a cut call keeps the rest
        results[part] = parts[part]()
        results["total_s"] = time.perf_counter() - start
        write_json(out, results)
        print(part, "done", round(results["total_s"]), "s", flush=True)
    failed = [k for k in chosen if "error" in results[k]]
    print(json.dumps({k: results[k] for k in chosen if k != "memory"}, indent=1,
                     default=str)[:6000])
    if failed:
        raise SystemExit(f"parts failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
