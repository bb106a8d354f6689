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

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


from rlpipe.core.config.checks import check_config
from rlpipe.core.config.plan import plan_run
from rlpipe.core.base.hub import ModelPath
from rlpipe.core.observe.health.monitor import HealthConfig
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.yamlconf import (Converter, _set_dotted, num, opt, parse_overrides,
                                       read_config_file, rest, rest_field, yaml_key)

DEVICE_ENV = "RLPIPE_DEVICE"  # set: replaces run.device of every config (e.g. the tests on CUDA)


@dataclass
class RunConfig:
    steps: int = num(10, ">= 1", "PPO steps (rollout + update each)")
    seed: int = num(0, ">= 0", "seeds torch, Python and the data order; same seed on CPU: identical metrics.jsonl")
    output_dir: str = opt("runs/rlpipe", "run directory (relative to the working directory)")
    device: str = opt("auto", "auto (CUDA if available), cpu, cuda, cuda:1 ...")
    debug: bool = opt(False, "validate the batch against the schema at every stage boundary")
    resume: Literal["never", "auto"] = opt(
        "never", "auto: continue from the newest complete checkpoint (same as --resume)")
    preflight: bool = opt(False, "before step 1, run the mismatch preflight (as rlpipe check); a "
                                 "failure stops the run on one line, exit status 2")
    preflight_max_kl: float = num(0.01, "> 0", "the preflight fails above this per-token "
                                               "mismatch KL(engine || trainer)")
    preflight_max_gap: float = num(0.1, "> 0", "the preflight fails above this mean "
                                               "|engine - trainer log-prob|")
    flush_denormals: bool = opt(True, "CPU: floats below 1.2e-38 read as 0 on every torch thread "
                                      "(x86 is 10-50x slower on them); same results (performance.md)")
    keep_freed_memory: bool = opt(True, "glibc: freed CPU blocks are kept and reused instead of "
                                        "returned to the kernel and zeroed again (performance.md)")


@dataclass
class LoraConfig:
    r: int = num(8, ">= 1", "LoRA rank")
    alpha: int = num(16, "> 0", "LoRA scale numerator (scale = alpha / r)")
    dropout: float = num(0.0, "in [0, 1)", "dropout on the LoRA path")
    target_modules: list[str] | str = opt("all-linear", "peft's target_modules: all-linear, or a "
                                                        "list of module names")
    merged_passes: bool = opt(True, "the hf collector's generate runs each adapted layer as one "
                                    "matmul on W + s*B*A, a copy kept between steps (performance.md)")


@dataclass
class ModelConfig:
    path: ModelPath = opt(help="Hugging Face causal-LM folder (config.json, tokenizer), "
                               "pkg:NAME (a model in an installed package) or a Hub ID (org/name)")
    init: Literal["pretrained", "random"] = opt(
        "pretrained", "random: fresh weights from config.json (tests, benchmarks)")
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "weights' dtype")
    lora: LoraConfig | None = opt(None, "set: train peft LoRA adapters; the reference is then the "
                                        "actor with its adapters disabled (no second copy)")
    gradient_checkpointing: bool = opt(False, "recompute each block's activations in backward "
                                              "(less memory, about one more forward); update only")
    trust_remote_code: bool = opt(False, "allow the model folder's own Python code (auto_map); "
                                         "false refuses such a folder on one line")


@dataclass
class CriticConfig:
    path: ModelPath | None = opt(None, "null: a copy of the actor's backbone; else a model "
                                       "folder, pkg:NAME or Hub ID")
    init: Literal["pretrained", "random"] = opt("pretrained", "as for the actor, when path is set")
    lora: LoraConfig | None = opt(None, "LoRA on the critic's backbone (the value head stays "
                                        "fully trained)")
    shared_backbone: bool = opt(False, "a value head on the actor's own backbone, trained by the "
                                       "combined loss: no second backbone, no second forward")
    from_reward_model: bool = opt(False, "path is a reward model (a causal LM's one-output "
                                         "classifier): its backbone and score head (TRL's choice)")
    gradient_checkpointing: bool = opt(False, "as for the actor")
    trust_remote_code: bool = opt(False, "as for the actor")


