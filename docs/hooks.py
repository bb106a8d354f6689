"""MkDocs hook: lets mkdocstrings (griffe) find the package ``rlpipe``.

The repository root *is* the package (setuptools ``package-dir = {"rlpipe" = "."}``), so no
folder named ``rlpipe`` exists for griffe to find; a temporary folder holding a link named
``rlpipe`` to the root, put on ``sys.path`` before mkdocstrings starts, stands in for one."""

import sys
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

_TMP = None


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    global _TMP
    if _TMP is None:
        _TMP = tempfile.TemporaryDirectory(prefix="rlpipe-docs-")
        (Path(_TMP.name) / "rlpipe").symlink_to(Path(config.config_file_path).resolve().parent)
        sys.path.insert(0, _TMP.name)
    python = config.plugins["mkdocstrings"].config.setdefault("handlers", {}).setdefault("python", {})
    python["paths"] = [_TMP.name]
    return config
