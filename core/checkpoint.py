"""Atomic checkpoints of everything a run needs to continue exactly where it stopped.

A checkpoint is written to ``checkpoints/.tmp-step-N``, completed with a ``COMPLETE`` marker,
then renamed to ``checkpoints/step-N``: a folder left half-written by a kill is never picked up.
Weights go to safetensors, the rest to ``state.pt`` read back with ``weights_only=True``: loading
never unpickles arbitrary objects.

>>> import tempfile, pathlib, torch
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = save(d, 3, {"actor": {"w": torch.zeros(2)}}, {"step": 3}, keep=2)
>>> latest(d).name
'step-000003'
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlpipe.core.errors import UserError

MARKER = "COMPLETE"


def trainable_state(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``full`` (the module's full state dict) that training changes: LoRA adapters
    only when the base is frozen; contiguous CPU tensors, as safetensors wants."""
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    keep = {k: v for k, v in full.items() if k in names} if names else full
    return {k: v.detach().to("cpu").contiguous() for k, v in keep.items()}


def save(run_dir: Path, step: int, weights: dict, state: dict, keep: int) -> Path:
    """Write ``weights`` (name -> state dict) and ``state`` atomically; keep the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, tensors in weights.items():
        save_file(tensors, str(tmp / f"{name}.safetensors"))
    torch.save(state, tmp / "state.pt")
    (tmp / MARKER).write_text(str(step))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in complete(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (half-written ones have no marker and are skipped)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest(run_dir: Path) -> Path | None:
    found = complete(run_dir)
    return found[-1] if found else None


def load(path: Path, modules: dict) -> dict:
    """Load weights into ``modules`` (plain or FSDP-sharded; strict on the saved keys) and return
    the saved state."""
    from rlpipe.core.distributed import load_full_state

    for name, module in modules.items():
        file = path / f"{name}.safetensors"
        if not file.is_file():
            raise UserError(f"checkpoint {path} has no {file.name}")
        saved = load_file(str(file))
        unknown = set(saved) - {n for n, _ in module.named_parameters()}
        if unknown:
            raise UserError(f"checkpoint {file} does not match the model: unknown keys such as "
                            f"{sorted(unknown)[0]!r} (was it written with another config?)")
        load_full_state(module, saved)
    return torch.load(path / "state.pt", weights_only=True)