@dataclass
class ReferenceConfig:
    offload: bool = opt(False, "the frozen reference waits on CPU and visits the GPU only for its "
                               "scoring pass (one process; a LoRA actor has no copy to offload)")


@dataclass
class ModelsConfig:
    actor: ModelConfig = opt(help="the policy being trained")
    critic: CriticConfig = opt(help="the value model (built only for an advantage that needs "
                                    "a critic)", factory=CriticConfig)
    reference: ReferenceConfig = opt(help="the frozen reference policy of the KL penalty",
                                     factory=ReferenceConfig)
    autocast: Literal["none", "bfloat16"] = opt(
        "none", "bfloat16: every forward computes under torch.autocast in bf16; weights, "
                "gradients and AdamW state stay float32 (performance.md)")
    shared_prefix: bool = opt(True, "prompt tokens that rows share run once and their KV cache is "
                                    "reused; same numbers, fewer tokens (performance.md)")
    packed: bool = opt(True, "rows run without their padding, packed into one sequence with "
                             "attention within each row; same numbers (performance.md)")
    compile_logprobs: bool = opt(False, "token log-probs and their backward as kernels "
                                        "torch.compile fuses (performance.md)")


@dataclass
class DynamicSamplingConfig:
    enabled: bool = opt(False, "DAPO's dynamic sampling: drop groups whose samples all scored "
                               "the same and collect more prompts (collector n >= 2)")
    max_rounds: int = num(4, ">= 0", "extra collection rounds per step at most; then the batch is "
                                     "topped up with the newest flat groups")


@dataclass
class DataConfig:
    prompts: Path | str | None = opt(
        None, ".txt (a prompt a line), .jsonl, .json, .parquet, .csv, a save_to_disk folder or a "
              "cached Hub dataset; required unless Python passes dataset=")
    batch_size: int = num(8, ">= 1", "prompts per step; samples per step = batch_size x "
                                     "collector n; fewer rows: prompts repeat within a step, "
                                     "with a warning")
    shuffle: bool = opt(True, "a fresh seeded permutation each pass over the data")
    split: str = opt("train", "the split of a folder, DatasetDict or Hub dataset")
    prompt_key: str = opt("prompt", "the prompt column (strings, or chat messages); every other "
                                    "column travels with the samples")
    dynamic_sampling: DynamicSamplingConfig = opt(
        help="DAPO's filter: flat groups dropped, more prompts collected", factory=DynamicSamplingConfig)


@dataclass
class EvalConfig:
    prompts: Path | str | dict | None = opt(None, "held-out prompts as data.prompts (null: none), "
                                            "or name -> such: the first eval/*, others eval/<name>/*")
    split: str = opt("train", "as data.split")
    prompt_key: str = opt("prompt", "as data.prompt_key")
    every: int = num(0, ">= 0", "evaluate at step 0, every N steps and the last (0: none between)")
    max_prompts: int | None = num(None, ">= 1", "evaluate the first N rows (null: all)")
    temperature: float = num(0.0, ">= 0", "sampling temperature of evaluation (0: greedy); the "
                                          "other collector arguments are training's, n: 1")
    batch_size: int = num(64, ">= 1", "prompts per collect() call of the evaluation")
    tool_lift: bool = opt(True, "with an environment's tools: evaluate again with them disabled (eval/tool_lift)")


@dataclass
class KLConfig:
    coef: float = num(0.05, ">= 0", "beta of the per-token KL penalty (the adaptive "
                                    "controller's start with target)")
    estimator: Literal["k1", "k2", "k3"] | None = opt(
        None, "k1 (log-ratio), k2, k3 (Schulman's estimators); null: k1 in the reward, k2 in the "
              "loss (k1's gradient is 0 on-policy)")
    clamp: float | None = num(10.0, "> 0", "bound log pi - log pi_ref to [-clamp, clamp] before "
                                           "the estimator (null: off; algorithms.md)")
    in_: Literal["reward", "loss"] | None = opt(
        None, "reward: -beta*KL per token in the reward; loss: beta*KL (a masked token mean) as "
              "the loss term loss_kl; "
              "null: where the advantage declares (loss for grpo, rloo; reward for gae, "
              "reinforce_pp)", yaml="in")
    target: float | None = num(None, "> 0", "set: adaptive beta towards this KL (Ziegler 2019)")
    horizon: int = num(10000, ">= 1", "the adaptive controller's horizon")


