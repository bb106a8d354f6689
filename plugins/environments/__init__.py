"""Environments, importable by name to compose in Python; the same classes are rlpipe's built-in
entry points (group ``rlpipe.environments``), each imported on first use.

>>> from rlpipe.plugins.environments import ToolsEnvironment
>>> ToolsEnvironment.__module__
'rlpipe.plugins.environments.tools'
"""

from rlpipe.plugins import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "ToolsEnvironment": "tools:ToolsEnvironment",
})
