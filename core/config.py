"""One YAML file per run, turned into one typed config tree; dotted ``KEY=VALUE`` overrides.

Unknown keys, wrong types and missing files are errors naming the key. Each plugin section
(``collector``, ``rewards[i]``, ``advantage``, ``loss``) holds ``name`` plus keyword arguments for
that plugin's constructor, checked against its signature. Input paths written in the YAML file are
relative to the file; paths given as overrides are relative to the working directory.

>>> cfg = load_config("examples/tiny/config.yaml", ["run.steps=3"])   # doctest: +SKIP
>>> cfg.run.steps                                                      # doctest: +SKIP
3
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rlpipe.core import registry
from rlpipe.core.errors import UserError


@dataclass
class RunConfig:
    steps: int = 10                  # PPO steps (one rollout batch + update each)
    seed: int = 0
    output_dir: str = "runs/rlpipe"  # the run directory, relative to the working directory
    device: str = "auto"             # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    debug: bool = False              # validate the batch at every stage boundary
    resume: Literal["never", "auto"] = "never"   # auto: continue from the newest checkpoint


@dataclass
class LoraConfig:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"


@dataclass
class ModelConfig:
    path: Path                                      # a Hugging Face model folder (config.json, tokenizer)
    init: Literal["pretrained", "random"] = "pretrained"  # random: fresh weights from config.json
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None                  # set: train LoRA adapters (peft); the
                                                    # reference is the actor with adapters disabled
    gradient_checkpointing: bool = False            # recompute block activations in backward


@dataclass
class CriticConfig:
    path: Path | None = None   # None: a copy of the actor's backbone; else a model folder
    init: Literal["pretrained", "random"] = "pretrained"
    lora: LoraConfig | None = None
    shared_backbone: bool = False  # a value head on the actor's own backbone (combined loss)
    gradient_checkpointing: bool = False


@dataclass
class ReferenceConfig:
    offload: bool = False      # the frozen copy waits on CPU and visits the device for its forward


@dataclass
class ModelsConfig:
    actor: ModelConfig
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)


@dataclass
class DataConfig:
    prompts: Path             # .txt (one prompt per line) or .jsonl (a "prompt" field per line)
    batch_size: int = 8       # prompts per PPO step (samples = batch_size * collector n)
    shuffle: bool = True


@dataclass
class KLConfig:
    coef: float = 0.05                              # beta, or the adaptive controller's start
    estimator: Literal["k1", "k2", "k3"] = "k1"
    in_: Literal["reward", "loss"] = field(default="reward", metadata={"yaml": "in"})
    target: float | None = None                     # set: adaptive controller (Ziegler et al. 2019)
    horizon: int = 10000


@dataclass
class TrainConfig:
    epochs: int = 4                   # PPO epochs over each rollout batch
    minibatches: int = 2              # optimizer steps per epoch
    grad_accum: int = 1               # micro-batches per minibatch
    lr: float = 1e-5
    critic_lr: float = 5e-5
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    forward_batch_size: int = 16      # micro-batch for no-grad forwards over the rollout
    schedule: Literal["constant", "cosine"] = "constant"   # over run.steps x epochs x minibatches
    warmup_steps: int = 0             # linear warmup, in optimizer steps
    target_kl: float | None = None    # stop a step's epochs once policy/approx_kl exceeds it
    critic_warmup_steps: int = 0      # the first PPO steps train the critic only
    max_bad_steps: int = 3            # consecutive non-finite steps before the run stops


@dataclass
class PtxConfig:
    coef: float = 0.0                 # > 0: add coef x LM loss on `data` to each actor update
    data: Path | None = None          # .txt (one text per line) or .jsonl (a "text" field)
    batch_size: int = 4               # texts per optimizer step
    max_tokens: int = 256


@dataclass
class CheckpointConfig:
    every: int = 0                    # PPO steps between checkpoints (0: only the final policy)
    keep: int = 2                     # newest checkpoints kept


@dataclass
class ExportConfig:
    merge_lora: bool = True           # final/: LoRA merged into a copy (true) or the adapter only


@dataclass
class DistributedConfig:
    nproc: int = 1                    # processes on this machine; > 1 launches torchrun itself
    shard_frozen: bool = True         # FSDP-shard the frozen reference too (false: replicate it)
    bf16: bool = False                # FSDP mixed precision: bf16 compute, fp32 weights and reduction
    nnodes: int = 1                   # machines in the job; > 1 joins the rendezvous below
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous (required when nnodes > 1)
    rdzv_id: str = "rlpipe"           # job id shared by every node of one job
    timeout_s: float = 600.0          # a collective waiting longer than this fails the run


@dataclass
class LogConfig:
    progress: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "rlpipe"


@dataclass
class RewardSettings:
    clip: float | None = None      # clip the weighted score to [-clip, clip]
    normalize: bool = False        # running mean/std of the score across steps (checkpointed)


@dataclass
class PluginConfig:
    name: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    name: str
    weight: float = 1.0
    label: str | None = None          # metric/score_parts name; defaults to `name`
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.label or self.name


@dataclass
class Config:
    models: ModelsConfig
    data: DataConfig
    rewards: list[RewardConfig]
    run: RunConfig = field(default_factory=RunConfig)
    collector: PluginConfig = field(default_factory=lambda: PluginConfig("hf"))
    advantage: PluginConfig = field(default_factory=lambda: PluginConfig("gae"))
    loss: PluginConfig = field(default_factory=lambda: PluginConfig("ppo"))
    reward: RewardSettings = field(default_factory=RewardSettings)
    kl: KLConfig = field(default_factory=KLConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ptx: PtxConfig = field(default_factory=PtxConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        """Plain nested dict, plugin sections flattened as in the YAML (what ``config.yaml`` holds)."""
        return _dump(self)


_PLUGIN_SECTIONS = {PluginConfig: ("name",), RewardConfig: ("name", "weight", "label")}
_PLUGIN_GROUP = {"collector": "collectors", "advantage": "advantages", "loss": "losses",
                 "rewards": "rewards"}


def _dump(obj):
    if type(obj) in _PLUGIN_SECTIONS:
        fixed = {k: _dump(getattr(obj, k)) for k in _PLUGIN_SECTIONS[type(obj)]}
        return {**{k: v for k, v in fixed.items() if v is not None}, **_dump(obj.args)}
    if dataclasses.is_dataclass(obj):
        return {_yaml_key(f): _dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _dump(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_dump(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj


def _yaml_key(f: dataclasses.Field) -> str:
    """The key a field has in YAML (``kl.in`` is the field ``in_``: ``in`` is a Python keyword)."""
    return f.metadata.get("yaml", f.name)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


class _Converter:
    """Checks and converts raw YAML values against type hints, naming the dotted key on error."""

    def __init__(self, base_dir: Path, cli_keys: set[str]):
        self.base_dir, self.cli_keys = base_dir, cli_keys

    def value(self, value, tp, key: str):
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is Any:
            return value
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
            return self.section(tp, value, key)
        return self.scalar(value, tp, key)

    def scalar(self, value, tp, key: str):
        if tp is Path:
            if not isinstance(value, (str, Path)):
                raise UserError(f"{key}: expected a path, got {type(value).__name__} {value!r}")
            if isinstance(value, str) and value.startswith("pkg:"):  # a model shipped in a package
                from rlpipe.core.sources import resolve_package_model

                return resolve_package_model(value, key)
            path = Path(value).expanduser()
            from_cli = any(key == k or key.startswith(k + ".") for k in self.cli_keys)
            base = Path.cwd() if from_cli else self.base_dir
            path = path if path.is_absolute() else (base / path).resolve()
            if not path.exists():
                raise UserError(f"{key}: file not found: {path}")
            return path
        ok = (isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))
              or (tp is float and isinstance(value, int) and not isinstance(value, bool)))
        if not ok:
            raise UserError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return float(value) if tp is float else value

    def section(self, cls, raw, key: str):
        if not isinstance(raw, dict):
            raise UserError(f"{key or 'config'}: expected a mapping, got {type(raw).__name__}")
        raw = dict(raw)
        hints = typing.get_type_hints(cls)
        fields = {_yaml_key(f): f for f in dataclasses.fields(cls)}
        if cls in _PLUGIN_SECTIONS:  # fixed keys + free plugin arguments (checked later)
            fixed = _PLUGIN_SECTIONS[cls]
            raw = {**{k: raw.pop(k) for k in fixed if k in raw}, "args": raw}
        else:
            unknown = sorted(set(raw) - set(fields))
            if unknown:
                where = f"{key}." if key else ""
                raise UserError(f"unknown key {where}{unknown[0]}; valid keys here: "
                                f"{', '.join(fields)}")
        kwargs = {}
        for name, f in fields.items():
            sub = f"{key}.{name}" if key else name
            if name in raw:
                kwargs[f.name] = self.value(raw[name], hints[f.name], sub)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise UserError(f"missing required key {sub}")
        return cls(**kwargs)


def _check_plugin_args(section, key: str, group: str, conv: _Converter) -> None:
    """Check a plugin section's arguments against the plugin constructor's signature."""
    spec = registry.resolve(group, section.name)
    params = registry.init_params(registry.load(group, section.name))
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    for arg, value in section.args.items():
        if arg not in named and not takes_any:
            raise UserError(f"{key}.{arg}: unknown argument for plugin {spec.label}; "
                            f"accepted: {', '.join(named) or 'none'}")
        if arg in named and named[arg].annotation is not inspect.Parameter.empty:
            hint = named[arg].annotation
            if isinstance(hint, str):  # `from __future__ import annotations` in the plugin
                obj = registry.load(group, section.name)
                hint = typing.get_type_hints(obj.__init__ if inspect.isclass(obj) else obj).get(arg, Any)
            section.args[arg] = conv.value(value, hint, f"{key}.{arg}")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in section.args]
    if missing:
        raise UserError(f"{key}: plugin {spec.label} needs argument(s) {', '.join(missing)}")


def _set_dotted(raw: dict, dotted: str, value) -> None:
    parts, node = dotted.split("."), raw
    for i, part in enumerate(parts[:-1]):
        nxt = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(nxt, (dict, list)):
            raise UserError(f"override {dotted}: {'.'.join(parts[:i + 1])} is not a section")
        node = nxt
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise UserError(f"override {dotted}: no list entry {last}")
        node[int(last)] = value
    else:
        node[last] = value


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loading, plus YAML 1.2 floats: ``3e-4`` is a float, not the string '3e-4'."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _load_yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass


def parse_overrides(overrides) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": 1, "c": "x"}``; values are parsed as YAML scalars."""
    parsed = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"override {item!r} is not KEY=VALUE (for example run.steps=20)")
        try:
            parsed[key.strip()] = _load_yaml(text) if text else ""
        except yaml.YAMLError as exc:
            raise UserError(f"override {item!r}: cannot parse value: {exc}") from exc
    return parsed


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        raw = _load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path}: malformed YAML{where}: {problem}") from exc
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections at the top level")
    return raw


