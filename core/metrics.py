"""Metrics: one JSON object per PPO step in ``metrics.jsonl``, and a live progress bar.

>>> import tempfile, pathlib, json
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> with MetricsWriter(d / "metrics.jsonl", total=1, progress=False) as w:
...     w.write({"step": 1, "reward/score": 0.5})
>>> json.loads((d / "metrics.jsonl").read_text())["reward/score"]
0.5
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# Shown on the progress bar, in this order, when present.
_BAR_KEYS = ("reward/score", "kl/ref", "policy/clipfrac", "response/length", "perf/tokens_per_s")


def to_float(value) -> float:
    return float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)


def flatten(td, prefix: str = "") -> dict[str, float]:
    """Nested TensorDict/dict of scalars -> ``{"a/b": float}``."""
    out = {}
    for key, value in td.items():
        name = f"{prefix}{key}"
        if hasattr(value, "items"):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = to_float(value)
    return out


class MetricsWriter:
    """Appends one JSON line per step (flushed, so a crash loses nothing written) and drives tqdm."""

    def __init__(self, path: Path, total: int, progress: bool = True, initial: int = 0):
        self.file = open(path, "a", encoding="utf-8")
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="rlpipe", unit="step", dynamic_ncols=True)

    def write(self, metrics: dict) -> None:
        clean = {k: (v if isinstance(v, (int, str)) or math.isfinite(v) else None)
                 for k, v in metrics.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.bar is not None:
            shown = {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in _BAR_KEYS if k in metrics}
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
