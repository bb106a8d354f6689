"""Atomic, verifiable checkpoints of everything a run needs to continue exactly where it stopped.

A checkpoint is written to ``checkpoints/.tmp-step-N``; a ``manifest.json`` records each file's
size and sha256, then a ``COMPLETE`` marker is written and the folder is renamed to
``checkpoints/step-N``: a folder left half-written by a kill is never picked up. Pruning an old
checkpoint removes its marker first, then renames it to ``.trash-step-N`` before deleting it, so a
kill while pruning never leaves a folder that looks complete. `choose` verifies the newest complete
checkpoint against its manifest and falls back to the newest intact one. Weights go to
safetensors, the rest to ``state.pt`` read back with ``weights_only=True``: loading never
unpickles arbitrary objects. A write that fails (a full disk) removes the new folder and raises a
`UserError`; the previous checkpoints are untouched.

>>> import tempfile, pathlib, torch
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = save(d, 3, {"actor": {"w": torch.zeros(2)}}, {"step": 3}, keep=2)
>>> latest(d).name, verify(latest(d))
('step-000003', None)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlpipe.core.base.errors import UserError, option
from rlpipe.core.models.distributed import load_full_state
from rlpipe.core.step import journal

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
# rlpipe's own folder names under checkpoints/; nothing else there is touched or read
STEP = re.compile(r"step-(\d{6,7})")
LEFTOVER = re.compile(r"\.(tmp|trash)-step-\d{6,7}")
SHARDS = "dcp"                 # a distributed checkpoint's torch.distributed.checkpoint folder
POLICY = "policy"               # a one-process checkpoint's policy as a save_pretrained folder


def trainable_state(module: torch.nn.Module, full: dict[str, torch.Tensor],
                    to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The entries of ``full`` (the module's state dict) that training changes: LoRA adapters
    only when the base is frozen; contiguous CPU tensors, as safetensors wants (``to_cpu``), or
    the tensors themselves (for torch.distributed.checkpoint, which loads into them in place)."""
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    keep = {k: v for k, v in full.items() if k in names} if names else full
    return {k: v.detach().to("cpu").contiguous() for k, v in keep.items()} if to_cpu else keep


def save_policy(actor, tokenizer, folder: Path, base_path) -> None:
    """``actor`` (or its LoRA adapter alone) and ``tokenizer`` as a ``save_pretrained`` folder that
    loads without rlpipe; an adapter's ``adapter_config.json`` names ``base_path`` as its base."""
    folder = Path(folder)
    actor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        config = json.loads(adapter.read_text())
        config["base_model_name_or_path"] = str(base_path)
        adapter.write_text(json.dumps(config, indent=2, sort_keys=True))