@dataclass
class RolloutConfig:
    """When each step's rollouts are sampled (rlpipe.core.run.offpolicy)."""
    staleness: int = num(0, "in [0, 1]", "0: each step samples its batch, then updates on it; 1: "
                                         "the next batch is sampled while this step updates, by "
                                         "the policy before the update (one-step off-policy, "
                                         "corrected by rollout_correction)")
    accept_uncorrected: bool = opt(False, "allow staleness 1 with rollout_correction.mode: none "
                                          "(the stale tokens then get no importance weight)")


@dataclass
class RolloutCorrectionConfig:
    """Engine/trainer mismatch correction (rlpipe.core.step.rollout_correction). A section of its own,
    not loss arguments: it changes what the pipeline computes (bypass skips a forward) and any
    loss that declares LossContract.rollout_weights applies it."""
    mode: Literal["none", "tis", "mis", "bypass"] = opt(
        "none", "what to do about the engine/trainer mismatch: none, tis, mis, bypass "
                "(rollout-correction.md)")
    old_log_prob: Literal["auto", "recompute", "sampling"] = opt(
        "auto", "who computes old_log_prob under mode none: recompute (an actor forward), "
                "sampling (the sampling pass), auto (sampling where it is exact)")
    level: Literal["token", "sequence"] = opt("token", "token: a weight per token; sequence: the "
                                                       "product over the sequence, on each of its "
                                                       "tokens")
    threshold: float = num(2.0, ">= 1", "C: tis truncates weights at C, mis keeps weights in "
                                        "[1/C, C]")
    max_masked_frac: float = num(0.5, "in [0, 1]", "a step where mis masks more of the tokens "
                                                   "stops the run on one line")


@dataclass
class TrainConfig:
    epochs: int = num(4, ">= 1", "PPO epochs over each rollout batch")
    minibatches: int = num(2, ">= 1", "optimizer steps per epoch")
    grad_accum: int = num(1, ">= 1", "micro-batches per optimizer step (the loss does not "
                                     "depend on it); above 1, ordered by prompt first "
                                     "(performance.md)")
    lr: float = num(1e-5, "> 0", "AdamW learning rate of the actor")
    critic_lr: float = num(5e-5, "> 0", "AdamW learning rate of the critic")
    weight_decay: float = num(0.0, ">= 0", "AdamW weight decay")
    max_grad_norm: float | None = num(1.0, "> 0", "gradient-norm clipping, actor and critic "
                                                  "separately (null: off)")
    forward_batch_size: int = num(16, ">= 1", "micro-batch of the no-grad forwards over the "
                                              "rollout")
    schedule: Literal["constant", "cosine"] = opt(
        "constant", "learning-rate schedule; cosine reaches 0 at the last optimizer step of "
                    "run.steps")
    min_lr_ratio: float = num(0.0, "in [0, 1]", "cosine ends at this fraction of the learning "
                                                "rate instead of 0 (verl's min_lr_ratio)")
    warmup_steps: int = num(0, ">= 0", "linear warm-up, in optimizer steps")
    target_kl: float | None = num(None, ">= 0", "stop a step's epochs once a minibatch's "
                                                "approx-KL (policy/approx_kl for ppo) exceeds it; "
                                                "an error with a loss that declares none")
    critic_warmup_steps: int = num(0, ">= 0", "the first PPO steps update the critic only")
    critic_warmup_explained_var: float | None = num(
        None, "<= 1", "set: critic-only steps go on until a step's value/explained_var reaches it")
    critic_warmup_max_steps: int = num(50, ">= 1", "with critic_warmup_explained_var: at most "
                                                   "this many critic-only steps in all, "
                                                   "critic_warmup_steps included (not below it)")
    critic_pretrain_rollouts: int = num(0, ">= 0", "before step 1 the critic regresses the "
                                        "rewards' scores of every response prefix of this many "
                                        "rollouts (rewards that declare scores_prefixes)")
    critic_pretrain_epochs: int = num(3, ">= 1", "passes over the critic_pretrain_rollouts")
    max_bad_steps: int = num(3, ">= 1", "minibatches with a non-finite loss or gradient are "
                                        "skipped; this many in a row stop the run")


