"""Plugins named by reference instead of by entry point, loaded exactly like entry points.

A plugin section names its plugin in one of three ways:

- ``name: gae`` -- an installed entry point (`rlpipe.core.contracts.registry`);
- ``name: my_pkg.rewards:brevity`` -- ``module:attribute`` of any importable module (any plugin
  section: collector, rewards, advantage, loss);
- for rewards, ``path: ./my_reward.py`` with ``function: score`` -- a function or class in a
  Python file (relative to the config file; to the working directory as an override).

Either reference goes through the registry's shape check (`registry.check_shape`): a plain reward
function is wrapped into a module, the section's arguments are checked against the signature, and
an import error names the file and line. Errors name the plugin as ``module:attr (dist version)``.

>>> plugin = load_reference("advantages", "rlpipe.plugins.advantages.gae:GAE")
>>> plugin.obj.__name__, plugin.spec.label.startswith("rlpipe.plugins.advantages.gae:GAE (rlpipe ")
('GAE', True)
>>> load_reference("advantages", "no_such_module_x:GAE")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
rlpipe.core.contracts.registry.PluginError: no_such_module_x:GAE (not from an installed distribution): failed to import no_such_module_x:GAE: ModuleNotFoundError: No module named 'no_such_module_x'; module:attribute imports 'no_such_module_x' from the installed packages and the working directory (...), as python -m does; for a file elsewhere use `path: FILE.py` and `function: NAME`
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from rlpipe.core.contracts import registry
from rlpipe.core.base.errors import UserError, describe

_REFERENCE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


@dataclass(frozen=True)
class ReferenceSpec(registry.PluginSpec):
    """A plugin found by ``module:attr``, by file, or given as a Python object (`rlpipe.core.config.compose`).
    ``note``: why ``config.yaml`` cannot rebuild it (empty when it can)."""

    note: str = ""

    @property
    def label(self) -> str:
        origin = " ".join(part for part in (self.dist, self.version) if part)
        return f"{self.value} ({origin})" if origin else self.value


def is_reference(name) -> bool:
    """A ``module:attr`` name (entry-point names have no colon).

    >>> is_reference("my_pkg.rewards:brevity"), is_reference("gae")
    (True, False)
    """
    return isinstance(name, str) and ":" in name


def plugin_args(section) -> dict:
    """The constructor arguments of a section: its free keys, less a reward file's ``path``."""
    if getattr(section, "function", None) is None:
        return dict(section.args)
    return {k: v for k, v in section.args.items() if k != "path"}


def spec_name(section) -> str:
    """What a section names: an entry point, ``module:attr``, or ``FILE:function``."""
    function = getattr(section, "function", None)
    return section.name if function is None else f"{section.args.get('path')}:{function}"


def load(section, group: str) -> registry.Plugin:
    """The plugin ``section`` names (see the module docstring), imported and shape-checked."""
    function = getattr(section, "function", None)
    if function is not None:
        if "path" not in section.args:
            raise UserError(f"rewards: function {function!r} needs `path`, the Python file "
                            f"that defines it")
        return load_file(group, Path(section.args["path"]), function)
    if is_reference(section.name):
        return load_reference(group, section.name)
    return registry.get(group, section.name)


@functools.lru_cache(maxsize=1)
def _owners() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution(module: str) -> tuple[str, str]:
    """``(distribution, version)`` that installs the top-level package of ``module``."""
    dists = _owners().get(module.split(".")[0], [])
    if not dists:
        return "not from an installed distribution", ""
    try:
        return dists[0], importlib.metadata.version(dists[0])
    except importlib.metadata.PackageNotFoundError:
        return dists[0], "?"