def _digest(path: Path) -> dict:
    """Size and sha256 of a written file (flushed to disk on the way)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": sha.hexdigest()}


def _write(tmp: Path, step: int, weights: dict, state: dict, extra=None) -> None:
    tmp.mkdir(parents=True)
    for name, tensors in weights.items():
        save_file(tensors, str(tmp / f"{name}.safetensors"))
    torch.save(state, tmp / "state.pt")
    if extra is not None:  # e.g. the policy as a save_pretrained folder (`save_policy`)
        extra(tmp)
    _seal(tmp, step)


def _seal(tmp: Path, step: int) -> None:
    """Manifest (size and sha256 of every file, sub-folders included), then the marker."""
    files = {str(p.relative_to(tmp)): _digest(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    (tmp / MARKER).write_text(str(step))


def _discard(path: Path) -> None:
    """Remove a checkpoint folder so that no moment of it looks complete: marker, rename, delete."""
    if not path.exists():
        return
    (path / MARKER).unlink(missing_ok=True)
    trash = path.with_name(".trash-" + path.name.lstrip("."))
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def io_failure(exc: BaseException) -> bool:
    """An error of a write: an `OSError`, or one a writer wrapped in its own type (torch's zip
    writer reports a full disk as ``RuntimeError: ... unexpected pos N vs M``, safetensors as
    ``IoError(Os { code: 28, kind: StorageFull ...``).

    >>> io_failure(RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"))
    True
    """
    text = str(exc).lower()
    return isinstance(exc, OSError) or any(s in text for s in (
        "no space", "quota", "os error", "ioerror", "write failed", "storagefull",
        "unexpected pos", "failed writing", "permission denied", "read-only file system"))


def save(run_dir: Path, step: int, weights: dict, state: dict, keep: int, extra=None) -> Path:
    """Write ``weights`` (name -> state dict) and ``state`` atomically; keep the newest ``keep``.
    ``extra(folder)`` writes more files into the checkpoint before it is sealed."""
    root, tmp, final = _paths(run_dir, step)
    _clear_leftovers(root)
    try:
        _write(tmp, step, weights, state, extra)
        return _publish(run_dir, tmp, final, keep)
    except Exception as exc:
        raise _write_error(exc, run_dir, tmp, final) from exc


def save_sharded(run_dir: Path, step: int, shards: dict, state: dict, keep: int, dist) -> Path:
    """A distributed checkpoint: every rank writes its own shard of ``shards`` (model and
    optimizer states as DTensors) to ``dcp/`` with torch.distributed.checkpoint, so no rank ever
    holds the full state; rank 0 writes ``state`` (``state.pt``), the manifest and the marker.
    DCP reshards on load, so another world size can resume it. Call it on every rank."""
    import torch.distributed.checkpoint as dcp

    root, tmp, final = _paths(run_dir, step)
    if dist.is_main:
        _clear_leftovers(root)
        tmp.mkdir(parents=True)
    dist.barrier()
    failure = None
    try:
        dcp.save(shards, checkpoint_id=str(tmp / SHARDS))
        dist.barrier()
        if dist.is_main:
            torch.save(state, tmp / "state.pt")
            _seal(tmp, step)
    except Exception as exc:  # noqa: BLE001 - reported below, on rank 0
        failure = exc
    if dist.is_main:
        try:
            if failure is not None:
                raise failure
            _publish(run_dir, tmp, final, keep)
        except Exception as exc:  # noqa: BLE001 - a write error is one line
            raise _write_error(exc, run_dir, tmp, final) from exc
    elif failure is not None and not io_failure(failure):
        raise failure
    dist.barrier()
    return final


def _paths(run_dir: Path, step: int) -> tuple[Path, Path, Path]:
    root = Path(run_dir) / "checkpoints"
    return root, root / f".tmp-step-{step:06d}", root / f"step-{step:06d}"


def _clear_leftovers(root: Path) -> None:
    """A kill's leftovers: .tmp-/.trash- folders, a pruned one without marker (rlpipe's names
    only: a user's ``step-000001-notes/`` stays)."""
    if root.is_dir():
        for stale in root.iterdir():
            if stale.is_symlink() or not stale.is_dir():
                continue
            if LEFTOVER.fullmatch(stale.name) or (STEP.fullmatch(stale.name)
                                                  and not (stale / MARKER).is_file()):
                shutil.rmtree(stale, ignore_errors=True)


def _write_error(exc: BaseException, run_dir: Path, tmp: Path, final: Path) -> BaseException:
    """Remove the half-written folder; a full disk (any I/O failure) becomes one line."""
    shutil.rmtree(tmp, ignore_errors=True)
    if not io_failure(exc):
        return exc
    newest, root = latest(run_dir), tmp.parent
    kept = f"; {newest.name} is intact" if newest is not None else ""
    free = shutil.disk_usage(root).free / 2**20 if root.is_dir() else float("nan")
    reason = " ".join(str(exc).split())[:300]
    return UserError(f"cannot write checkpoint {final} ({reason}; {free:.0f} MiB free){kept}: "
                     f"free some space and continue with {option('resume')}")


def _publish(run_dir: Path, tmp: Path, final: Path, keep: int) -> Path:
    _discard(final)  # a damaged checkpoint of the same step, from before a fallback
    tmp.rename(final)
    for old in complete(run_dir)[:-keep] if keep > 0 else []:
        _discard(old)
    if keep > 0:  # a resume never restarts a step at or before the oldest kept checkpoint
        journal.prune(run_dir, int(STEP.fullmatch(complete(run_dir)[0].name)[1]))
    return final


def complete(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (half-written ones have no marker and are skipped)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP.fullmatch(p.name) and not p.is_symlink()
             and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(STEP.fullmatch(p.name)[1]))


def latest(run_dir: Path) -> Path | None:
    found = complete(run_dir)
    return found[-1] if found else None


def verify(path: Path) -> str | None:
    """None if ``path`` matches its manifest (every file present, same size and sha256), else
    what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}"
    if "state.pt" not in files:
        return f"{MANIFEST} lists no state.pt"
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want.get("size"):
            return f"{name} has {file.stat().st_size} bytes, {want.get('size')} expected"
        if _digest(file)["sha256"] != want.get("sha256"):
            return f"{name} does not match its sha256"
    return None


def choose(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact complete checkpoint, and the newer ones skipped with the reason."""
    skipped = []
    for path in reversed(complete(run_dir)):
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDS).is_dir()


def load_sharded(path: Path, shards: dict) -> dict:
    """Fill ``shards`` (the same layout `save_sharded` was given, this run's tensors: plain or
    DTensors of any world size) from ``path`` in place, then return the saved state."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(shards, checkpoint_id=str(Path(path) / SHARDS))
    except Exception as exc:  # noqa: BLE001 - DCP names missing or mismatched keys in its text
        reason = " ".join(str(exc).split())[:300]
        raise UserError(f"checkpoint {path} does not match this run ({reason}); was it written "
                        f"with another model or LoRA config?") from exc
    return _saved_state(path)


def load(path: Path, modules: dict) -> dict:
    """Load weights into ``modules`` (plain or FSDP-sharded; strict on the saved keys) and return
    the saved state."""
    for name, module in modules.items():
        file = path / f"{name}.safetensors"
        if not file.is_file():
            raise UserError(f"checkpoint {path} has no {file.name}")
        saved = _unreadable(path, file.name, load_file, str(file))
        unknown = set(saved) - {n for n, _ in module.named_parameters()}
        if unknown:
            raise UserError(f"checkpoint {file} does not match the model: unknown keys such as "
                            f"{sorted(unknown)[0]!r} (was it written with another config?)")
        load_full_state(module, saved)
    return _saved_state(path)


def _saved_state(path: Path) -> dict:
    """``state.pt``, which must be the state of the step its folder is named after."""
    state = _unreadable(path, "state.pt", torch.load, Path(path) / "state.pt", weights_only=True)
    named = STEP.fullmatch(Path(path).name)
    if named and (not isinstance(state, dict) or state.get("step") != int(named[1])):
        held = state.get("step") if isinstance(state, dict) else type(state).__name__
        raise UserError(f"checkpoint {path}: its state.pt holds step {held}, not "
                        f"{int(named[1])}; move that folder out of the run directory to resume "
                        f"from the checkpoint before it")
    return state


def _unreadable(path: Path, name: str, read, *args, **kwargs):
    """``read(*args, **kwargs)``; a file that matches its manifest but does not load (written
    corrupt, or replaced along with the manifest) is one line naming what to do."""
    try:
        return read(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - pickle, safetensors and zip errors have no common base
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UserError(f"checkpoint {path}: {name} does not load ({type(exc).__name__}: "
                        f"{reason}); move that folder out of the run directory to resume from "
                        f"the checkpoint before it") from exc
