"""Plugin registry over Python entry points (built-ins included), flake8/fsspec style.

Finding plugins reads distribution metadata only, once per process: the scan of every ``rlpipe.*``
group is cached (keyed by ``RLPIPE_DISABLE_PLUGIN_AUTOLOAD`` and ``sys.path``; `refresh` forgets
it). A plugin is imported with `EntryPoint.load` when a config selects it (`get`, `load`) or when
`rlpipe plugins` asks for its status, and the loaded object is cached too. A plugin that fails to
import or has the wrong shape is reported as ``group:name (distribution version): reason`` and
does not take the others down. ``RLPIPE_DISABLE_PLUGIN_AUTOLOAD=1`` restricts the registry to
rlpipe's built-ins.

What core knows about a plugin is its contract (`rlpipe.core.contracts.kinds`: collectors,
advantages, rewards, losses); the optional methods of collectors and losses are listed with their
defaults in `DECLARED` and read through `declared`.

>>> from rlpipe.core.contracts import registry
>>> sorted(registry.find("advantages"))[:1]
['gae']
>>> plugin = registry.get("advantages", "gae")
>>> plugin.obj.__name__, plugin.spec.dist, registry.load("advantages", "gae") is plugin.obj
('GAE', 'rlpipe', True)
>>> registry.declared("losses", registry.load("losses", "ppo"), "set_kl") is not None
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import torch
from torch import nn
from torchrl.objectives import LossModule

from rlpipe.core.base.errors import UserError, describe
from rlpipe.core.contracts.reward_fn import wrap_reward_function
from rlpipe.core.contracts.rule import Rule

GROUPS = ("collectors", "rewards", "advantages", "losses", "health", "environments")
SINGULAR = {"collectors": "collector", "rewards": "reward", "advantages": "advantage",
            "losses": "loss", "health": "health rule", "environments": "environment"}
BUILTIN_DIST = "rlpipe"
DISABLE_ENV = "RLPIPE_DISABLE_PLUGIN_AUTOLOAD"


class PluginError(UserError):
    """A plugin that cannot be used: unknown, ambiguous, broken on import, or of the wrong shape."""


@dataclass(frozen=True)
class PluginSpec:
    """One entry point, as found in metadata (nothing imported yet)."""

    group: str
    name: str
    value: str       # "module:attr"
    dist: str
    version: str
    entry_point: EntryPoint | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"rlpipe.{self.group}:{self.name} ({self.dist} {self.version})"

    @property
    def builtin(self) -> bool:
        return self.dist == BUILTIN_DIST


def find(group: str) -> dict[str, list[PluginSpec]]:
    """Plugins of ``group`` by name, from metadata only. Names map to a list: two distributions
    may claim the same name, which `load` reports as a conflict."""
    if group not in GROUPS:
        raise PluginError(f"unknown plugin group {group!r}; groups: {', '.join(GROUPS)}")
    only_builtin = os.environ.get(DISABLE_ENV, "") not in ("", "0")
    return {name: list(specs) for name, specs in _scan(only_builtin, tuple(sys.path))[group].items()}


@functools.lru_cache(maxsize=8)
def _scan(only_builtin: bool, path: tuple[str, ...]) -> dict[str, dict[str, tuple[PluginSpec, ...]]]:
    """Every rlpipe entry point, by group and name, read from metadata once per ``(only_builtin,
    sys.path)``: a folder added to ``sys.path`` (a test's fake site) is a new key, seen without
    `refresh`; a distribution installed in-process into a folder already on it needs `refresh`."""
    del path  # only the cache key: `entry_points` reads the current sys.path
    found: dict[str, dict[str, list[PluginSpec]]] = {group: {} for group in GROUPS}
    for group in GROUPS:
        for ep in entry_points(group=f"rlpipe.{group}"):
            dist = ep.dist.name if ep.dist is not None else "unknown"
            version = ep.dist.version if ep.dist is not None else "?"
            spec = PluginSpec(group, ep.name, ep.value, dist, version, ep)
            if only_builtin and not spec.builtin:
                continue
            if spec not in found[group].setdefault(ep.name, []):
                found[group][ep.name].append(spec)
    return {group: {name: tuple(specs) for name, specs in sorted(by_name.items())}
            for group, by_name in found.items()}


def refresh() -> None:
    """Forget the cached metadata scan and loaded plugins (after installing a plugin in-process)."""
    _scan.cache_clear()
    _import.cache_clear()


def _check_collector(obj):
    if not inspect.isclass(obj):
        return "expected a class with collect(prompts) and sync_weights(model)"
    missing = [m for m in ("collect", "sync_weights") if not callable(getattr(obj, m, None))]
    return f"collector class lacks {', '.join(missing)}" if missing else None


def _check_module_class(obj):
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        return f"expected a torch.nn.Module subclass (a TensorDict module), got {obj!r}"
    return None


def _check_reward(obj):
    if inspect.isfunction(obj):
        return None
    return _check_module_class(obj)


def _check_loss(obj):
    if not (inspect.isclass(obj) and issubclass(obj, LossModule)):
        return f"expected a torchrl.objectives.LossModule subclass, got {obj!r}"
    return None


def _check_health_rule(obj):
    if not (inspect.isclass(obj) and issubclass(obj, Rule) and dataclasses.is_dataclass(obj)):
        return f"expected a dataclass subclassing rlpipe.core.contracts.rule.Rule, got {obj!r}"
    return None


def _check_environment(obj):
    if not (inspect.isclass(obj) and callable(getattr(obj, "reset", None))
            and callable(getattr(obj, "step", None))):
        return f"expected a class with reset(row, seed) and step(action) methods, got {obj!r}"
    return None


_CHECKS = {"collectors": _check_collector, "rewards": _check_reward,
           "advantages": _check_module_class, "losses": _check_loss, "health": _check_health_rule,
           "environments": _check_environment}


@functools.lru_cache(maxsize=None)
def _import(spec: PluginSpec):
    """Import one entry point (`EntryPoint.load`) and check its shape, once per spec (a failure
    is not cached: it is raised again on the next call); `PluginError` with provenance."""
    entry_point = spec.entry_point or EntryPoint(spec.name, spec.value, f"rlpipe.{spec.group}")
    try:
        obj = entry_point.load()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - third-party code, sys.exit included, is reported
        raise PluginError(f"{spec.label}: failed to import {spec.value}: {describe(exc)}"
                          f"{source_line(exc)}") from exc
    return check_shape(spec, obj)


def check_shape(spec: PluginSpec, obj):
    """``obj`` as a plugin of ``spec.group``: its shape checked (`PluginError` naming ``spec``), a
    plain reward function wrapped into a module class (`rlpipe.core.contracts.reward_fn.wrap_reward_function`)."""
    try:
        problem = _CHECKS[spec.group](obj)
    except Exception as exc:  # noqa: BLE001 - e.g. a metaclass that raises on inspection
        problem = describe(exc)
    if problem:
        raise PluginError(f"{spec.label}: wrong shape: {problem}")
    if spec.group == "rewards" and inspect.isfunction(obj):
        obj = wrap_reward_function(obj)
    return obj


def source_line(exc: BaseException) -> str:
    """`` (at FILE:LINE)``: where an import failed (the innermost frame outside importlib, or a
    SyntaxError's own position); empty when only importlib's frames are left.

    >>> source_line(SyntaxError("invalid syntax", ("my_reward.py", 3, 5, "def f(:")))
    ' (at my_reward.py:3)'
    """
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    import traceback

    core = os.path.dirname(os.path.abspath(__file__))  # rlpipe's own loading frames
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and "importlib" not in f.filename
              and os.path.dirname(os.path.abspath(f.filename)) != core]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def resolve(group: str, name: str) -> PluginSpec:
    """The unique entry point named ``name`` in ``group``; errors list what is available."""
    found = find(group)
    if name not in found:
        available = ", ".join(found) or "none installed"
        raise PluginError(f"unknown {SINGULAR[group]} plugin {name!r}; available: {available}")
    specs = found[name]
    if len(specs) > 1:
        owners = ", ".join(s.label for s in specs)
        raise PluginError(f"{SINGULAR[group]} plugin {name!r} is registered more than once: {owners}; "
                          f"uninstall one of them")
    return specs[0]


@dataclass(frozen=True)
class Plugin:
    """A resolved plugin: its entry point and the loaded object (a class; a plain reward function
    comes back wrapped in a module class)."""

    spec: PluginSpec
    obj: object


def get(group: str, name: str) -> Plugin:
    """The unique plugin ``name`` of ``group``, imported and shape-checked (cached)."""
    return load_spec(resolve(group, name))


def load_spec(spec: PluginSpec) -> Plugin:
    """The plugin an entry point (or a ``module:attr`` reference, `rlpipe.core.contracts.references`) names,
    imported and shape-checked (cached)."""
    return Plugin(spec, _import(spec))


def load(group: str, name: str):
    """Import and return the plugin object (a class; plain reward functions come back wrapped)."""
    return get(group, name).obj


# Optional attributes of collectors and losses, with the value core uses when a plugin has none;
# core reads them only through `declared`. (Advantages and rewards declare a contract alone:
# `rlpipe.core.contracts.kinds`.)
DECLARED = {
    # read through rlpipe.core.contracts.collector: the contract, then optional methods
    "collectors": {"contract": None, "close": None, "record_hidden": None,
                   "record_actor_log_prob": None, "sampling_view": None},
    # read through rlpipe.core.step.loss.contract_of: None means LossContract()'s defaults
    "losses": {"contract": None, "set_kl": None},
}


def declared(group: str, obj, name: str):
    """The optional attribute ``name`` that plugin ``obj`` (class or instance) of ``group``
    declares, or its documented default from `DECLARED`.

    >>> class Engine:
    ...     def close(self): ...
    >>> callable(declared("collectors", Engine, "close")), declared("collectors", object, "close")
    (True, None)
    """
    default = DECLARED[group][name]
    return getattr(obj, name, default)


def init_params(obj) -> dict[str, inspect.Parameter]:
    """Constructor parameters that a config may set (``self``, ``ctx`` and ``*args`` excluded)."""
    sig = inspect.signature(obj)
    return {name: p for name, p in sig.parameters.items()
            if name != "ctx" and p.kind is not inspect.Parameter.VAR_POSITIONAL}


def instantiate(obj, kwargs: dict, ctx=None, label: str = "plugin"):
    """Build a plugin: config keys as keyword arguments, plus ``ctx`` if the constructor asks.

    Whatever the constructor raises (``sys.exit`` included) becomes a `PluginError` naming
    ``label``; a `UserError` keeps its own message. The instance is tagged with ``label``."""
    with calling(label, "__init__"):
        if "ctx" in inspect.signature(obj).parameters:
            kwargs = {**kwargs, "ctx": ctx}
        instance = obj(**kwargs)
    tag(instance, label)
    return instance


LABEL_ATTR = "rlpipe_plugin_label"


def tag(instance, label: str) -> None:
    """Remember on ``instance`` which plugin it is, for errors raised when core calls it later."""
    try:
        setattr(instance, LABEL_ATTR, label)
    except Exception:  # noqa: BLE001 - __slots__ or a frozen object: `label_of` falls back
        pass


def label_of(obj) -> str:
    """The label `instantiate` gave ``obj`` (a bound method's owner counts), else its class."""
    owner = getattr(obj, "__self__", obj)
    label = getattr(owner, LABEL_ATTR, None)
    if isinstance(label, str):
        return label
    cls = owner if inspect.isclass(owner) else type(owner)
    return f"plugin {cls.__module__}.{cls.__qualname__}"


def is_oom(exc: BaseException) -> bool:
    """A failed allocation: CUDA's error, the one torch's CPU allocator raises, or Python's."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


@contextlib.contextmanager
def calling(label: str, what: str = "call"):
    """Run plugin code: an exception or ``sys.exit`` inside becomes a `PluginError` naming the
    plugin (``label``) and the method (``what``). `UserError` and KeyboardInterrupt pass as they are,
    and so does running out of memory, marked with the innermost plugin's label.

    >>> try:
    ...     with calling("loss (rlpipe.losses:x (dist 1.0))", "forward"):
    ...         raise SystemExit(3)
    ... except PluginError as exc:
    ...     print(exc)
    loss (rlpipe.losses:x (dist 1.0)) failed in forward: sys.exit(3)
    """
    try:
        yield
    except (UserError, KeyboardInterrupt):
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - plugin code: report, do not crash
        if is_oom(exc):   # not the plugin's fault: `rlpipe.core.run.oom` says where and what to change
            exc.rlpipe_plugin = getattr(exc, "rlpipe_plugin", label)
            raise
        raise PluginError(f"{label} failed in {what}: {describe(exc)}") from exc


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` for a plugin object or one of its bound methods, under `calling`."""
    what = getattr(fn, "__name__", "forward") if hasattr(fn, "__self__") else "forward"
    with calling(label_of(fn), what):
        return fn(*args, **kwargs)


def status_table() -> list[tuple[PluginSpec, str]]:
    """Every installed plugin with ``ok`` or the reason it is unusable (imports each one)."""
    rows = []
    for group in GROUPS:
        for name, specs in find(group).items():
            for spec in specs:
                if len(specs) > 1:
                    rows.append((spec, "conflict: name registered by several distributions"))
                    continue
                try:
                    _import(spec)
                    rows.append((spec, "ok"))
                except PluginError as exc:
                    rows.append((spec, "broken: " + str(exc).split(": ", 1)[1]))
    return rows
