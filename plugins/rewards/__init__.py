"""Reward plugins, importable by name to compose in Python (``Pipeline(rewards=[...])``).
The same classes are rlpipe's built-in entry points; each is imported on first use.

>>> from rlpipe.plugins.rewards import LengthPenalty
>>> LengthPenalty.__module__
'rlpipe.plugins.rewards.length'
"""

from rlpipe.plugins import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "LengthPenalty": "length:LengthPenalty",
    "LoopPenalty": "loop:LoopPenalty",
    "RewardModel": "reward_model:RewardModel",
    "AnswerMatch": "answer_match:AnswerMatch",
})
