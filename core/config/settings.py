"""One YAML file per run, turned into one typed config tree; dotted ``KEY=VALUE`` overrides.

The schema: one dataclass per section. Unknown keys, wrong types, missing files and numbers out
of the `Range` kept in each numeric field's metadata (``num(1e-5, "> 0")``) are errors naming the
dotted key (the generic YAML-to-dataclass part is `rlpipe.core.base.yamlconf`; the rules between keys
are `rlpipe.core.config.checks`). Each plugin section (``collector``, ``rewards[i]``,
``advantage``, ``loss``) holds ``name`` plus keyword arguments for that plugin's constructor,
checked against its signature. Input paths written in the YAML file are relative to the file;
paths given as overrides are relative to the working directory.

>>> tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"  # a checkout
>>> cfg = load_config(tiny, ["run.steps=3", "kl.in=loss"])
>>> cfg.run.steps, cfg.kl.in_, cfg.collector.name, cfg.collector.args["max_new_tokens"]
(3, 'loss', 'hf', 24)
>>> cfg.models.actor.path == tiny.parent / "model"   # relative to the file
True
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


from rlpipe.core.config.checks import check_config
from rlpipe.core.base.hub import ModelPath
from rlpipe.core.observe.health.monitor import HealthConfig
from rlpipe.core.base.yamlconf import (Converter, num, read_config_file, rest, rest_field,
                                       yaml_key)

DEVICE_ENV = "RLPIPE_DEVICE"  # set: replaces run.device of every config (e.g. the tests on CUDA)


@dataclass
class RunConfig:
    steps: int = num(10, ">= 1")     # PPO steps (one rollout batch + update each)
    seed: int = num(0, ">= 0")
    output_dir: str = "runs/rlpipe"  # the run directory, relative to the working directory
    device: str = "auto"             # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    debug: bool = False              # validate the batch at every stage boundary
    resume: Literal["never", "auto"] = "never"   # auto: continue from the newest checkpoint
    preflight: bool = False          # before step 1: one batch, engine vs trainer log-probs (rlpipe check)
    preflight_max_kl: float = num(0.01, "> 0")   # fail above this per-token KL(engine || trainer)
    preflight_max_gap: float = num(0.1, "> 0")   # ... or above this mean |engine - trainer log-prob|
    flush_denormals: bool = True     # CPU: floats below 1.2e-38 read as 0 on every torch thread (core/models/denormals.py)
    keep_freed_memory: bool = True   # glibc: freed CPU blocks reused, not returned to the kernel (core/models/cpu_memory.py)


@dataclass
class LoraConfig:
    r: int = num(8, ">= 1")
    alpha: int = num(16, "> 0")
    dropout: float = num(0.0, "in [0, 1)")
    target_modules: list[str] | str = "all-linear"
    merged_passes: bool = True      # HF rollout on W + s*B*A: one matmul per layer (core/models/lora.py)


@dataclass
class ModelConfig:
    path: ModelPath                                 # a Hugging Face model folder or Hub ID (core/base/hub.py)
    init: Literal["pretrained", "random"] = "pretrained"  # random: fresh weights from config.json
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None                  # set: train LoRA adapters (peft); the
                                                    # reference is the actor with adapters disabled
    gradient_checkpointing: bool = False            # recompute block activations in backward
    trust_remote_code: bool = False                 # allow the folder's own code (auto_map)


@dataclass
class CriticConfig:
    path: ModelPath | None = None  # None: a copy of the actor's backbone; else a folder or Hub ID
    init: Literal["pretrained", "random"] = "pretrained"
    lora: LoraConfig | None = None
    shared_backbone: bool = False  # a value head on the actor's own backbone (combined loss)
    from_reward_model: bool = False  # path is a reward model: its backbone and score head (TRL)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # allow the folder's own code (auto_map)


@dataclass
class ReferenceConfig:
    offload: bool = False      # the frozen copy waits on CPU and visits the device for its forward


@dataclass
class ModelsConfig:
    actor: ModelConfig
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    # bfloat16: actor, critic and reference compute under torch.autocast (rollout with the HF
    # collector, scoring, update); weights, gradients and optimizer state stay in their dtype
    autocast: Literal["none", "bfloat16"] = "none"
    # prompt tokens every row of a forward begins with (a system prompt, an instruction) run
    # once, their KV cache repeated to the rows (core/models/prefix.py); same math, fewer tokens
    shared_prefix: bool = True
    # rows run without their padding: one packed sequence, attention within each row
    # (core/models/packing.py); same math, fewer tokens. For models with transformers' sdpa attention
    packed: bool = True


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False   # DAPO's dynamic sampling: drop groups whose samples all scored the same
    max_rounds: int = num(4, ">= 0")  # extra collection rounds per step at most; then the batch
                                      # is topped up with the newest flat groups


@dataclass
class DataConfig:
    prompts: Path | str | None = None  # .txt (a prompt a line), .jsonl/.json/.parquet/.csv, a
                                       # save_to_disk folder or a cached Hub dataset name; None:
                                       # Pipeline(cfg, dataset=...) in Python
    batch_size: int = num(8, ">= 1")  # prompts per PPO step (samples = batch_size * collector n)
    shuffle: bool = True
    split: str = "train"              # the split of a folder, DatasetDict or Hub dataset
    prompt_key: str = "prompt"        # the prompt column: strings, or chat messages
                                      # ([{role, content}]) applied through the chat template
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class EvalConfig:
    prompts: Path | str | None = None  # held-out prompts, as data.prompts; None: no evaluation
    split: str = "train"
    prompt_key: str = "prompt"
    every: int = num(0, ">= 0")        # evaluate every N steps (0: at step 0 and the last only)
    max_prompts: int | None = num(None, ">= 1")  # the first N rows (None: all)
    temperature: float = num(0.0, ">= 0")  # 0: greedy decoding
    batch_size: int = num(64, ">= 1")  # prompts per collect() call


@dataclass
class KLConfig:
    coef: float = num(0.05, ">= 0")                 # beta, or the adaptive controller's start
    # null: k1 in the reward, k2 in the loss (k1's gradient is 0 on-policy); rlpipe.core.step.kl
    estimator: Literal["k1", "k2", "k3"] | None = None
    clamp: float | None = num(10.0, "> 0")          # bound log pi - log pi_ref to +-clamp (null: off)
    # null: where the advantage declares (kl_in): the loss for group-relative estimators (grpo,
    # rloo), the reward for the others (gae, reinforce_pp); load_config writes the choice here
    in_: Literal["reward", "loss"] | None = field(default=None, metadata={"yaml": "in"})
    target: float | None = num(None, "> 0")         # set: adaptive controller (Ziegler et al. 2019)
    horizon: int = num(10000, ">= 1")
    auto = None  # not a field: the keys load_config chose (`rlpipe.core.config.kl_placement.resolve_placement`)


@dataclass
class RolloutCorrectionConfig:
    """Engine/trainer mismatch correction (rlpipe.core.step.rollout_correction). A section of its own,
    not loss arguments: it changes what the pipeline computes (bypass skips a forward) and any
    loss that declares LossContract.rollout_weights applies it."""
    mode: Literal["none", "tis", "mis", "bypass"] = "none"
    # who computes old_log_prob with mode none: "recompute", a no-grad actor forward over the
    # rollout; "sampling", the sampling pass itself, where the collector offers it (HF: the
    # engine is the actor); "auto", sampling when it matches the forward within float32 round-off
    # (collector offers it, actor in float32, no bf16 mixed precision or autocast), else recompute
    old_log_prob: Literal["auto", "recompute", "sampling"] = "auto"
    level: Literal["token", "sequence"] = "token"   # weight per token, or per sequence (product)
    threshold: float = num(2.0, ">= 1")   # C: tis truncates at C, mis keeps [1/C, C]


@dataclass
class TrainConfig:
    epochs: int = num(4, ">= 1")      # PPO epochs over each rollout batch
    minibatches: int = num(2, ">= 1") # optimizer steps per epoch
    grad_accum: int = num(1, ">= 1")  # micro-batches per minibatch
    lr: float = num(1e-5, "> 0")
    critic_lr: float = num(5e-5, "> 0")
    weight_decay: float = num(0.0, ">= 0")
    max_grad_norm: float | None = num(1.0, "> 0")  # null: no clipping
    forward_batch_size: int = num(16, ">= 1")  # micro-batch for no-grad forwards over the rollout
    schedule: Literal["constant", "cosine"] = "constant"   # over run.steps x epochs x minibatches
    warmup_steps: int = num(0, ">= 0")  # linear warmup, in optimizer steps
    target_kl: float | None = num(None, ">= 0")  # stop a step's epochs once policy/approx_kl exceeds it
    critic_warmup_steps: int = num(0, ">= 0")  # the first PPO steps train the critic only
    critic_warmup_explained_var: float | None = num(None, "<= 1")  # then critic-only until reached
    critic_warmup_max_steps: int = num(50, ">= 1")  # cap on all critic-only steps (with the above)
    max_bad_steps: int = num(3, ">= 1")  # consecutive non-finite steps before the run stops


@dataclass
class PtxConfig:
    coef: float = num(0.0, ">= 0")    # > 0: add coef x LM loss on `data` to each actor update
    data: Path | None = None          # .txt (one text per line) or .jsonl (a "text" field)
    batch_size: int = num(4, ">= 1")  # texts per optimizer step
    max_tokens: int = num(256, ">= 1")  # tokens per text (longer ones are cut)


@dataclass
class CheckpointConfig:
    every: int = num(0, ">= 0")       # PPO steps between checkpoints (0: only the final policy)
    keep: int = num(2, ">= 1")        # newest checkpoints kept


@dataclass
class ExportConfig:
    merge_lora: bool = True           # final/: LoRA merged into a copy (true) or the adapter only


@dataclass
class DistributedConfig:
    nproc: int = num(1, ">= 1")       # processes on this machine; > 1 launches torchrun itself
    shard_frozen: bool = True         # FSDP-shard the frozen reference too (false: replicate it)
    bf16: bool = False                # FSDP mixed precision: bf16 compute, fp32 weights and reduction
    nnodes: int = num(1, ">= 1")      # machines in the job; > 1 joins the rendezvous below
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous (required when nnodes > 1)
    rdzv_id: str = "rlpipe"           # job id shared by every node of one job
    timeout_s: float = num(600.0, "> 0")  # a collective waiting longer than this fails the run


@dataclass
class LogConfig:
    progress: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "rlpipe"
    samples_every: int = num(1, ">= 0")  # write samples/step-N.jsonl every N steps (0: never)
    samples: int = num(4, ">= 1")        # samples per file (evenly spaced over the batch)


@dataclass
class RewardSettings:
    clip: float | None = num(None, "> 0")  # clip the weighted score to [-clip, clip]
    normalize: bool = False        # running mean/std of the score across steps (checkpointed)


@dataclass
class PluginConfig:
    name: str
    args: dict[str, Any] = rest()     # the plugin's constructor arguments
    resolved = None  # not a field: the `registry.Plugin` that `load_config` found (`resolve_plugin`)


@dataclass
class RewardConfig:
    name: str | None = None           # a plugin, or module:attr; null with `function`
    weight: float = 1.0
    label: str | None = None          # metric/score_parts name; defaults to `name` (the attribute
                                      # of a module:attr name; `function` for a file)
    function: str | None = None       # with `path`: a function (or class) of the Python file `path`
    args: dict[str, Any] = rest()     # the plugin's constructor arguments
    resolved = None  # not a field: the `registry.Plugin` that `load_config` found (`resolve_plugin`)

    @property
    def key(self) -> str:
        return self.label or (self.name.rsplit(":", 1)[-1] if self.name else self.function)


@dataclass
class Config:
    models: ModelsConfig
    data: DataConfig
    rewards: list[RewardConfig] = field(default_factory=list)  # empty: Pipeline(rewards=...) gives them
    run: RunConfig = field(default_factory=RunConfig)
    collector: PluginConfig = field(default_factory=lambda: PluginConfig("hf"))
    advantage: PluginConfig = field(default_factory=lambda: PluginConfig("gae"))
    loss: PluginConfig = field(default_factory=lambda: PluginConfig("ppo"))
    reward: RewardSettings = field(default_factory=RewardSettings)
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ptx: PtxConfig = field(default_factory=PtxConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def to_dict(self) -> dict:
        """Plain nested dict, plugin sections flattened as in the YAML (what ``config.yaml`` holds)."""
        return _dump(self)


def _dump(obj):
    if dataclasses.is_dataclass(obj) and rest_field(type(obj)) is not None:  # plugin section
        extra = rest_field(type(obj))
        fixed = {yaml_key(f): _dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                 if f is not extra}
        return {**{k: v for k, v in fixed.items() if v is not None}, **_dump(getattr(obj, extra.name))}
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f): _dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _dump(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_dump(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj


def load_config(path, overrides=()) -> Config:
    """Read a YAML config, apply ``KEY=VALUE`` overrides, and check every key, type, range, file
    and plugin argument, and the rules between keys (`rlpipe.core.config.checks`), before any
    model is built."""
    path = Path(path)
    raw, cli_keys = read_config_file(path, overrides)
    device = os.environ.get(DEVICE_ENV)
    if device and "run.device" not in cli_keys and isinstance(raw.get("run", {}), dict):
        raw.setdefault("run", {})["device"] = device  # the file < RLPIPE_DEVICE < KEY=VALUE
    conv = Converter(path.resolve().parent, cli_keys)
    cfg = conv.section(Config, raw, "")
    check_config(cfg, conv)
    return cfg
