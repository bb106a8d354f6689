"""Advantage estimators, importable by name to compose in Python (``Pipeline(advantage=...)``).
The same classes are rlpipe's built-in entry points; each is imported on first use.

>>> from rlpipe.plugins.advantages import GAE
>>> GAE.__module__
'rlpipe.plugins.advantages.gae'
"""

import importlib

_EXPORTS = {
    "GAE": "gae:GAE",
    "GRPO": "grpo:GRPO",
    "RLOO": "rloo:RLOO",
    "ReinforcePP": "reinforce_pp:ReinforcePP",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
