"""Advantage estimators, importable by name to compose in Python (``Pipeline(advantage=...)``).
The same classes are rlpipe's built-in entry points; each is imported on first use.

>>> from rlpipe.plugins.advantages import GAE
>>> GAE.__module__
'rlpipe.plugins.advantages.gae'
"""

from rlpipe.plugins import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "GAE": "gae:GAE",
    "GRPO": "grpo:GRPO",
    "RLOO": "rloo:RLOO",
    "ReinforcePP": "reinforce_pp:ReinforcePP",
    "TurnCredit": "turn:TurnCredit",
})
