"""The config reference, read from the code: every setting's type, default, range and one-line
help, from the config dataclasses (`num(...)`/`opt(...)` field metadata in `rlpipe.core.config.settings`)
and from the plugins' signatures and ``Args:`` docstrings. ``rlpipe config --defaults``,
``rlpipe config --explain KEY`` and the docs' config page (``python -m rlpipe.tools.explain``) all
print from here, so none of them can drift from what the loader accepts.

>>> print(explain("train.lr"))
train.lr: float, default 1.0e-05, range > 0
  AdamW learning rate of the actor
>>> print(explain("collector.top_k"))   # the default collector's argument
collector.top_k: int, default 0, range >= 0 (collector hf)
  sample from the k most likely tokens only (0: off)
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from rlpipe.core.contracts import registry
from rlpipe.core.config.settings import Config, RewardConfig
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.yamlconf import rest_field, rule_text, yaml_key

# The plugin a section gets when the config names none (`Config`'s defaults), by group.
SECTIONS = {"collector": "collectors", "advantage": "advantages", "loss": "losses"}
KIND = {"collectors": "collector", "rewards": "reward", "advantages": "advantage", "losses": "loss",
        "environments": "environment"}
# Optional plugin sections (null by default): the built-in plugin whose arguments they list.
OPTIONAL = {"environment": ("environments", "tools")}


@dataclass(frozen=True)
class Setting:
    key: str
    type: str
    default: Any          # `REQUIRED` when the key has none
    range: str | None
    help: str
    section: bool = False  # a section of further keys (``kl``, ``models.actor``)
    plugin: str = ""       # a plugin's argument: ``collector hf``


REQUIRED = "required"


def _nested(tp):
    """The dataclass inside ``tp`` (``X``, ``X | None``), else None."""
    return next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)


def type_text(tp) -> str:
    """``int``, ``float | null``, ``never | auto``, ``list[str] | str``: a hint as a reader says it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return type_text(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_text(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if tp is Path:
        return "path"
    if tp is inspect.Parameter.empty:
        return "any"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return REQUIRED
    if dataclasses.is_dataclass(value) and rest_field(type(value)) is not None:
        return {"name": value.name}  # a plugin section: its default plugin
    return None if dataclasses.is_dataclass(value) else value


def settings(cls=Config, prefix: str = "") -> list[Setting]:
    """Every setting of the config tree under ``cls``, sections first, in declaration order;
    a plugin section lists its default plugin's arguments."""
    out, hints = [], typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if f.metadata.get("rest"):
            continue
        key, tp = prefix + yaml_key(f), hints[f.name]
        nested = _nested(tp) or (RewardConfig if key == "rewards" else None)
        out.append(Setting(key, "list" if key == "rewards" else
                           ("section" if nested else type_text(tp)), _default(f),
                           rule_text(f, tp), f.metadata.get("help", ""), bool(nested)))
        if key == "rewards":
            out += settings(RewardConfig, "rewards.N.")
        elif key in SECTIONS:  # its name defaults to the section's plugin, then its arguments
            name = _default(f)["name"]
            out += [dataclasses.replace(s, default=name) for s in settings(nested, key + ".")]
            out += plugin_settings(SECTIONS[key], name, key + ".")
        elif nested is not None:
            out += settings(nested, key + ".")
            if key in OPTIONAL:  # off by default: the built-in plugin's arguments, as an example
                out += plugin_settings(*OPTIONAL[key], key + ".")
    return out


def arg_help(obj) -> dict[str, str]:
    """``{argument: help}`` from the ``Args:`` sections of ``obj``'s docstring and its bases'."""
    out = {}
    for klass in reversed(getattr(obj, "__mro__", (obj,))):
        doc = inspect.cleandoc(klass.__dict__.get("__doc__") or "" if isinstance(klass, type)
                               else obj.__doc__ or "")
        if "\nArgs:\n" not in f"\n{doc}":
            continue
        block = f"\n{doc}".split("\nArgs:\n", 1)[1]
        name = None
        for line in block.splitlines():
            entry = re.match(r"    (\w+)(?: \([^)]*\))?: (.*)", line)
            if entry:
                name, out[entry.group(1)] = entry.group(1), entry.group(2).strip()
            elif name and line.startswith("        "):
                out[name] += " " + line.strip()
            elif line.strip() or name:
                break
    return out


def plugin_settings(group: str, name: str, prefix: str = "", obj=None) -> list[Setting]:
    """A plugin's constructor arguments as settings (type, default, `Bound` range, help)."""
    obj = obj if obj is not None else registry.load(group, name)
    helps, out = arg_help(obj), []
    try:  # string annotations (``from __future__ import annotations``) resolved, Annotated kept
        hints = typing.get_type_hints(obj.__init__ if isinstance(obj, type) else obj,
                                      include_extras=True)
    except Exception:  # noqa: BLE001 -- a plugin's unresolvable hint: shown as written
        hints = {}
    for arg, p in registry.init_params(obj).items():
        if p.kind is p.VAR_KEYWORD or (p.kind is p.KEYWORD_ONLY and p.default is p.empty
                                       and not isinstance(obj, type)):
            continue  # **batch; a reward function's keyword without default names a column
        hint = hints.get(arg, p.annotation)
        bound = next((m for m in getattr(hint, "__metadata__", ()) if hasattr(m, "rule")), None)
        rule = bound.rule if bound is not None and bound.rule else None
        default = REQUIRED if p.default is p.empty else p.default
        out.append(Setting(prefix + arg, type_text(hint), default, rule, helps.get(arg, ""),
                           plugin=f"{KIND[group]} {name}"))
    return out


def with_plugin_defaults(cfg: Config) -> dict:
    """``cfg.to_dict()`` with every plugin section's unset arguments at their defaults: what
    ``rlpipe config CONFIG`` prints (the plugins' signatures hold those defaults, not the file)."""
    out = cfg.to_dict()
    for key in SECTIONS:
        out[key] = _filled(out[key], getattr(cfg, key))
    out["rewards"] = [_filled(given, r) for given, r in zip(out["rewards"], cfg.rewards)]
    return out


def _filled(given: dict, section) -> dict:
    if section.resolved is None:
        return given
    params = registry.init_params(section.resolved.obj).items()
    return {**given, **{k: p.default for k, p in params if k not in given
                        and p.default is not p.empty and p.kind is not p.VAR_KEYWORD}}


def _value(value) -> str:
    if value is REQUIRED or value == REQUIRED:
        return REQUIRED
    text = yaml.safe_dump(str(value) if isinstance(value, Path) else value,
                          default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix(" ...").strip()


def _line(s: Setting) -> str:
    parts = [s.type] + ([f"default {_value(s.default)}"] if not s.section else [])
    parts += [f"range {s.range}"] if s.range else []
    plugin = f" ({s.plugin})" if s.plugin else ""
    return f"{s.key}: {', '.join(parts)}{plugin}\n  {s.help}"


def explain(key: str, cfg: Config | None = None) -> str:
    """One setting: ``KEY: type, default, range`` and its help. ``rewards.0.ARG`` and plugin
    arguments need the plugin: the one ``cfg`` names, else the section's default; a bare plugin
    name (``answer_match``) lists that plugin's arguments."""
    known = {s.key: s for s in settings()}
    section, _, rest = key.partition(".")
    if cfg is not None and (section in SECTIONS or section == "rewards"):
        plugin_cfg = getattr(cfg, section)
        if section == "rewards":
            index, _, rest = rest.partition(".")
            plugin_cfg = cfg.rewards[int(index)] if index.isdigit() and int(index) < len(
                cfg.rewards) else None
            key = f"rewards.N.{rest}" if rest in {"name", "weight", "label", "function"} else key
        if plugin_cfg is not None and plugin_cfg.resolved is not None and key not in known:
            group = "rewards" if section == "rewards" else SECTIONS[section]
            found = {s.key: s for s in plugin_settings(group, plugin_cfg.name or plugin_cfg.key,
                                                       key.rsplit(".", 1)[0] + ".",
                                                       obj=plugin_cfg.resolved.obj)}
            known.update(found)
    if key in OPTIONAL:  # an optional plugin section: its keys and the built-in's arguments
        return "\n".join(_line(s) for s in known.values()
                         if s.key == key or s.key.startswith(key + "."))
    if key in known:
        return _line(known[key])
    for group in ("collectors", "rewards", "advantages", "losses", "environments"):
        name, _, arg = key.partition(".")
        if name in registry.find(group):
            found = plugin_settings(group, name, f"{name}.")
            picked = [s for s in found if not arg or s.key == key]
            if picked:
                return "\n".join(_line(s) for s in picked)
    raise UserError(f"--explain {key}: not a setting; `rlpipe config --defaults` lists them "
                    "(a plugin's own: --explain PLUGIN, e.g. --explain answer_match)")


def defaults_yaml() -> str:
    """Every setting with its default, as a YAML config whose comments are the help lines."""
    lines, off = [], ()  # sections that default to null: their keys commented out
    for s in settings():
        if s.key.startswith("rewards.N."):
            continue
        depth = s.key.count(".")
        pad, name = "  " * depth, s.key.rsplit(".", 1)[-1]
        if s.key.startswith(off):
            pad = "# " + pad[2:]
        elif s.section and s.default is None:
            off = (*off, s.key + ".")
        comment = f"  # {s.help}" + (f" [{s.range}]" if s.range else "")
        if s.section:
            lines.append(f"{pad}{name}:{comment}")
        elif s.key == "rewards":
            lines.append(f"{name}: []{comment}")
        elif s.default == REQUIRED:
            lines.append(f"{pad}{name}:  # REQUIRED: {s.help}")
        else:
            lines.append(f"{pad}{name}: {_value(s.default)}{comment}")
    return "\n".join(lines) + "\n"


def _table(rows: list[Setting], first: str = "key") -> list[str]:
    out = [f"| {first} | type | default | range | help |", "|---|---|---|---|---|"]
    for s in rows:
        help_text = re.sub(r"\(([\w-]+)\.md\)", r"([\1](\1.md))", s.help).replace("|", "\\|")
        default = "" if s.section else f"`{_value(s.default)}`".replace("|", "\\|")
        out.append(f"| `{s.key}` | {s.type.replace('|', '/')} | {default} | "
                   f"{s.range or ''} | {help_text} |")
    return out


INTRO = """# Config reference

One YAML file per run. Unknown keys are errors. Paths written in the file are relative to the
file; paths given as `KEY=VALUE` overrides are relative to the working directory. On the command
line: `rlpipe config --defaults` prints all of this as a YAML file, `rlpipe config --explain KEY`
one setting, and `rlpipe config CONFIG` what a config resolves to, plugin defaults included.

This page is generated from the code (`python -m rlpipe.tools.explain > docs/config.md`; a test
fails when it is stale): the help is the `help` of each field in `rlpipe.core.config.settings`, and a
plugin's arguments come from its signature and the `Args:` section of its docstring.
"""


def reference_markdown() -> str:
    """docs/config.md: the config tree section by section, then every built-in plugin."""
    out, rows = [INTRO], [s for s in settings() if not s.key.startswith(tuple(
        f"{k}." for k in (*SECTIONS, *OPTIONAL))) or s.key.endswith(".name")]
    top = [s for s in rows if "." not in s.key]
    out += ["## Sections", "", *_table(top, "section"), ""]
    for section in top:
        inner = [s for s in rows if s.key.startswith(section.key + ".")]
        if inner:
            out += [f"## `{section.key}`", "", section.help, "", *_table(inner), ""]
    out += ["## Plugins", "",
            "The built-in plugins' arguments: the keys of a plugin section besides `name` "
            "(`collector: {name: hf, max_new_tokens: 64}`; for a reward, besides `weight` and "
            "`label` too).", ""]
    for group in ("collectors", "rewards", "advantages", "losses", "environments"):
        for name, specs in sorted(registry.find(group).items()):
            if specs[0].builtin:
                obj = registry.load(group, name)
                summary = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
                out += [f"### {KIND[group]} `{name}`", "", summary, "",
                        *_table(plugin_settings(group, name, "", obj), "argument"), ""]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
