"""What a run prints: start-up status lines, a progress bar or one line per step, a final summary.

Everything goes to stderr except the final summary (the CLI prints it on stdout). The bar is
tqdm's: a dependency transformers already has, it renders in notebooks (``tqdm.auto``) and on
terminals, and it leaves other libraries' prints and warnings alone (``rich``'s live display
would redirect them, and it would be one more dependency for the same picture). When stderr is
not a terminal (CI, ``> log.txt``) or with ``--no-progress``, each step prints one plain line
instead of a bar redrawn with carriage returns. transformers' and huggingface_hub's own bars
("Loading weights", "Writing model shards") are switched off while a run prints its own.

>>> step_line({"step": 3, "reward/score": -0.4213, "kl/ref": 0.0131, "time/step_s": 3.14}, 10)
'step 3/10  reward -0.421  kl 0.0131  3.1 s/step'
>>> postfix({"reward/score": 0.5, "perf/tokens_per_s": 812.4}, width=80)
'reward=0.5 tok/s=812'
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path

from rlpipe.core.observe.samples import sample_files

# (metric, short name) shown on the bar and in the step line, in this order, when logged.
SHOWN = (("reward/score", "reward"), ("kl/ref", "kl"), ("policy/clipfrac", "clip"),
         ("response/length", "len"), ("perf/tokens_per_s", "tok/s"))
BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"
MIN_BAR = 10  # bar cells kept before postfix entries are dropped (the last ones first)


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def postfix(metrics: dict, width: int, total: int = 100) -> str:
    """The bar's ``name=value`` entries that fit in ``width`` columns next to a readable bar."""
    entries = [f"{short}={_fmt(metrics[k])}" for k, short in SHOWN if k in metrics]
    room = width - len(f"rlpipe {total}/{total} || 00:00:00<00:00:00 ") - MIN_BAR
    while entries and len(" ".join(entries)) > room:
        entries.pop()
    return " ".join(entries)


def step_line(metrics: dict, total: int) -> str:
    """One plain line per step, for logs."""
    parts = [f"step {metrics.get('step', '?')}/{total}"]
    parts += [f"{short} {_fmt(metrics[k])}" for k, short in SHOWN if k in metrics]
    if "time/step_s" in metrics:
        parts.append(f"{metrics['time/step_s']:.1f} s/step")
    return "  ".join(parts)


def interactive() -> bool:
    """Whether a redrawn bar makes sense: stderr is a terminal, or a notebook runs us."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


class Progress:
    """A tqdm bar on a terminal (``bar=True`` and `interactive`), else one `step_line` per step."""

    def __init__(self, total: int, initial: int = 0, bar: bool = True):
        self.total, self.bar = total, None
        if bar and interactive():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="rlpipe", unit="step",
                            dynamic_ncols=True, bar_format=BAR_FORMAT)

    def update(self, metrics: dict, advance: int = 1) -> None:
        if self.bar is None:
            print(step_line(metrics, self.total), file=sys.stderr, flush=True)
            return
        width = shutil.get_terminal_size((80, 24)).columns
        text = postfix(metrics, width, self.total)
        self.bar.set_postfix_str(" " + text if text else "", refresh=False)
        self.bar.update(advance)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Status:
    """Start-up status lines (``rlpipe: ...`` on stderr, flushed); silent when not ``enabled``
    (ranks other than 0)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"rlpipe: {text}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, text: str):
        """Say ``text ...`` now; the caller's own lines follow with the results."""
        self.say(f"{text} ...")
        start = time.perf_counter()
        yield lambda: time.perf_counter() - start


def size(module) -> str:
    """Parameter count (trainable ones too, where fewer), dtype and device of a model.

    >>> import torch
    >>> size(torch.nn.Linear(1000, 2000))
    '2.0M params, float32, cpu'
    """
    import torch

    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    first = params[0] if params else torch.empty(0)
    text = _count(total) + " params"
    if 0 < trainable < total:
        text += f" ({_count(trainable)} trainable)"
    return f"{text}, {str(first.dtype).replace('torch.', '')}, {first.device}"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def describe_models(models, seconds: float) -> list[str]:
    """One line per model of a built `rlpipe.core.models.lm.Models` (loaded in ``seconds``)."""
    lines = [f"actor      {size(models.actor)}  (models loaded in {seconds:.1f} s)"]
    if models.critic is not None:
        lines.append(f"critic     {size(models.critic)}")
    if models.frozen_reference is not None:
        lines.append(f"reference  {size(models.frozen_reference)} (a frozen copy of the actor)")
    else:
        lines.append("reference  the actor with its LoRA adapters disabled (no copy)")
    return lines


@contextlib.contextmanager
def quiet_libraries():
    """transformers' and huggingface_hub's progress bars off inside the block, restored after."""
    restore = []
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.append(hf_logging.enable_progress_bar)
    with contextlib.suppress(ImportError):
        import huggingface_hub.utils as hub

        if not hub.are_progress_bars_disabled():
            hub.disable_progress_bars()
            restore.append(hub.enable_progress_bars)
    try:
        yield
    finally:
        for enable in restore:
            enable()


def final_summary(run_dir: Path, newest: Path | None) -> list[str]:
    """Where a finished run put everything; ``newest``: its newest complete checkpoint, if any."""
    run_dir = Path(run_dir)
    lines = [f"run finished: {run_dir}"]

    def row(label: str, path: Path, note: str = "") -> None:
        if path.exists():
            lines.append(f"  {label:<12}{path}{'  ' + note if note else ''}")

    metrics = run_dir / "metrics.jsonl"
    steps = sum(1 for _ in open(metrics, encoding="utf-8")) if metrics.is_file() else 0
    row("metrics", metrics, f"({steps} steps)")
    found = sample_files(run_dir)
    if found:
        row("samples", run_dir / "samples", f"(steps {found[0][0]}..{found[-1][0]})")
    if newest is not None:
        row("checkpoint", newest, "(newest; rlpipe export RUN_DIR OUT writes a policy from it)")
    row("policy", run_dir / "final", "(AutoModelForCausalLM.from_pretrained or peft)")
    row("tensorboard", run_dir / "tensorboard", f"(tensorboard --logdir {run_dir / 'tensorboard'})")
    row("wandb", run_dir / "wandb")
    lines.append(f"  {'plots':<12}rlpipe report {run_dir}")
    return lines