def load_reference(group: str, value: str) -> registry.Plugin:
    """``module:attr`` imported through an entry point of ``group``, as installed plugins are."""
    if not _REFERENCE.fullmatch(value):
        raise UserError(f"plugin reference {value!r}: expected module:attribute "
                        f"(for example my_pkg.rewards:brevity)")
    dist, version = _distribution(value.split(":")[0])
    spec = ReferenceSpec(group, value, value, dist, version)
    try:
        return registry.load_spec(spec)
    except registry.PluginError as exc:
        top = value.split(".")[0].split(":")[0]
        if not (isinstance(exc.__cause__, ModuleNotFoundError) and exc.__cause__.name == top):
            raise
        cwd = Path.cwd()
        if str(cwd) in sys.path or not ((cwd / f"{top}.py").is_file() or (cwd / top).is_dir()):
            raise registry.PluginError(
                f"{exc}; module:attribute imports {top!r} from the installed packages and the "
                f"working directory ({cwd}), as python -m does; for a file elsewhere use "
                f"`path: FILE.py` and `function: NAME`") from exc.__cause__
    sys.path.insert(0, str(cwd))  # as `python -m` puts it first: the `rlpipe` script does not
    return registry.load_spec(spec)


def load_file(group: str, path: Path, function: str) -> registry.Plugin:
    """``function`` (a function or class) of the Python file ``path``, imported as a module of its
    own (``rlpipe_file_<hash>_<stem>``, kept in `sys.modules`) and shape-checked."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"reward file not found: {path}")
    if path.suffix != ".py":   # importlib has no loader for other names
        raise UserError(f"reward file {path} is not a Python file: `path` names a .py file that "
                        f"defines {function!r}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:12]
    spec = ReferenceSpec(group, f"{path}:{function}", f"{path}:{function}", "file sha256", digest)
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"rlpipe_file_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}_{stem}"
    module = sys.modules.get(module_name)
    if getattr(module, "__rlpipe_digest__", None) != digest:  # new, or the file changed
        module = _exec_file(path, module_name, spec)
        module.__rlpipe_digest__ = digest
    if not hasattr(module, function):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == module_name)
        raise UserError(f"{path} has no function {function!r}; it defines: "
                        f"{', '.join(defined) or 'no functions'}")
    return registry.Plugin(spec, registry.check_shape(spec, getattr(module, function)))


def _exec_file(path: Path, module_name: str, spec: ReferenceSpec):
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses, pickle and typing look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - user code, sys.exit included, is reported
        del sys.modules[module_name]
        raise registry.PluginError(f"{spec.label}: failed to import {path}: {describe(exc)}"
                                   f"{registry.source_line(exc)}") from exc
    return module


def check_reward_file(section, key: str, conv) -> None:
    """A reward section without ``name``: ``path`` + ``function``; ``path`` becomes absolute
    (relative to the config file, or to the working directory as an override)."""
    if section.name is not None:
        raise UserError(f"{key}: give either `name` (a plugin or module:attr) or `path` + "
                        f"`function` (a Python file), not both")
    if section.function is None:
        raise UserError(f"{key}: give `name` (a plugin or module:attr) or `path` + `function` "
                        f"(a function in a Python file)")
    if "path" not in section.args:
        raise UserError(f"{key}.function: needs `path`, the Python file that defines "
                        f"{section.function!r}")
    section.args["path"] = conv.path(section.args["path"], f"{key}.path")


def drop_foreign_args(section, key: str, group: str, cli_keys) -> None:
    """After ``KEY.name=OTHER`` on the command line: drop the section's arguments that the new
    plugin does not take (those given on the command line too are kept and checked), saying so
    on one line."""
    params = registry.init_params(load(section, group).obj)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    foreign = [arg for arg in plugin_args(section)
               if arg not in params and f"{key}.{arg}" not in cli_keys]
    for arg in foreign:
        del section.args[arg]
    kept = [arg for arg in plugin_args(section) if f"{key}.{arg}" not in cli_keys]
    if (foreign or kept) and os.environ.get("RANK", "0") == "0":
        said = [f"dropped {', '.join(f'{key}.{a}' for a in foreign)} (not arguments of "
                f"{section.name})"] if foreign else []
        said += [f"kept {', '.join(f'{key}.{a}={section.args[a]!r}' for a in kept)} from the "
                 f"config: check each means what you want for {section.name}"] if kept else []
        print(f"warning: {key}.name={section.name}: {'; '.join(said)}", file=sys.stderr)
