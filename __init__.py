"""rlpipe: PPO for language models from a reward signal, as a pipeline of pluggable TensorDict stages.

>>> from rlpipe import load_config, train            # doctest: +SKIP
>>> run_dir = train(load_config("examples/tiny/config.yaml"))  # doctest: +SKIP
"""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import rlpipe` stays cheap (no torch import) for the CLI's --help
    if name in ("load_config", "Config"):
        from rlpipe.core.config import settings as config

        return getattr(config, name)
    if name == "UserError":  # what the Python API raises for a user mistake (the CLI: exit 2)
        from rlpipe.core.base.errors import UserError

        return UserError
    if name in ("train", "Pipeline"):
        from rlpipe.core.run import pipeline

        return getattr(pipeline, name)
    if name in ("Callback", "Hooks", "default_callbacks"):  # a loop of your own (docs/compose.md)
        from rlpipe.core.run import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module 'rlpipe' has no attribute {name!r}")
