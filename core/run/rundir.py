"""Run-directory safety: where rlpipe may write, and what ``--overwrite`` may delete.

rlpipe writes a marker file, ``.rlpipe-run`` (JSON: rlpipe version, kind, creation time), into
every output directory it creates. It writes only into a new or empty directory, or into one that
holds its marker and nothing but the names it writes itself (`RUN_LAYOUT`, `RM_LAYOUT`), at its
top level and in the folders only rlpipe writes into (``final/``, ``samples/``, ``report/``,
``checkpoints/`` and each checkpoint's folders).
``--overwrite`` deletes exactly those entries and nothing else; it never follows a symbolic link,
and never touches the working directory or one of its parents, the home directory, ``/``, or a
folder that holds a model, data or config file the run reads. A directory that holds only the
marker and the config (no metric row: the run failed before its first step) is reused without
``--overwrite``.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp()) / "run"
>>> state(d, RUN_LAYOUT)
'missing'
>>> d.mkdir(); write_marker(d, "run"); (d / "config.yaml").write_text("run: {}")
7
>>> state(d, RUN_LAYOUT)
'unstarted'
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rlpipe.core.base.errors import UserError, option
from rlpipe.core.run.runlock import LOCK

MARKER = ".rlpipe-run"


@dataclass(frozen=True)
class Layout:
    """What one kind of output directory may hold (glob patterns on top-level names), and in
    which of its folders rlpipe alone writes (``inside``: a folder glob relative to the
    directory, and the names it may hold, folders with a trailing ``/``)."""
    kind: str                       # the marker's "kind"
    label: str                      # what error messages call it
    patterns: tuple[str, ...]       # every top-level entry rlpipe may write
    dirs: tuple[str, ...]           # the patterns that may be folders
    unstarted: tuple[str, ...]      # entries of a directory whose run never finished a step
    inside: tuple[tuple[str, tuple[str, ...]], ...] = ()


STEP_DIGITS = "[0-9]" * 6   # checkpoints/step-000042 (`rlpipe.core.run.checkpoint.STEP`)
# safetensors writes each file as .tmpXXXXXX beside it, then renames it: there while a save
# runs (another process may look then), and left behind by a kill
SAFETENSORS_TMP = ".tmp*"
# what save_pretrained writes for a model, its tokenizer or a peft adapter
HF_FOLDER = ("config.json", "generation_config.json", "model*.safetensors",
             "model.safetensors.index.json", "pytorch_model*.bin", "tokenizer*",
             "special_tokens_map.json", "vocab*", "merges.txt", "added_tokens.json", "*.model",
             "chat_template.*", "adapter_*", "README.md", SAFETENSORS_TMP)
RUN_LAYOUT = Layout(
    "run", "run directory",
    (MARKER, LOCK, "config.yaml", "plan.json", "metrics.jsonl", "metrics.jsonl.tmp", "checkpoints",
     "final", ".tmp-final", ".trash-final", "report", "tensorboard", "wandb", "samples",
     "journal"),
    ("checkpoints", "final", ".tmp-final", ".trash-final", "report", "tensorboard", "wandb",
     "samples", "journal"),
    (MARKER, LOCK, "config.yaml", "plan.json", "metrics.jsonl", "tensorboard", "wandb",
     "samples"),
    # tensorboard/ and wandb/ are those libraries' own, .tmp-final/ a cut `publish`: not looked
    # into
    (("final", HF_FOLDER),
     ("samples", ("step-*.jsonl", "eval-step-*.jsonl", "*.jsonl.tmp")),
     ("journal", ("step_*.jsonl",)),   # rlpipe.core.step.journal
     ("report", ("*.png", "samples.md")),
     ("checkpoints", tuple(f"{kind}step-{STEP_DIGITS}{more}/" for kind in ("", ".tmp-", ".trash-")
                           for more in ("", "[0-9]"))),   # step-NNNNNN (to 9 999 999 steps)
     ("checkpoints/*", ("COMPLETE", "manifest.json", "state.pt", "*.safetensors", SAFETENSORS_TMP,
                        "policy/", "dcp/")),
     ("checkpoints/*/policy", HF_FOLDER),
     ("checkpoints/*/dcp", ("*.distcp", ".metadata*"))))
RM_LAYOUT = Layout(  # rlpipe train-rm: a save_pretrained classifier, its tokenizer, metrics.jsonl
    "reward_model", "train-rm output", (MARKER, "metrics.jsonl", *HF_FOLDER), (),
    (MARKER, "metrics.jsonl"))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlpipe")
    except PackageNotFoundError:
        return "unknown"


def write_marker(path: Path, kind: str, **extra) -> None:
    """Write ``path/.rlpipe-run``, or add ``extra`` entries to the one there."""
    info = read_marker(path) or {"rlpipe": _version(), "kind": kind,
                                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (Path(path) / MARKER).write_text(json.dumps({**info, **extra}) + "\n")


def read_marker(path: Path) -> dict | None:
    """The marker's content; ``{}`` for an unreadable marker, None without one."""
    file = Path(path) / MARKER
    if not file.is_file() or file.is_symlink():
        return None
    try:
        info = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def output_path(raw, key: str) -> Path:
    """The absolute output directory of ``raw``; refuses a symbolic link and an existing file."""
    path = Path(os.path.abspath(Path(raw).expanduser()))
    if path.is_symlink():
        raise UserError(f"{key}: {path} is a symbolic link; rlpipe does not write through links, "
                        f"give the real directory ({path.resolve()})")
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}: {path} exists and is a file, not a directory")
    return path.resolve()


