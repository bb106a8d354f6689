"""Stages given as Python objects, and the record of what ran.

``Pipeline(cfg, collector=..., rewards=[...], advantage=..., loss=...)`` (and `rlpipe.train`) take
any stage as an object; it replaces the config's section for that stage, whose plugin is then not
imported (a config may leave the section out; ``rewards`` may then be absent). A stage object is

- an instance (a reward or advantage ``nn.Module``, a ``LossModule``, a collector), used as it is;
- a class or a ``functools.partial`` of one, built like a plugin when the models exist: keyword
  arguments from the partial, ``ctx`` (`rlpipe.core.base.context.RunContext`) if it asks for it -- the
  way to pass a collector, which needs the actor;
- for rewards, also a plain function ``f(prompts, responses, **batch) -> list[float]`` (a lambda,
  or a partial binding its keyword arguments), wrapped like a reward entry point; an entry of
  ``rewards`` is an object or ``(label, weight, object)``.

Each object is shape-checked like an entry point of its group (`registry.check_shape`), so a wrong
interface is one `UserError` naming the stage and what is missing. Whether a critic is built comes
from the advantage object's declared ``needs_critic`` (`registry.declared`).

The config passed on records each object as its section: ``name: module:QualName`` (a reference
`load_config` can import again, `rlpipe.core.contracts.references`) with its constructor arguments -- exact
for a class or partial; for an instance, the values of attributes named like its constructor's
parameters. `stage_record` heads ``config.yaml`` with each stage's origin (plugin, distribution,
version) and says which stages that file cannot rebuild.

>>> import functools
>>> from rlpipe.plugins.advantages import GRPO
>>> section = stage_section("advantages", functools.partial(GRPO, scale_std=False), "advantage")
>>> section.name, section.args, section.resolved.spec.label
('rlpipe.plugins.advantages.grpo:GRPO', {'scale_std': False}, 'rlpipe.plugins.advantages.grpo:GRPO (a Python object)')
>>> stage_section("advantages", 3, "advantage")
Traceback (most recent call last):
...
rlpipe.core.contracts.registry.PluginError: advantage: builtins:int (a Python object): wrong shape: expected a torch.nn.Module subclass (a TensorDict module), got <class 'int'>
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from rlpipe.core.contracts import registry
from rlpipe.core.config.checks import PLUGIN_GROUPS, resolve_plugin
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.references import ReferenceSpec
from rlpipe.core.config.settings import Config, PluginConfig, RewardConfig

try:
    _VERSION = version("rlpipe")
except PackageNotFoundError:  # a checkout on sys.path, not installed
    _VERSION = "(not installed)"
_PLAIN = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class ObjectSpec(ReferenceSpec):
    """A stage given as a Python object: the ``instance`` itself, or ``factory(**kwargs)``."""

    instance: object = field(default=None, compare=False, repr=False)
    factory: object = field(default=None, compare=False, repr=False)
    kwargs: tuple = field(default=(), compare=False)  # (name, value) pairs for the factory


def make(spec: ObjectSpec, ctx, label: str):
    """The stage object: the instance as given, or the factory called like a plugin constructor."""
    if spec.instance is not None:
        registry.tag(spec.instance, label)
        return spec.instance
    return registry.instantiate(spec.factory, dict(spec.kwargs), ctx, label)


def _name(obj) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def _plain(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _recordable(values: dict) -> tuple[dict, list[str]]:
    """``(args, missing)``: the plain values (numbers, strings, lists of them) that YAML records,
    and the names of the others."""
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if _plain(v)}
    return args, [k for k in values if k not in args]


def recover_args(instance) -> tuple[dict, list[str]]:
    """``(args, missing)``: constructor arguments read back from same-named attributes holding
    plain values; the parameters that could not be."""
    try:
        params = registry.init_params(type(instance))
    except (TypeError, ValueError):  # a constructor without a readable signature
        return {}, ["(its constructor has no readable signature)"]
    return _recordable({name: getattr(instance, name, dataclasses.MISSING)
                        for name, p in params.items() if p.kind is not p.VAR_KEYWORD})


def _rebuild_note(name: str, missing: list[str]) -> str:
    module, qualname = name.split(":", 1)
    if "<" in qualname:
        return f"{name} is a lambda or is defined inside a function: not importable by name"
    if module == "__main__":
        return f"{name} is defined in the script that ran (__main__): not importable by name"
    if missing:
        return (f"constructor argument(s) {', '.join(missing)} of {name} could not be read back "
                f"from the object")
    return ""


def describe_object(group: str, obj, where: str) -> tuple[registry.Plugin, dict]:
    """``(plugin, args)`` for a stage object (see the module docstring): shape-checked like an
    entry point of ``group``; ``args`` are the constructor arguments to record."""
    func, kwargs = obj, {}
    if isinstance(obj, functools.partial):
        if obj.args:
            raise UserError(f"{where}: a functools.partial with positional arguments; bind "
                            f"keyword arguments only")
        func, kwargs = obj.func, dict(obj.keywords)
    built = inspect.isclass(func) or inspect.isfunction(func)  # else an instance, used as it is
    instance = None if built else func
    name = _name(func if built else type(func))
    spec = ObjectSpec(group, name, name, "a Python object", "")
    try:
        shaped = registry.check_shape(spec, func if built else type(func))
    except registry.PluginError as exc:
        raise registry.PluginError(f"{where}: {exc}") from None
    args, missing = _recordable(kwargs) if built else recover_args(instance)
    spec = dataclasses.replace(spec, note=_rebuild_note(name, missing), instance=instance,
                               factory=shaped if built else None, kwargs=tuple(kwargs.items()))
    return registry.Plugin(spec, instance if instance is not None else shaped), args


def stage_section(group: str, obj, where: str, section_cls=None, **fields):
    """A config section recording ``obj`` (``name: module:QualName`` and its arguments), already
    resolved to it."""
    plugin, args = describe_object(group, obj, where)
    section = (section_cls or PluginConfig)(name=plugin.spec.name, args=args, **fields)
    section.resolved = plugin
    return section


def _reward_sections(rewards) -> list:
    if not isinstance(rewards, (list, tuple)):
        raise UserError(f"rewards: expected a list of reward objects or (label, weight, object) "
                        f"tuples, got {type(rewards).__name__}")
    sections = []
    for i, entry in enumerate(rewards):
        label, weight, obj = entry if isinstance(entry, tuple) and len(entry) == 3 else (None, 1.0, entry)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise UserError(f"rewards.{i}: weight must be a finite number, got {weight!r}")
        if label is None:
            target = obj.func if isinstance(obj, functools.partial) else obj
            label = getattr(target, "__name__", type(target).__name__)
            label = label if label.isidentifier() else f"reward_{i}"
        sections.append(stage_section("rewards", obj, f"rewards.{i}", RewardConfig,
                                      weight=float(weight), label=str(label)))
    return sections


def apply(cfg, collector=None, rewards=None, advantage=None, loss=None, environment=None):
    """A copy of ``cfg`` whose sections are replaced by the stage objects given (None: the
    config's section); a `UserError` for an object of the wrong shape, or no reward at all."""
    given = {"collector": collector, "advantage": advantage, "loss": loss,
             "environment": environment}
    changes = {key: stage_section(PLUGIN_GROUPS[key], obj, key)
               for key, obj in given.items() if obj is not None}
    if rewards is not None:
        changes["rewards"] = _reward_sections(rewards)
    cfg = dataclasses.replace(cfg, **changes)
    labels = [r.key for r in cfg.rewards]
    if not labels:
        raise UserError("rewards: list at least one reward plugin (or pass rewards=[...] to "
                        "Pipeline)")
    if len(set(labels)) != len(labels):
        raise UserError(f"rewards: duplicate reward labels {labels}; pass (label, weight, object)")
    return cfg


def _sections(cfg):
    for key, group in PLUGIN_GROUPS.items():
        value = getattr(cfg, key)
        if isinstance(value, list):
            yield from ((f"{key}.{i}", group, s) for i, s in enumerate(value))
        elif value is not None:
            yield key, group, value


def save_config(cfg: Config, path: Path) -> None:
    """``config.yaml``: a comment recording each stage as it ran (`stage_record`), then
    the resolved config."""
    path.write_text(stage_record(cfg) + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def stage_record(cfg) -> str:
    """The comment heading ``config.yaml``: each stage as it ran, and what cannot be rebuilt."""
    lines, notes = [f"# Written by rlpipe {_VERSION}. Stages as they ran:"], []
    for key, group, section in _sections(cfg):
        spec = resolve_plugin(section, group).spec
        lines.append(f"#   {key}: {spec.label}")
        if getattr(spec, "note", ""):
            notes.append(f"#   {key}: {spec.note}")
    if notes:
        lines += ["# This file cannot rebuild every stage of this run:", *notes]
    return "\n".join(lines) + "\n"