@dataclass
class PtxConfig:
    coef: float = num(0.0, ">= 0", "PPO-ptx: add coef x the language-modelling loss on data to "
                                   "each actor update (logged as policy/ptx_loss)")
    data: Path | None = opt(None, "ptx text: .txt (one text per line) or .jsonl (a 'text' field "
                                  "per line); required when coef > 0")
    batch_size: int = num(4, ">= 1", "ptx texts per optimizer step")
    max_tokens: int = num(256, ">= 1", "tokens per ptx text (longer ones are cut)")


@dataclass
class CheckpointConfig:
    every: int = num(0, ">= 0", "checkpoint every N steps and at the last (0: off); rlpipe run "
                                "CONFIG --resume continues")
    keep: int = num(2, ">= 1", "newest checkpoints kept")


@dataclass
class ExportConfig:
    merge_lora: bool = opt(True, "final/ holds LoRA merged into a copy of the base (true) or the "
                                 "adapter alone")


@dataclass
class DistributedConfig:
    nproc: int = num(1, ">= 1", "processes on this machine; > 1 makes rlpipe run launch torchrun "
                                "with FSDP2")
    shard_frozen: bool = opt(True, "FSDP-shard the frozen reference too (false: replicate it)")
    bf16: bool = opt(False, "FSDP mixed precision: bf16 compute, fp32 weights and gradient "
                            "reduction")
    nnodes: int = num(1, ">= 1", "machines in the job; > 1 joins the c10d rendezvous at "
                                 "rdzv_endpoint")
    rdzv_endpoint: str | None = opt(None, "HOST:PORT of the c10d rendezvous (required when "
                                          "nnodes > 1)")
    rdzv_id: str = opt("rlpipe", "job id shared by every node of one job")
    timeout_s: float = num(600.0, "> 0", "a collective waiting longer than this (seconds) fails "
                                         "the run")


@dataclass
class LogConfig:
    progress: bool = opt(True, "progress bar (false: one line per step)")
    tensorboard: bool = opt(False, "TensorBoard sink in RUN_DIR/tensorboard (pip install "
                                   "'rlpipe[tensorboard]')")
    wandb: bool = opt(False, "Weights & Biases sink, offline unless configured (pip install "
                             "'rlpipe[wandb]')")
    wandb_project: str = opt("rlpipe", "the W&B project")
    samples_every: int = num(1, ">= 0", "write samples/step-N.jsonl every N steps (0: never)")
    samples: int = num(4, ">= 1", "samples per file, evenly spaced over the batch (no random "
                                  "draw)")


@dataclass
class RewardSettings:
    clip: float | None = num(None, "> 0", "clip the weighted score to [-clip, clip]")
    normalize: bool = opt(False, "normalise the score with running mean/std across steps "
                                 "(checkpointed)")


@dataclass
class PluginConfig:
    name: str = opt(help="the plugin: an entry-point name or module:attribute")
    args: dict[str, Any] = rest()     # the plugin's constructor arguments
    resolved = None  # not a field: the `registry.Plugin` that `load_config` found (`resolve_plugin`)


@dataclass
class RewardConfig:
    name: str | None = opt(None, "a reward plugin or module:attribute; null with path + function")
    weight: float = opt(1.0, "weight in the score (a weighted sum of the rewards)")
    label: str | None = opt(None, "metric and score_parts name (default: the name, or the "
                                  "function)")
    function: str | None = opt(None, "with path: a function (or class) of the Python file path")
    args: dict[str, Any] = rest()     # the plugin's constructor arguments
    resolved = None  # not a field: the `registry.Plugin` that `load_config` found (`resolve_plugin`)

    @property
    def key(self) -> str:
        return self.label or (self.name.rsplit(":", 1)[-1] if self.name else self.function)


