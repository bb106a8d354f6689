"""Losses, importable by name to compose in Python (``Pipeline(loss=...)``).
The same classes are rlpipe's built-in entry points; each is imported on first use.

>>> from rlpipe.plugins.losses import PPOLoss
>>> PPOLoss.__module__
'rlpipe.plugins.losses.ppo'
"""

from rlpipe.plugins import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "PPOLoss": "ppo:PPOLoss",
    "GSPOLoss": "gspo:GSPOLoss",
    "CISPOLoss": "cispo:CISPOLoss",
})
