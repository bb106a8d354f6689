"""The built-in health rules (`rules`), registered under the entry-point group ``rlpipe.health``
exactly like a third-party rule; core knows only the `Rule` contract and finds them through the
registry.

>>> from rlpipe.plugins.health import ClipHigh
>>> ClipHigh.__module__
'rlpipe.plugins.health.rules'
"""

from rlpipe.plugins import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "KLExplosion": "rules:KLExplosion",
    "KLNonzeroAtStart": "rules:KLNonzeroAtStart",
    "RewardHackingLength": "rules:RewardHackingLength",
    "RewardHackingLoop": "rules:RewardHackingLoop",
    "ValueNotLearning": "rules:ValueNotLearning",
    "ClipHigh": "rules:ClipHigh",
    "EntropyCollapse": "rules:EntropyCollapse",
    "GradSpikes": "rules:GradSpikes",
    "Truncation": "rules:Truncation",
    "NanSkips": "rules:NanSkips",
    "FlatGroups": "rules:FlatGroups",
})