def build_section(cls, raw: dict, base_dir: Path, cli_keys=(), key: str = ""):
    """Check and convert a raw mapping into the dataclass ``cls`` (for other YAML files, such as
    ``rlpipe train-rm``'s): unknown keys, types, Literals and input paths (relative to ``base_dir``,
    or to the working directory for dotted keys in ``cli_keys``) as for run configs."""
    return _Converter(Path(base_dir), set(cli_keys)).section(cls, raw, key)


def read_config_file(path, overrides=()) -> tuple[dict, set[str]]:
    """The YAML mapping of ``path`` with ``KEY=VALUE`` overrides applied, and the overridden keys."""
    raw = _read_yaml(Path(path))
    parsed = parse_overrides(overrides)
    for dotted, value in parsed.items():
        _set_dotted(raw, dotted, value)
    return raw, set(parsed)


def load_config(path, overrides=()) -> Config:
    """Read a YAML config, apply ``KEY=VALUE`` overrides, check every key, type, file and plugin."""
    path = Path(path)
    raw, cli_keys = read_config_file(path, overrides)
    conv = _Converter(path.resolve().parent, cli_keys)
    cfg = conv.section(Config, raw, "")
    for key, group in _PLUGIN_GROUP.items():
        sections = getattr(cfg, key)
        for i, section in enumerate(sections if isinstance(sections, list) else [sections]):
            _check_plugin_args(section, f"{key}.{i}" if key == "rewards" else key, group, conv)
    if cfg.ptx.coef > 0 and cfg.ptx.data is None:
        raise UserError("ptx.data: required when ptx.coef > 0")
    labels = [r.key for r in cfg.rewards]
    if not labels:
        raise UserError("rewards: list at least one reward plugin")
    if len(set(labels)) != len(labels):
        raise UserError(f"rewards: duplicate reward names {labels}; give repeated plugins a `label`")
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
