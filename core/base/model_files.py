"""Checks of a Hugging Face model folder before transformers reads it, and one-line load errors.

transformers reports a broken folder with many exception types (OSError, ValueError, KeyError,
``SafetensorError``, RuntimeError, TypeError) and messages that rarely name the file. Here:

- ``config.json`` (and ``tokenizer_config.json``) must be UTF-8 JSON objects; ``config.json``
  needs a ``model_type`` unless the folder brings its own code;
- a folder that brings its own code (``auto_map`` in either file) is refused unless its
  ``trust_remote_code`` setting is true: transformers is always called with an explicit
  ``trust_remote_code``, so it never asks ``[y/N]`` on the terminal;
- every ``*.safetensors`` file's header is read (not its tensors): a truncated or corrupt file is
  named before transformers sees it;
- `loading` turns whatever a load raises into a `UserError` naming the folder.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from rlpipe.core.base.files import read_text
from rlpipe.core.base.errors import UserError, describe

_MAX_HEADER = 100 * 2**20  # safetensors refuses headers above 100 MB as well


def read_json_object(file: Path) -> dict:
    """A UTF-8 JSON file holding an object; anything else is a `UserError` naming the file."""
    try:
        value = json.loads(read_text(file))
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: invalid JSON: {exc.msg} (line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{file}: unreadable JSON: {describe(exc)}") from None
    if not isinstance(value, dict):
        raise UserError(f"{file}: expected a JSON object, got a {type(value).__name__}")
    return value


def check_remote_code(path: Path, trust_remote_code: bool, setting: str) -> None:
    """Refuse a folder whose config.json or tokenizer_config.json names its own code
    (``auto_map``) unless ``trust_remote_code``; ``setting`` is the config key that allows it."""
    files = [name for name in ("config.json", "tokenizer_config.json")
             if (path / name).is_file() and "auto_map" in read_json_object(path / name)]
    if files and not trust_remote_code:
        raise UserError(f"{path} needs remote code (auto_map in {' and '.join(files)}); "
                        f"set {setting}: true if you trust it")


def check_model_dir(path: Path, trust_remote_code: bool = False,
                    setting: str = "models.actor.trust_remote_code") -> dict:
    """The folder's config.json, checked (see the module docstring); returns it."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face model folder (no config.json)")
    config = read_json_object(path / "config.json")
    check_remote_code(path, trust_remote_code, setting)
    model_type = config.get("model_type")
    if "auto_map" not in config and not (isinstance(model_type, str) and model_type):
        raise UserError(f"{path / 'config.json'}: no model_type (a string); not a transformers "
                        f"model config")
    return config


def check_safetensors(file: Path) -> None:
    """Read a safetensors header and check that the file holds every byte it promises."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(n))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        need = 8 + n + max(ends, default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise UserError(f"{file}: not a valid safetensors file (truncated or corrupt: "
                        f"{describe(exc)})") from None
    if not isinstance(need, int) or need > size:
        raise UserError(f"{file}: truncated safetensors file ({size} bytes; its header "
                        f"promises {need})")


def check_weights(path: Path) -> None:
    """`check_safetensors` on every ``*.safetensors`` file of the folder."""
    for file in sorted(Path(path).glob("*.safetensors")):
        check_safetensors(file)


def check_finite(model, path: Path) -> None:
    """Loaded weights that hold NaN or inf are one line naming the first such tensor: they
    would turn every log-prob, value and reward into NaN a step later, far from the cause."""
    import torch

    with torch.no_grad():
        bad = next((n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())),
                   None)
    if bad is not None:
        raise UserError(f"{path}: the weights hold NaN or inf (first in {bad}); was the model "
                        f"saved from a diverged run?")


@contextlib.contextmanager
def loading(path: Path, what: str):
    """Whatever a transformers load raises becomes one `UserError` line naming ``path``."""
    try:
        yield
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad folder
        if "ignore_mismatched_sizes" in str(exc):   # its text points at a report of its own
            raise UserError(f"{path}: cannot load {what}: the weights' shapes differ from its "
                            f"config.json (an edited vocab_size or hidden_size?); transformers' "
                            f"load report above lists each tensor") from exc
        raise UserError(f"{path}: cannot load {what}: {describe(exc)}") from exc
