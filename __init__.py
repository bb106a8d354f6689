"""rlpipe: PPO for language models from a reward signal, as a pipeline of pluggable TensorDict stages.

>>> from rlpipe import load_config, train            # doctest: +SKIP
>>> run_dir = train(load_config("examples/tiny/config.yaml"))  # doctest: +SKIP
"""

import os as _os

__version__ = "0.1.0"

# CPU tensors of 2 MB and more on transparent huge pages: a fresh vocabulary-sized gradient or
# optimizer buffer then costs 512x fewer page faults (measured: 2.7x faster to allocate and fill
# a [49152, 576] float32 gradient, 1.8x faster LM-head weight-gradient matmul). Results do not
# change. torch reads this once, at import, so it acts when rlpipe is imported before torch (the
# CLI always is); THP_MEM_ALLOC_ENABLE=0 opts out.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def __getattr__(name):  # lazy: `import rlpipe` stays cheap (no torch import) for the CLI's --help
    if name in ("load_config", "Config"):
        from rlpipe.core import config

        return getattr(config, name)
    if name == "UserError":  # what the Python API raises for a user mistake (the CLI: exit 2)
        from rlpipe.core.errors import UserError

        return UserError
    if name in ("train", "Pipeline"):
        from rlpipe.core import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'rlpipe' has no attribute {name!r}")
