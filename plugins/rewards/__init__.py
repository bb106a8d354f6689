"""Reward plugins, importable by name to compose in Python (``Pipeline(rewards=[...])``).
The same classes are rlpipe's built-in entry points; each is imported on first use.

>>> from rlpipe.plugins.rewards import LengthPenalty
>>> LengthPenalty.__module__
'rlpipe.plugins.rewards.length'
"""

import importlib

_EXPORTS = {
    "LengthPenalty": "length:LengthPenalty",
    "LoopPenalty": "loop:LoopPenalty",
    "RewardModel": "reward_model:RewardModel",
    "AnswerMatch": "answer_match:AnswerMatch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