def input_paths(cfg) -> list[Path]:
    """Every path in a config tree (dataclasses, dicts and lists of `Path` values), resolved."""
    found = []
    if isinstance(cfg, Path):
        found.append(cfg.expanduser().resolve())
    elif dataclasses.is_dataclass(cfg):
        for f in dataclasses.fields(cfg):
            found += input_paths(getattr(cfg, f.name))
    elif isinstance(cfg, dict):
        for value in cfg.values():
            found += input_paths(value)
    elif isinstance(cfg, (list, tuple)):
        for value in cfg:
            found += input_paths(value)
    return found


def check_not_protected(out: Path, reads, key: str) -> None:
    """Refuse ``/``, the home directory and its parents, the working directory and its parents,
    and any folder that is or holds a path the run reads."""
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    why = None
    if out == Path(out.anchor):
        why = "the filesystem root"
    elif out == cwd or out in cwd.parents:
        why = "the working directory" if out == cwd else "a parent of the working directory"
    elif out == home or out in home.parents:
        why = "your home directory" if out == home else "a parent of your home directory"
    else:
        for path in reads:
            path = Path(path).expanduser().resolve()
            if out == path or out in path.parents:
                why = f"{'' if out == path else 'a folder holding '}{path}, which this run reads"
                break
    if why:
        raise UserError(f"{key}: refusing to use {out} as the output directory: it is {why}; "
                        f"choose another {key}")


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def foreign_entries(path: Path, layout: Layout) -> list[str]:
    """Entries rlpipe would not have written there (links, unknown names, wrong types): at the
    top level, and in the folders of ``layout.inside`` (as paths relative to ``path``)."""
    bad = [_foreign(entry, entry.name, layout.patterns, layout.dirs)
           for entry in sorted(path.iterdir())]
    for folder, names in layout.inside:
        files = tuple(n for n in names if not n.endswith("/"))
        dirs = tuple(n[:-1] for n in names if n.endswith("/"))
        for where in sorted(path.glob(folder)):
            if where.is_dir() and not where.is_symlink():
                bad += [_foreign(entry, entry.relative_to(path).as_posix(), files + dirs, dirs)
                        for entry in sorted(where.iterdir())]
    return [b for b in bad if b]


def _foreign(entry: Path, shown: str, patterns, dirs) -> str | None:
    """``shown`` (with ``/`` or `` (link)``) when ``entry`` is not one of ``patterns``, a
    folder where ``dirs`` says so and a file elsewhere, and not a link; else None."""
    if not entry.is_symlink() and not entry.exists():
        return None   # gone since it was listed (a running run publishing a checkpoint)
    is_dir = entry.is_dir() and not entry.is_symlink()
    if not entry.is_symlink() and _matches(entry.name, patterns) and is_dir == _matches(entry.name, dirs):
        return None
    return shown + ("/" if is_dir else " (link)" if entry.is_symlink() else "")


def state(path: Path, layout: Layout) -> str:
    """``missing``, ``empty``, ``unstarted`` (marker, config, no metric row), ``run`` (an rlpipe
    output with results), or ``foreign: REASON`` (not rlpipe's: never written to or deleted)."""
    if not path.exists():
        return "missing"
    names = {p.name for p in path.iterdir()} - {LOCK}
    if not names:
        return "empty"
    marker = read_marker(path)
    if marker is None:
        return f"foreign: no {MARKER} marker"
    if marker.get("kind", layout.kind) != layout.kind:
        return f"foreign: its {MARKER} marker says {marker.get('kind')!r}"
    bad = foreign_entries(path, layout)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return f"foreign: it holds {', '.join(bad[:3])}{more}, which rlpipe does not write"
    metrics = path / "metrics.jsonl"
    no_rows = not metrics.is_file() or metrics.stat().st_size == 0
    return "unstarted" if names <= set(layout.unstarted) and no_rows else "run"


def check_output(out: Path, layout: Layout, overwrite: bool, resume: bool, key: str,
                 reads=()) -> str:
    """The directory's `state` if rlpipe may use it as asked, else a one-line `UserError`."""
    if overwrite and resume:
        raise UserError(f"{key}: {option('overwrite')} deletes the run that {option('resume')} (or run.resume: "
                        f"auto) would continue; pass only one of them")
    check_not_protected(out, reads, key)
    found = state(out, layout)
    if found.startswith("foreign"):
        what = (f"{option('overwrite')} deletes only what rlpipe created" if overwrite else
                "rlpipe writes only into a new or empty directory or one it created")
        raise UserError(f"{key}: {out} is not empty and not an rlpipe {layout.label} "
                        f"({found.split(': ', 1)[1]}); {what}: choose another {key}")
    if found == "run" and not (overwrite or resume):
        hint = f", or {option('resume')} to continue it" if layout is RUN_LAYOUT else ""
        raise UserError(f"{key}: {out} is not empty (an earlier {layout.label}); choose another "
                        f"{key}, pass {option('overwrite')} to replace it{hint}")
    return found


