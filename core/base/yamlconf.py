"""YAML files into typed dataclass trees: the generic part of rlpipe's config loading.

Strict YAML reading (duplicate keys are errors, YAML 1.2 floats such as ``3e-4``), dotted
``KEY=VALUE`` overrides, and `Converter`, which checks raw values against a dataclass's type hints
and the `Range` each numeric field carries in its metadata (``num(8, ">= 1")``). Every problem is a
`UserError` naming the dotted key.

>>> Range.parse("in [0, 1)").admits(1.0), str(Range.parse(">= 1"))
(False, '>= 1')
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rlpipe.core.base import hub
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.hub import ModelPath
from rlpipe.core.base.sources import resolve_package_model

INT64 = (-2**63, 2**63 - 1)
_NUM = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True)
class Range:
    """The interval a numeric field must lie in; ``None`` bounds are unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @classmethod
    def parse(cls, text: str) -> Range:
        """``"> 0"``, ``">= 1"``, ``"< 5"``, ``"<= 5"`` or ``"in [0, 1)"`` (the text `str` gives)."""
        one = re.fullmatch(rf"(>=|>|<=|<) ({_NUM})", text)
        if one:
            op, number = one.group(1), _number(one.group(2))
            if op.startswith(">"):
                return cls(low=number, low_open=op == ">")
            return cls(high=number, high_open=op == "<")
        two = re.fullmatch(rf"in ([\[(])({_NUM}), ({_NUM})([\])])", text)
        if not two:
            raise ValueError(f"not a range: {text!r}")
        return cls(_number(two.group(2)), _number(two.group(3)), two.group(1) == "(",
                   two.group(4) == ")")

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{self.low}, "
                    f"{self.high}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"{'<' if self.high_open else '<='} {self.high}"

    def admits(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def _number(text: str):
    return float(text) if "." in text else int(text)


def num(default, rule: str, help: str = ""):
    """A dataclass field with a default, a documented range and its one-line help:
    ``lr: float = num(1e-5, "> 0", "AdamW learning rate of the actor")``."""
    return field(default=default, metadata={"range": Range.parse(rule), "help": help})


def opt(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING, **metadata):
    """A dataclass field with its one-line help (the config reference, ``rlpipe config
    --explain``): ``seed: int = opt(0, "seeds torch, Python and the data order")``."""
    return field(default=default, default_factory=factory, metadata={"help": help, **metadata})


def rest():
    """The field of a plugin section that collects every key not declared before it."""
    return field(default_factory=dict, metadata={"rest": True})


def yaml_key(f: dataclasses.Field) -> str:
    """The key a field has in YAML (``kl.in`` is the field ``in_``: ``in`` is a Python keyword)."""
    return f.metadata.get("yaml", f.name)


def rest_field(cls) -> dataclasses.Field | None:
    return next((f for f in dataclasses.fields(cls) if f.metadata.get("rest")), None)


def rule_text(f: dataclasses.Field, tp) -> str | None:
    """The documented rule of a field: ``"> 0"``, ``"> 0 or null"``; None when it has no range."""
    rule = f.metadata.get("range")
    if rule is None:
        return None
    return f"{rule} or null" if type(None) in typing.get_args(tp) else str(rule)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Converter:
    """Checks and converts raw YAML values against type hints, naming the dotted key on error.
    Paths are resolved against ``base_dir``, or the working directory for keys in ``cli_keys``."""

    def __init__(self, base_dir: Path, cli_keys: set[str]):
        self.base_dir, self.cli_keys = base_dir, cli_keys

    def value(self, value, tp, key: str):
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is Any:
            return value
        if tp is ModelPath:  # a model folder or a Hugging Face Hub ID
            return hub.model_path(self, value, key)
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            options = [a for a in args if a is not type(None)]
            for option in options:
                try:
                    return self.value(value, option, key)
                except UserError:
                    if option is options[-1]:
                        raise
        if origin is Literal:
            if value not in args:
                raise UserError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
            return value
        if origin is list:
            if not isinstance(value, list):
                raise UserError(f"{key}: expected a list, got {type(value).__name__}")
            return [self.value(v, args[0], f"{key}.{i}") for i, v in enumerate(value)]
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise UserError(f"{key}: expected a mapping, got {type(value).__name__}")
            return value
        if dataclasses.is_dataclass(tp):
            return self.section(tp, {} if value is None else value, key)
        if origin is not None or not isinstance(tp, type):
            return value  # a hint this converter does not know (a plugin's Sequence[str], ...)
        return self.scalar(value, tp, key)

    def scalar(self, value, tp, key: str):
        if tp is Path:
            return self.path(value, key)
        ok = (isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))
              or (tp is float and _is_number(value)))
        if not ok:
            below = sorted(k for k in self.cli_keys if k.startswith(key + "."))
            if isinstance(value, dict) and below:
                raise UserError(f"override {below[0]}: {key} is a value, not a section")
            raise UserError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        if tp is float and not math.isfinite(value):
            raise UserError(f"{key}: must be finite, got {value!r}")
        if tp is int and not INT64[0] <= value <= INT64[1]:
            raise UserError(f"{key}: must fit in a 64-bit integer, got {value!r}")
        return float(value) if tp is float else value

    def path(self, value, key: str) -> Path:
        if not isinstance(value, (str, Path)):
            raise UserError(f"{key}: expected a path, got {type(value).__name__} {value!r}")
        if isinstance(value, str) and value.startswith("pkg:"):  # a model shipped in a package
            return resolve_package_model(value, key)
        from_cli = any(key == k or key.startswith(k + ".") for k in self.cli_keys)
        base = Path.cwd() if from_cli else self.base_dir
        try:
            path = Path(value).expanduser()
            path = path if path.is_absolute() else (base / path).resolve()
            found = path.exists()
        except (OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{key}: unusable path {str(value)!r}: {exc}") from None
        if not found:
            raise UserError(f"{key}: file not found: {path}")
        return path

    def section(self, cls, raw, key: str):
        if not isinstance(raw, dict):
            raise UserError(f"{key or 'config'}: expected a mapping, got {type(raw).__name__}")
        raw, hints = dict(raw), typing.get_type_hints(cls)
        fields = {yaml_key(f): f for f in dataclasses.fields(cls) if not f.metadata.get("rest")}
        extra = rest_field(cls)
        unknown = [k for k in raw if k not in fields]
        if extra is not None:  # fixed keys + free plugin arguments (checked later)
            raw = {**{k: raw[k] for k in fields if k in raw}, extra.name: {k: raw[k] for k in unknown}}
            fields[extra.name] = extra
        elif unknown:
            where, first = f"{key}." if key else "", sorted(unknown, key=str)[0]
            raise UserError(f"unknown key {where}{first}; valid keys here: {', '.join(fields)}")
        kwargs = {}
        for name, f in fields.items():
            sub = f"{key}.{name}" if key else name
            if name in raw:
                kwargs[f.name] = self.checked(f, hints[f.name], raw[name], sub)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise UserError(f"missing required key {sub}")
        return cls(**kwargs)

    def checked(self, f: dataclasses.Field, tp, value, key: str):
        """One field's value: a number is checked against the field's `Range`, then its type."""
        rule = f.metadata.get("range")
        if rule is not None and _is_number(value) and not rule.admits(value):
            finite = " and finite" if float in (tp, *typing.get_args(tp)) else ""
            null = " (or null)" if type(None) in typing.get_args(tp) else ""
            raise UserError(f"{key}: must be {rule}{finite}{null}, got {value!r}")
        return self.value(value, tp, key)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loading, plus YAML 1.2 floats: ``3e-4`` is a float, not the string '3e-4'."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _duplicate_key(node, where: str, path: str = "", seen=None) -> str | None:
    """The first key given twice in one mapping of the composed ``node`` tree, as one line."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: that subtree was checked already
        return None
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        children = [(f"{path}.{i}" if path else str(i), n) for i, n in enumerate(node.value)]
    elif isinstance(node, yaml.MappingNode):
        first, children = {}, []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            dotted = f"{path}.{key_node.value}" if path else key_node.value
            ident = (key_node.tag, key_node.value)
            if ident in first:
                return (f"{where}: duplicate key {dotted} (line {key_node.start_mark.line + 1}; "
                        f"first given on line {first[ident]})")
            first[ident] = key_node.start_mark.line + 1
            children.append((dotted, value_node))
    else:
        return None
    for child_path, child in children:
        found = _duplicate_key(child, where, child_path, seen)
        if found:
            return found
    return None


def _load_yaml(text: str, where: str = "<string>"):
    """Parse ``text``; a key given twice in one mapping is a `UserError` naming ``where``."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        duplicate = _duplicate_key(node, where)
        if duplicate:
            raise UserError(duplicate)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_problem(exc: Exception) -> tuple[str, str]:
    """A YAML error as ``(" (line L, column C)", problem)``, both on one line."""
    if isinstance(exc, RecursionError):
        return "", "nested too deeply"
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    return where, getattr(exc, "problem", None) or (str(exc).splitlines() or ["invalid"])[0]


def parse_overrides(overrides) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": 1, "c": "x"}``; values are parsed as YAML scalars. A
    ``(KEY, VALUE)`` pair (Python) sets the value as given.

    >>> parse_overrides(["run.steps=2", ("run.seed", 3)])
    {'run.steps': 2, 'run.seed': 3}
    """
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, (list, tuple)):
        raise UserError(f"overrides: a list of KEY=VALUE strings (or (KEY, VALUE) pairs), got "
                        f"{type(overrides).__name__} {str(overrides)[:60]!r}")
    parsed = {}
    for item in overrides:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            parsed[item[0].strip()] = item[1]
            continue
        if not isinstance(item, str):
            raise UserError(f"override {item!r}: expected a KEY=VALUE string or a (KEY, VALUE) "
                            f"pair, got {type(item).__name__}")
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"override {item!r} is not KEY=VALUE (for example run.steps=20)")
        try:
            parsed[key.strip()] = _load_yaml(text, f"override {item!r}") if text else ""
        except (yaml.YAMLError, RecursionError) as exc:
            where, problem = _yaml_problem(exc)
            raise UserError(f"override {item!r}: cannot parse value{where}: {problem}") from exc
    return parsed


def _set_dotted(raw: dict, dotted: str, value) -> None:
    """Set ``raw[a][b][0]...`` for ``a.b.0...``; list entries must exist, sections are created."""
    parts, node = dotted.split("."), raw
    if not all(parts):
        raise UserError(f"override {dotted}: empty part in the key")
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        if isinstance(node, list):
            if not (part.isascii() and part.isdigit()) or int(part) >= len(node):
                valid = f"0 to {len(node) - 1}" if node else "none: the list is empty"
                raise UserError(f"override {dotted}: {here} is a list, {part!r} is not one of its "
                                f"indices ({valid})")
            part = int(part)
        elif not isinstance(node, dict):
            raise UserError(f"override {dotted}: {here} is a value "
                            f"({type(node).__name__} {node!r}), not a section")
        if i == len(parts) - 1:
            node[part] = value
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}  # a missing or empty (null) section
            node = node[part]


def _read_yaml(path: Path) -> dict:
    """The top-level mapping of the YAML file ``path``; every problem is one `UserError` line."""
    try:
        if not path.is_file():
            raise UserError(f"{path}: not a file" if path.exists() else f"config file not found: {path}")
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (line {line})") from None
    try:
        raw = _load_yaml(text, str(path))
    except (yaml.YAMLError, RecursionError) as exc:
        where, problem = _yaml_problem(exc)
        raise UserError(f"{path}: malformed YAML{where}: {problem}") from exc
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections at the top level")
    return raw


def read_config_file(path, overrides=()) -> tuple[dict, set[str]]:
    """The YAML mapping of ``path`` with ``KEY=VALUE`` overrides applied, and the overridden keys."""
    raw = _read_yaml(Path(path))
    parsed = parse_overrides(overrides)
    for dotted, value in parsed.items():
        _set_dotted(raw, dotted, value)
    return raw, set(parsed)


def build_section(cls, raw: dict, base_dir: Path, cli_keys=(), key: str = ""):
    """Check and convert a raw mapping into the dataclass ``cls`` (for other YAML files, such as
    ``rlpipe train-rm``'s): unknown keys, types, Literals, ranges and input paths (relative to
    ``base_dir``, or to the working directory for dotted keys in ``cli_keys``) as for run configs."""
    return Converter(Path(base_dir), set(cli_keys)).section(cls, raw, key)
