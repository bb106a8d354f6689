"""Hugging Face Hub model IDs wherever a model folder is taken (``ModelPath`` config fields).

A model path is a local folder as before, or a Hub ID (``HuggingFaceTB/SmolLM2-135M-Instruct``)
that is not a local folder. The ID is resolved when the config is loaded, so that every later check
(context length, remote code, safetensors headers) reads a real folder:

- from the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``; the ``models--ORG--NAME/snapshots/REV/`` layout), without network;
- else, unless ``HF_HUB_OFFLINE`` is set, downloaded into that cache (config, tokenizer and
  safetensors files only) by ``huggingface_hub.snapshot_download``;
- else one `UserError` line naming the ID, ``HF_HUB_OFFLINE`` and the cache folder.

``trust_remote_code`` stays as configured: a downloaded folder with its own code is refused like a
local one (`rlpipe.core.base.model_files.check_remote_code`).

>>> looks_like_id("HuggingFaceTB/SmolLM2-135M-Instruct"), looks_like_id("./model"), looks_like_id("a/b/c")
(True, False, False)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NewType

from rlpipe.core.base.errors import UserError, describe

ModelPath = NewType("ModelPath", Path)  # a config field holding a model folder or a Hub ID

_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def looks_like_id(value) -> bool:
    """``ORG/NAME``: the shape of a Hub model ID (a relative path may look the same; a local
    folder of that name wins)."""
    return (isinstance(value, str) and bool(_ID.fullmatch(value)) and ".." not in value
            and not value.endswith((".", "-")))


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_id(repo_id: str, key: str) -> Path:
    """The local snapshot folder of the Hub model ``repo_id`` (see the module docstring)."""
    from huggingface_hub import snapshot_download

    cache = hub_cache()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache (huggingface_hub raises several types)
        pass
    if offline():
        raise UserError(f"{key}: {repo_id!r} is not a local folder, and the Hugging Face model "
                        f"{repo_id} is not in the cache {cache} (HF_HUB_OFFLINE is set: nothing "
                        f"is downloaded); download it once online or give a folder")
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_FILES))
    except Exception as exc:  # noqa: BLE001 - network, auth, unknown repository
        raise UserError(f"{key}: {repo_id!r} is not a local folder and cannot be downloaded from "
                        f"the Hugging Face Hub into {cache}: {describe(exc)}") from None


def model_path(conv, value, key: str) -> Path:
    """A ``ModelPath`` config value: the folder `Converter.path` finds, else the Hub ID resolved."""
    try:
        return conv.path(value, key)
    except UserError:
        if not looks_like_id(value):
            raise
    return resolve_id(value, key)


def find_model(path, key: str) -> Path:
    """A model folder given in Python (``RewardModel(path=...)``): the folder, or a Hub ID."""
    if Path(path).expanduser().is_dir() or not looks_like_id(str(path)):
        return Path(path).expanduser()
    return resolve_id(str(path), key)
