"""rlpipe's built-in plugins; each stage package exports its classes by name, imported on first use."""

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__all__, __getattr__)`` for ``package``, whose names (``exports``: name ->
    ``"submodule:attribute"``) are imported when first used.

    >>> names, get = lazy_exports("rlpipe.plugins.losses", {"PPOLoss": "ppo:PPOLoss"})
    >>> names, get("PPOLoss").__name__
    (['PPOLoss'], 'PPOLoss')
    """
    def __getattr__(name):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = exports[name].split(":")
        return getattr(importlib.import_module(f"{package}.{module}"), attr)

    return sorted(exports), __getattr__