@dataclass
class Config:
    models: ModelsConfig = opt(help="the actor, critic and reference models")
    data: DataConfig = opt(help="the training prompts")
    rewards: list[RewardConfig] = opt(
        help="list of {name, weight, label, ...plugin arguments}, or path (a Python file) + "
             "function instead of name; at least one unless Python passes rewards=",
        factory=list)
    run: RunConfig = opt(help="the run: steps, seed, run directory, device", factory=RunConfig)
    collector: PluginConfig = opt(help="the collector plugin and its arguments",
                                  factory=lambda: PluginConfig("hf"))
    advantage: PluginConfig = opt(help="the advantage plugin and its arguments",
                                  factory=lambda: PluginConfig("gae"))
    loss: PluginConfig = opt(help="the loss plugin and its arguments",
                             factory=lambda: PluginConfig("ppo"))
    environment: PluginConfig | None = opt(None, "multi-turn: the environment answering each "
                                                 "model turn (tools, or yours); null: one turn")
    reward: RewardSettings = opt(help="settings of the summed score", factory=RewardSettings)
    kl: KLConfig = opt(help="the KL penalty to the reference", factory=KLConfig)
    rollout: RolloutConfig = opt(help="when rollouts are sampled (one-step off-policy)",
                                 factory=RolloutConfig)
    rollout_correction: RolloutCorrectionConfig = opt(
        help="engine/trainer mismatch correction", factory=RolloutCorrectionConfig)
    train: TrainConfig = opt(help="the PPO update", factory=TrainConfig)
    ptx: PtxConfig = opt(help="PPO-ptx: a language-modelling loss on text", factory=PtxConfig)
    eval: EvalConfig = opt(help="held-out evaluation", factory=EvalConfig)
    checkpoint: CheckpointConfig = opt(help="checkpoints and resume", factory=CheckpointConfig)
    export: ExportConfig = opt(help="what final/ holds", factory=ExportConfig)
    log: LogConfig = opt(help="progress, trackers and sample files", factory=LogConfig)
    distributed: DistributedConfig = opt(help="FSDP2 across processes and machines",
                                         factory=DistributedConfig)
    health: HealthConfig = opt(help="the health rules", factory=HealthConfig)

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


def load_config(source, overrides=()) -> Config:
    """Read a YAML config (a path), or take a dict of the same shape or a `Config`, apply
    ``KEY=VALUE`` overrides, and check every key, type, range, file and plugin argument, and the
    rules between keys and the plugins' contracts (`rlpipe.core.config.plan.plan_run`, not
    written back), before any model is built; a dict's relative paths: the working directory.

    >>> cfg = load_config({"models": {"actor": {"path": "examples/tiny/model", "init": "random"}},
    ...                    "data": {"prompts": "examples/tiny/prompts.txt"}}, ["run.steps=2"])
    >>> cfg.run.steps, load_config(cfg, ["run.steps=3"]).run.steps, cfg.run.steps
    (2, 3, 2)
    """
    if isinstance(source, Config):
        source = source.to_dict()  # its paths are absolute already
    if isinstance(source, dict):
        raw, base = copy.deepcopy(source), Path.cwd()
        parsed = parse_overrides(overrides)
        for dotted, value in parsed.items():
            _set_dotted(raw, dotted, value)
        cli_keys = set(parsed)
    elif isinstance(source, (str, os.PathLike)):
        raw, cli_keys = read_config_file(Path(source), overrides)
        base = Path(source).resolve().parent
    else:
        raise UserError(f"a config is a Config, a dict or the path of a YAML file, not "
                        f"{type(source).__name__}")
    device = os.environ.get(DEVICE_ENV)
    if device and "run.device" not in cli_keys and isinstance(raw.get("run", {}), dict):
        raw.setdefault("run", {})["device"] = device  # the file < RLPIPE_DEVICE < KEY=VALUE
    conv = Converter(base, cli_keys)
    cfg = conv.section(Config, raw, "")
    check_config(cfg, conv)
    plan_run(cfg)  # the rules that read the plugins' contracts
    return cfg
