"""Losses, importable by name to compose in Python (``Pipeline(loss=...)``).
The same classes are rlpipe's built-in entry points; each is imported on first use.

>>> from rlpipe.plugins.losses import PPOLoss
>>> PPOLoss.__module__
'rlpipe.plugins.losses.ppo'
"""

import importlib

_EXPORTS = {
    "PPOLoss": "ppo:PPOLoss",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
