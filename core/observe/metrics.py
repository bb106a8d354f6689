"""Metrics: one JSON object per PPO step in ``metrics.jsonl``, a live progress bar, and optional
TensorBoard (``run_dir/tensorboard``) and Weights & Biases sinks, each imported only when enabled.

>>> import tempfile, pathlib, json
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> with MetricsWriter(d / "metrics.jsonl", total=1, progress=False) as w:
...     w.write({"step": 1, "reward/score": 0.5})
>>> json.loads((d / "metrics.jsonl").read_text())["reward/score"]
0.5
"""

from __future__ import annotations

import importlib.util
import json
import math
import netrc
import os
import warnings
import sys
from pathlib import Path

import torch
import yaml

from rlpipe.core.observe.console import Progress
from rlpipe.core.base.errors import UserError, writing
from rlpipe.core.base.files import read_jsonl
from rlpipe.core.observe.samples import markdown_table


def to_float(value) -> float:
    return float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)


def metric_value(value) -> int | float | str:
    """A value a metrics row can hold: an int, float or string as it is (a bool as 0/1), a
    one-element tensor or a numpy scalar as its number; anything else is a `TypeError`.

    >>> import numpy as np
    >>> metric_value(torch.tensor(2.5)), metric_value(np.float32(0.5)), metric_value(True)
    (2.5, 0.5, 1)
    >>> metric_value(None)
    Traceback (most recent call last):
    TypeError: None (NoneType) is not a number, a string or a one-element tensor
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1:
        return value.item()
    raise TypeError(f"{str(value)[:60]} ({type(value).__name__}) is not a number, a string or a "
                    f"one-element tensor")


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


def keep_steps(path: Path, last: int) -> None:
    """Rewrite ``metrics.jsonl`` with one row per step ``0..last`` (the newest row of a step wins;
    later steps and unreadable lines, such as one cut by a kill, are dropped); atomic."""
    path = Path(path)
    if not path.is_file():
        return
    rows = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and 0 <= step <= last:  # step 0: the evaluation before training
            rows[step] = line
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, f"the metric rows up to step {last}"):
        tmp.write_text("".join(rows[s] + "\n" for s in sorted(rows)), encoding="utf-8")
        os.replace(tmp, path)


# log.<key> -> the module it needs and the extra that installs it
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_trackers(log) -> None:
    """A tracker switched on whose package is missing: one line, at config load (before any model
    loads, not after the models are built)."""
    for key, module in TRACKERS.items():
        if getattr(log, key) and module not in sys.modules and \
                importlib.util.find_spec(module) is None:
            raise UserError(f"log.{key}: true needs the {module} package: "
                            f"pip install 'rlpipe[{key}]'")


def flat_config(config: dict, prefix: str = "") -> dict[str, int | float | str | bool]:
    """The resolved config as ``{dotted key: value}`` hyperparameters (lists, null: as text).

    >>> flat_config({"run": {"steps": 3}, "rewards": [{"name": "length"}], "kl": {"target": None}})
    {'run.steps': 3, 'rewards': "[{'name': 'length'}]", 'kl.target': 'None'}
    """
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            ok = isinstance(value, (int, float, str, bool))
            out[f"{prefix}{key}"] = value if ok else str(value)
    return out


class _TensorBoard:
    """Scalars to ``log_dir`` through ``torch.utils.tensorboard`` (needs the tensorboard package)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("log.tensorboard: true needs the tensorboard package: "
                            "pip install 'rlpipe[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_config(self, config: dict) -> None:
        """The resolved config as hyperparameters (the HPARAMS tab) and as YAML text."""
        self.writer.add_hparams(flat_config(config), {}, run_name=".")
        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```")
        self.writer.flush()

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_samples(self, rows: list[dict], step: int) -> None:

        self.writer.add_text("samples", markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb_key_configured() -> bool:
    """Whether ``WANDB_API_KEY`` is set or ``wandb login`` stored a key in the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class _Wandb:
    """A Weights & Biases run; mode from ``WANDB_MODE``, else offline unless an API key is configured
    (offline runs land in ``run_dir/wandb/``; upload them later with ``wandb sync``)."""

    def __init__(self, project: str, name: str, run_dir: Path):
        try:
            import wandb
        except ImportError:
            raise UserError("log.wandb: true needs the wandb package: "
                            "pip install 'rlpipe[wandb]'") from None
        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_key_configured() else "offline")
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode)

    def log_config(self, config: dict) -> None:
        """The resolved config as the run's W&B config (nested, as in config.yaml)."""
        self.run.config.update(config, allow_val_change=True)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        import wandb

        columns = ["prompt", "response", "score", "length", "finished", "kl"]
        table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    """Appends one JSON line per step (flushed, so a crash loses nothing written), shows it
    (`rlpipe.core.observe.console.Progress`: a bar, or with ``progress=False`` or off a terminal one line)
    and forwards the numeric metrics to the enabled sinks (``tensorboard``, ``wandb``) at ``step``,
    after ``config`` (the resolved config) as their hyperparameters;
    `log_samples` sends a step's samples to them (a text table, a W&B table)."""

    def __init__(self, path: Path, total: int, progress: bool = True, initial: int = 0, *,
                 tensorboard: bool = False, wandb: bool = False, wandb_project: str = "rlpipe",
                 run_name: str | None = None, config: dict | None = None):
        path = Path(path)
        self.file, self.bar, self.sinks, self.step = None, None, [], initial
        try:
            if tensorboard:
                self.sinks.append(_TensorBoard(path.parent / "tensorboard"))
            if wandb:
                self.sinks.append(_Wandb(wandb_project, run_name or path.parent.name, path.parent))
            for sink in self.sinks:  # the resolved config, as hyperparameters
                if config is not None:
                    sink.log_config(config)
        except BaseException:
            self.close()
            raise
        with writing(path, "the metrics file"):
            self.file = open(path, "a", encoding="utf-8")
        self.bar = Progress(total, initial, bar=progress)

    def write(self, metrics: dict) -> None:
        clean = {k: (v if isinstance(v, (int, str)) or math.isfinite(v) else None)
                 for k, v in metrics.items()}
        with writing(self.file.name, f"the metrics row of step {metrics.get('step')}"):
            self.file.write(json.dumps(clean) + "\n")  # a row cut here is dropped on --resume
            self.file.flush()
        before, self.step = self.step, int(metrics.get("step", self.step + 1))
        scalars = {k: float(v) for k, v in clean.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for sink in self.sinks:
            sink.log(scalars, self.step)
        if self.bar is not None:
            self.bar.update(metrics, advance=max(0, self.step - before))  # a step-0 row
                                                                          # (evaluation) moves nothing

    def log_samples(self, rows: list[dict], step: int) -> None:
        for sink in self.sinks:
            sink.log_samples(rows, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.bar is not None:
            self.bar.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


PLOT_LIMIT = 1e300   # larger magnitudes overflow axis scaling: left out, with a warning
MAX_STEP = 2 ** 53   # steps must be exact as floats


class ReportWarning(UserWarning):
    """Values of ``metrics.jsonl`` that the report leaves out (``rlpipe report`` prints
    ``warning: ...``)."""


def _number(value) -> float:
    """A metric value as a float: NaN unless it is a JSON number (not a bool); an int too large
    for a float becomes +-inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def load_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``, one per step, sorted by step (last row per step wins).

    Each value becomes a float (NaN where null, not a number, or non-finite); a number beyond
    ``PLOT_LIMIT`` becomes NaN with a `ReportWarning`. A line that is not a JSON object with an
    integer ``step`` (or not UTF-8) is a `UserError` naming ``file:line``."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}")
    if not path.is_file():
        raise UserError(f"no metrics.jsonl in {run_dir}: not a run directory, or no step finished yet")
    rows, huge = {}, {}
    for lineno, row in read_jsonl(path):
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or abs(step) > MAX_STEP:
            raise UserError(f"{path}:{lineno}: expected a JSON object with an integer 'step' "
                            f"(|step| <= 2**53)")
        values = {key: _number(v) for key, v in row.items() if key != "step"}
        for key, v in values.items():
            if abs(v) > PLOT_LIMIT and math.isfinite(v):
                huge[key], values[key] = huge.get(key, 0) + 1, math.nan
        rows[step] = {"step": step, **values}
    if not rows:
        raise UserError(f"{path} is empty: no step finished yet")
    if huge:
        names = ", ".join(sorted(huge)[:5]) + (", ..." if len(huge) > 5 else "")
        warnings.warn(f"{path}: {sum(huge.values())} values beyond +-{PLOT_LIMIT:g} left out "
                      f"({names})", ReportWarning, stacklevel=2)
    return [rows[step] for step in sorted(rows)]