def clear(out: Path, layout: Layout) -> None:
    """Delete rlpipe's entries of a checked directory (the marker last); the folder stays."""
    bad = foreign_entries(out, layout)
    if bad or read_marker(out) is None:  # checked just before; a second look costs nothing
        raise UserError(f"{out} changed while rlpipe was checking it; nothing was deleted")
    for entry in sorted(out.iterdir(), key=lambda p: p.name == MARKER):
        if entry.name == LOCK:  # held by this process: the lock stays with the folder
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def prepare(out: Path, layout: Layout, found: str) -> None:
    """Make ``out`` ready for a new output: clear an earlier one, create it, write the marker."""
    if found == "run":
        clear(out, layout)
    elif found == "unstarted" and (out / "metrics.jsonl").is_file():
        (out / "metrics.jsonl").unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, layout.kind)


def publish(tmp: Path, final: Path) -> None:
    """Put folder ``tmp`` in the place of ``final`` (which may exist): at every moment either the
    old or the new folder is there whole, or neither (a kill between the renames: the next
    --resume rewrites it).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for name in ("final", ".tmp-final"):
    ...     (d / name).mkdir(); _ = (d / name / "w").write_text(name)
    >>> publish(d / ".tmp-final", d / "final"); sorted(p.name for p in d.iterdir())
    ['final']
    >>> (d / "final" / "w").read_text()
    '.tmp-final'
    """
    trash = final.with_name(".trash-" + final.name)
    if final.exists():
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
    tmp.rename(final)
    shutil.rmtree(trash, ignore_errors=True)


def clear_leftovers(out: Path) -> None:
    """Remove what a killed run of rlpipe's left half-written at the top of run directory
    ``out`` (checkpoint folders: `rlpipe.core.run.checkpoint`): ``.tmp-final/``, ``.trash-final/``,
    ``*.jsonl.tmp``, and a ``final/`` its marker does not record as finished."""
    for name in (".tmp-final", ".trash-final"):
        shutil.rmtree(out / name, ignore_errors=True)
    for tmp in [out / "metrics.jsonl.tmp", *(out / "samples").glob("*.jsonl.tmp")]:
        tmp.unlink(missing_ok=True)
    final = out / "final"
    if final.is_dir() and not final.is_symlink() and finished_step(out) is None:
        shutil.rmtree(final)


def finished_step(out: Path) -> int | None:
    """The step a run's ``final/`` was saved at (recorded in the marker), if it has one."""
    marker = read_marker(out) or {}
    step = marker.get("finished_step")
    return step if isinstance(step, int) and (out / "final").is_dir() else None


# ---- resuming with a changed config ------------------------------------------------------------

# Changes a checkpoint cannot follow (its weights, data order, RNG or reward statistics need them).
FIXED = re.compile(r"^(models\.(actor|critic)\.(path|init|dtype|lora|shared_backbone)(\..*)?|"
                   r"data\.prompts|run\.seed|advantage\.name|reward\.normalize|"
                   r"rewards\.\d+\.(name|label))$")  # distributed.nproc: checked on loading
SILENT = {"run.steps", "run.output_dir", "run.resume", "log.progress"}


def flatten(tree, prefix: str = "") -> dict:
    """``{"a": {"b": [1]}}`` -> ``{"a.b.0": 1}`` (empty containers kept as values)."""
    if isinstance(tree, dict) and tree:
        items = tree.items()
    elif isinstance(tree, list) and tree:
        items = enumerate(tree)
    else:
        return {prefix[:-1]: tree}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def config_changes(saved: dict, new: dict) -> dict[str, tuple]:
    """``{dotted key: (saved, new)}`` for every leaf that differs (`SILENT` keys left out)."""
    a, b = flatten(saved), flatten(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in SILENT}


def resume_changes(out: Path, new: dict, key: str = "run.output_dir") -> dict[str, tuple]:
    """The changes from ``out/config.yaml`` to ``new``; refuses those a checkpoint cannot follow."""
    import yaml

    file = out / "config.yaml"
    try:
        saved = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        saved = None
    if not isinstance(saved, dict):
        why = "does not read as a mapping" if file.is_file() else "is missing"
        raise UserError(f"{key}: cannot resume {out}: its config.yaml {why}, so the settings its "
                        f"checkpoints depend on cannot be checked; restore it, or start a new "
                        f"run elsewhere")
    changes = config_changes(saved, yaml.safe_load(yaml.safe_dump(new, sort_keys=False)))
    fixed = [k for k in changes if FIXED.match(k)]
    if fixed:
        raise UserError(f"{key}: cannot resume {out} with changed {', '.join(fixed)} (the run's "
                        f"checkpoints depend on them); restore them, or start a new run elsewhere")
    return changes
