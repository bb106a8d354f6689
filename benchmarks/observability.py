"""What issue 19's observability costs a PPO step: batch statistics, sample files, the per-step
line, and the ``policy/`` folder of a checkpoint.

    python benchmarks/observability.py [--reps 6]

One process, one rlpipe Pipeline (benchmarks/common.py ``small`` Llama, ~5M parameters, batch 8,
32 sampled tokens, 2 epochs x 2 minibatches). Steps alternate between ``on`` (as shipped:
`samples.step_stats` in the metrics stage, the metrics line written and shown, and
``samples/step-N.jsonl`` written every step) and ``off`` (`step_stats` replaced by a no-op, no
sample file, the metrics line written but not shown), which one goes first swapping every pair.
The pre-clip gradient norms cannot be switched off; they read the norm `clip_grad_norm_` already
returns. Reported: the median step time of each, their ratio, and the observability work timed
on its own (median ms per step). Checkpoints: `Pipeline.save_checkpoint` with and without the
policy folder, alternating.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time

from common import build_pipeline, machine, make_assets, make_config, print_header, workdir, write_json
from rlpipe.core.observe import console, samples
from rlpipe.core.run import checkpoint
from rlpipe.core.observe.metrics import MetricsWriter


def timed_step(pipe, writer, on: bool) -> float:
    real = samples.step_stats
    if not on:
        samples.step_stats = lambda *a, **k: {}
    try:
        t0 = time.perf_counter()
        batch, metrics = pipe.step()
        writer.file.write("{}\n")  # the metrics line itself is written in both
        if on:
            with contextlib.redirect_stderr(io.StringIO()):
                writer.bar.update({"step": pipe.step_count, **metrics})
            pipe._write_samples(batch, writer)
        return time.perf_counter() - t0
    finally:
        samples.step_stats = real


def isolated_ms(pipe, reps: int = 20) -> float:
    """The observability work of one step on its own: statistics, sample rows and file, line."""
    batch, _ = pipe.step()
    from rlpipe.core.step import kl
    from rlpipe.core.base import schema as S

    mask = batch[S.RESPONSE_MASK]
    kl_tok = kl.kl_per_token(batch[S.OLD_LOG_PROB], batch[S.REF_LOG_PROB], "k1") * mask
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        metrics = samples.step_stats(batch, kl_tok, 32, True)
        samples.write_samples(pipe.run_dir, 0, samples.sample_rows(batch, kl_tok, 4))
        console.step_line(metrics, 10)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def checkpoint_times(pipe, reps: int) -> dict:
    real = checkpoint.save_policy
    out = {"with_policy": [], "without_policy": []}
    for i in range(2 * reps):
        with_policy = i % 2 == (i // 2) % 2
        if not with_policy:
            checkpoint.save_policy = lambda *a, **k: None
        try:
            t0 = time.perf_counter()
            pipe.save_checkpoint()
            out["with_policy" if with_policy else "without_policy"].append(time.perf_counter() - t0)
        finally:
            checkpoint.save_policy = real
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="pairs of steps (on, off)")
    args = parser.parse_args()
    info = machine()
    print_header("observability overhead of a PPO step", info)
    folder = make_assets(workdir(), "small")
    cfg = make_config(folder, batch=8, new_tokens=32, epochs=2, minibatches=2)
    pipe = build_pipeline(cfg)
    writer = MetricsWriter(pipe.run_dir / "metrics.jsonl", 1000, progress=False)
    timed_step(pipe, writer, on=True)  # warm-up
    runs = {"on": [], "off": []}
    for i in range(args.reps):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            runs["on" if on else "off"].append(timed_step(pipe, writer, on))
    ratios = [a / b for a, b in zip(runs["on"], runs["off"])]
    result = {
        "median_step_s": {k: statistics.median(v) for k, v in runs.items()},
        "steps_s": runs,
        "ratio_on_off_median": statistics.median(ratios),
        "ratio_on_off_pairs": ratios,
        "isolated_ms_per_step": isolated_ms(pipe),
        "checkpoint_s": checkpoint_times(pipe, max(2, args.reps // 2)),
        "load_after": os.getloadavg(),
    }
    writer.close()
    print(f"step: on {result['median_step_s']['on']:.3f} s, off {result['median_step_s']['off']:.3f} s"
          f" (median), ratio on/off {result['ratio_on_off_median']:.3f} "
          f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"observability work alone: {result['isolated_ms_per_step']:.2f} ms per step")
    ck = result["checkpoint_s"]
    print(f"checkpoint: {ck['with_policy']:.3f} s with policy/, {ck['without_policy']:.3f} s without")
    print("load average after: {:.2f} {:.2f} {:.2f}".format(*result["load_after"]))
    write_json(os.path.join(os.path.dirname(__file__), "results", "observability.json"),
               {"machine": info, **result})


if __name__ == "__main__":
    main()
