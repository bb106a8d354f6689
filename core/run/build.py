"""Turn a `Config` into live objects: run directory, models, plugins, optimizers.

Everything the pipeline needs is built here, so `core/run/pipeline.py` reads as the algorithm only.
Plugins are looked up by name in the registry and never special-cased.
"""

from __future__ import annotations

import copy
import random
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe.core.config import compose
from rlpipe.core.contracts import references, registry
from rlpipe.core.contracts.kinds import advantage_contract
from rlpipe.core.run import rundir, runlock
from rlpipe.core.config.compose import save_config
from rlpipe.core.config.settings import Config
from rlpipe.core.config.checks import resolve_plugin
from rlpipe.core.config.plan import RunPlan, Stage, plan_run
from rlpipe.core.data.prompts import PromptData, check_reward_columns, load_prompt_data
from rlpipe.core.base import ops
from rlpipe.core.base.context import RunContext
from rlpipe.core.models.critic_start import critic_from_reward_model
from rlpipe.core.base.errors import UserError, writing
from rlpipe.core.models.lora import allow_merging
from rlpipe.core.models import distributed
from rlpipe.core.models.cpu_memory import keep_freed_memory
from rlpipe.core.models.denormals import flush_denormals
from rlpipe.core.models.distributed import Dist, shard
from rlpipe.core.observe.console import Status, describe_models
from rlpipe.core.models.lm import (_DTYPES, Models, ValueModel, cpu_has_bf16, enable_checkpointing,
                                   frozen_copy, load_causal_lm, load_tokenizer)
from rlpipe.core.step.journal import FOLDER, Journal
from rlpipe.core.step.multiturn import MultiTurn
from rlpipe.core.step.rewards import RewardComposer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str, key: str = "run.device") -> torch.device:
    """``auto`` (CUDA where there is one), or the device ``name`` if this machine has it;
    ``key`` is the setting an error names."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UserError(f"{key}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key}: {name!r} requested but CUDA is not available")
    return device


def check_run_dir(cfg: Config, overwrite: bool = False, resume: bool = False,
                  reads=()) -> Path:
    """The run directory, if this run may use it (see `rlpipe.core.run.rundir`); writes nothing.
    ``reads``: input paths beyond those in ``cfg`` (the config file)."""
    return _check_run_dir(cfg, overwrite, resume, reads)[0]


def _check_run_dir(cfg: Config, overwrite: bool, resume: bool, reads=()):
    """``(run_dir, state, changes)``: `rundir.state`, and the config changes a resume applies."""
    resume = resume or cfg.run.resume == "auto"
    run_dir = rundir.output_path(cfg.run.output_dir, "run.output_dir")
    runlock.refuse_if_held(run_dir, "run.output_dir")   # a running run: "in use", not its files
    found = rundir.check_output(run_dir, rundir.RUN_LAYOUT, overwrite, resume, "run.output_dir",
                                [*rundir.input_paths(cfg), *reads])
    changes = rundir.resume_changes(run_dir, cfg.to_dict()) if found == "run" and resume else {}
    return run_dir, found, changes


def finished_message(cfg: Config, resume: bool = False) -> str | None:
    """The line to print instead of training when ``--resume`` meets a finished run."""
    if not (resume or cfg.run.resume == "auto"):
        return None
    run_dir = rundir.output_path(cfg.run.output_dir, "run.output_dir")
    step = rundir.finished_step(run_dir) if run_dir.is_dir() else None
    if step is None or step < cfg.run.steps:
        return None
    return f"run {run_dir} is already finished at step {step}; raise run.steps to continue"


def prepare_run_dir(cfg: Config, overwrite: bool = False, resume: bool = False,
                    is_main: bool = True) -> tuple[Path, runlock.Held | None]:
    """Create the run directory with its marker and resolved config (rank 0 only), and its lock
    (`runlock.hold`: held until released or the process ends). An earlier run is kept for
    ``resume`` and cleared with ``overwrite``; anything else is refused."""
    if not is_main:  # rank 0 checks and writes; another rank would see rank 0's files
        return Path(cfg.run.output_dir).expanduser().resolve(), None
    run_dir = _check_run_dir(cfg, overwrite, resume)[0]  # refused before anything is written
    with writing(run_dir, "the run directory and its lock"):
        lock = runlock.hold(run_dir, "run.output_dir")
    run_dir, found, changes = _check_run_dir(cfg, overwrite, resume)  # again, as its owner
    if found == "run" and (resume or cfg.run.resume == "auto"):
        if changes:  # config.yaml is rewritten once the checkpoint is loaded
            shown = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
            print(f"warning: resuming {run_dir} with changed settings, applied from here on: "
                  f"{shown}", file=sys.stderr)
        rundir.clear_leftovers(run_dir)
        return run_dir, lock
    with writing(run_dir, "its marker and config.yaml"):
        rundir.prepare(run_dir, rundir.RUN_LAYOUT, found)
        save_config(cfg, run_dir / "config.yaml")
    return run_dir, lock


def apply_lora(model: torch.nn.Module, lora, task_type: str | None, key: str):
    """Wrap ``model`` with peft LoRA adapters; the base weights are frozen. With
    ``lora.merged_passes`` its no-grad passes may run on merged weights (`rlpipe.core.models.lora`).
    ``key``: the config key errors name (``models.actor.lora``)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules, task_type=task_type)
    try:
        with warnings.catch_warnings():  # peft reads an attribute transformers 5 deprecates
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            model = get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"{key}: {' '.join(str(exc).split())}") from exc
    return allow_merging(model) if lora.merged_passes else model


def merged_lora_copy(actor_cfg, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain model on CPU holding ``state`` (a LoRA actor's full state dict, gathered from its
    shards) with the adapters merged: what ``final/`` exports when the training model is sharded
    and cannot be copied and merged in place."""
    from transformers import AutoConfig, AutoModelForCausalLM


    config = AutoConfig.from_pretrained(str(actor_cfg.path),
                                        trust_remote_code=actor_cfg.trust_remote_code)
    base = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[actor_cfg.dtype],
                                            trust_remote_code=actor_cfg.trust_remote_code)
    model = apply_lora(base, actor_cfg.lora, "CAUSAL_LM", "models.actor.lora")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n in missing if n.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"merging the gathered LoRA state: missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}")
    return model.merge_and_unload().eval()


def build_models(cfg: Config, device: torch.device, need_critic: bool) -> Models:
    """Actor (LoRA optional), reference (a frozen copy of the initial actor, or the LoRA actor with
    adapters disabled), and a critic when the advantage estimator needs one."""
    actor_cfg, critic_cfg = cfg.models.actor, cfg.models.critic
    trust = actor_cfg.trust_remote_code
    tokenizer = load_tokenizer(actor_cfg.path, trust)
    actor = load_causal_lm(actor_cfg.path, actor_cfg.init, actor_cfg.dtype, trust).to(device)
    critic = None
    if need_critic and not critic_cfg.shared_backbone:  # copied before any LoRA touches the actor
        if critic_cfg.path is None:
            critic = ValueModel.from_actor(actor)
        elif critic_cfg.from_reward_model:  # backbone and head of the reward model (TRL)
            critic = critic_from_reward_model(critic_cfg.path, tokenizer,
                                              critic_cfg.trust_remote_code)
        else:
            critic = ValueModel.from_pretrained(critic_cfg.path, critic_cfg.init,
                                                critic_cfg.trust_remote_code)
        if critic_cfg.lora is not None:
            critic.backbone = apply_lora(critic.backbone, critic_cfg.lora, None,
                                         "models.critic.lora")
        critic = critic.to(device).eval()
    reference = frozen_copy(actor) if actor_cfg.lora is None else None
    if actor_cfg.lora is not None:
        actor = apply_lora(actor, actor_cfg.lora, "CAUSAL_LM", "models.actor.lora").eval()
    if need_critic and critic_cfg.shared_backbone:
        if critic_cfg.path is not None or critic_cfg.lora is not None:
            raise UserError("models.critic.shared_backbone: the critic is the actor's backbone; "
                            "do not also set models.critic.path or models.critic.lora")
        critic = ValueModel.from_actor(actor, shared=True).to(device)
    if actor_cfg.gradient_checkpointing:  # also covers a shared-backbone critic
        enable_checkpointing(actor)
    if critic is not None and critic_cfg.gradient_checkpointing:
        enable_checkpointing(critic)
    if cfg.models.compile_logprobs:
        _check_compile(device, _DTYPES[actor_cfg.dtype])
    offload = _check_offload(cfg, reference)
    if offload:
        reference.to("cpu")  # it visits `device` only inside Models.reference()
    autocast = {"none": None, "bfloat16": torch.bfloat16}[cfg.models.autocast]
    # one process: under FSDP2 a backbone called alone skips its root's unshard, and a block's
    # KV cache is not among the outputs FSDP2 hooks to unshard the block again for backward
    shared = cfg.models.shared_prefix and cfg.distributed.nproc == 1
    return Models(actor, reference, critic, tokenizer, device if offload else None, autocast,
                  shared, cfg.models.packed, cfg.models.compile_logprobs)


def _check_compile(device: torch.device, dtype: torch.dtype) -> None:
    """``models.compile_logprobs``: the kernels compile now, or one line says why not."""
    try:
        ops.check_compiled(device, dtype)
    except UserError:
        raise
    except Exception as exc:  # inductor's errors have no common base class
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"models.compile_logprobs: torch.compile cannot build the log-prob "
                        f"kernels here ({type(exc).__name__}: {first[:200]}); set "
                        f"models.compile_logprobs: false") from None


def _check_offload(cfg: Config, reference) -> bool:
    """Whether to offload the frozen reference; names the setting that rules it out."""
    if not cfg.models.reference.offload:
        return False
    if reference is None:
        raise UserError("models.reference.offload: a LoRA actor's reference is the actor itself "
                        "with its adapters disabled; there is no copy to offload")
    if cfg.distributed.nproc > 1:
        raise UserError("models.reference.offload is for one process; with distributed.nproc > 1 "
                        "use distributed.shard_frozen: true to spread the reference instead")
    return True


def shard_models(models: Models, cfg: Config) -> None:
    """FSDP2-shard actor, critic and (``distributed.shard_frozen``) the frozen reference in place."""

    if cfg.models.critic.shared_backbone:
        raise UserError("models.critic.shared_backbone is not supported with distributed.nproc > 1")
    bf16 = cfg.distributed.bf16
    shard(models.actor, bf16)
    if models.critic is not None:
        shard(models.critic, bf16)
    if models.frozen_reference is not None and cfg.distributed.shard_frozen:
        shard(models.frozen_reference, bf16)


@dataclass
class Plugins:
    collector: object
    rewards: RewardComposer
    advantage: torch.nn.Module
    loss: torch.nn.Module
    environment: MultiTurn | None = None   # multi-turn: the collector's turns with the environment


def _make(stage: Stage, ctx: RunContext):
    """The plugin instance of ``stage`` (the plugin `load_config` resolved, with the plan's
    arguments), tagged with its label so that errors in its later calls name it
    (`registry.call`)."""
    if isinstance(stage.plugin.spec, compose.ObjectSpec):  # a stage given as a Python object
        return compose.make(stage.plugin.spec, ctx, stage.label)
    return registry.instantiate(stage.plugin.obj, dict(stage.args), ctx, stage.label)


def build_plugins(cfg: Config, ctx: RunContext, plan: RunPlan | None = None) -> Plugins:
    """The plugins of ``plan`` (`plan_run` of ``cfg`` when not given), built with ``ctx``."""
    plan = plan or plan_run(cfg)
    collector = _make(plan.collector, ctx)
    parts = [(r.key, r.weight, _make(stage, ctx)) for r, stage in zip(cfg.rewards, plan.rewards)]
    advantage, loss = _make(plan.advantage, ctx), _make(plan.loss, ctx)
    rewards = RewardComposer(parts, clip=cfg.reward.clip, normalize=cfg.reward.normalize)
    return Plugins(collector, rewards.to(ctx.device), advantage.to(ctx.device), loss.to(ctx.device),
                   multi_turn(plan, ctx, collector))


def multi_turn(plan: RunPlan, ctx: RunContext, collector) -> MultiTurn | None:
    """The plan's environment over ``collector``'s engine (None without one): training's and
    evaluation's conversations, one fresh environment instance per conversation."""
    if plan.environment is None:
        return None
    b = plan.budgets  # a row's response: what the context leaves after the prompt budget
    budget = (b.context_tokens - b.prompt_tokens if b.context_tokens > b.prompt_tokens
              else plan.environment_contract.max_turns * b.new_tokens * 4)
    spec = plan.environment.plugin.spec
    if getattr(spec, "instance", None) is not None:  # an object from Python: a copy each
        made = _make(plan.environment, ctx)
        fresh = lambda: copy.deepcopy(made)  # noqa: E731
    else:
        fresh = lambda: _make(plan.environment, ctx)  # noqa: E731
    return MultiTurn(collector, fresh, plan.environment_contract, ctx.tokenizer, budget,
                     plan.environment.label, plan.sampling.streams)


def needs_critic(cfg: Config) -> bool:
    """Critic-free estimators declare ``AdvantageContract(needs_critic=False)``; no critic is
    built or trained then (`rlpipe.core.contracts.kinds.advantage_contract`; one that declares
    nothing gets a critic). Read from the advantage as it runs: the object given to `Pipeline`,
    or the class its section names, with its section's arguments."""
    plugin = resolve_plugin(cfg.advantage, "advantages")
    spec = plugin.spec
    if isinstance(spec, compose.ObjectSpec):  # an instance: its attributes; a factory: its kwargs
        args = None if spec.instance is not None else dict(spec.kwargs)
    else:
        args = references.plugin_args(cfg.advantage)
    label = f"advantage ({spec.label})"
    return advantage_contract(plugin.obj, args, label).needs_critic


def load_run_data(cfg, plan: RunPlan, dataset=None) -> tuple[PromptData, dict | None]:
    """The training data (``dataset``, else ``data.prompts``) and the held-out data
    (``eval.prompts``, or None), checked before any model is built: chat prompts against the
    collector's chat template, the columns each reward's contract reads."""
    d, e = cfg.data, cfg.eval
    if dataset is None and d.prompts is None:
        raise UserError("data.prompts: required (a file, a folder or a Hub dataset name), or "
                        "pass dataset= to Pipeline(...) / train(...) in Python")
    source, key = (d.prompts, "data.prompts") if dataset is None else (dataset, "dataset")
    data = load_prompt_data(source, d.split, d.prompt_key, key)
    held_out = {name: load_prompt_data(source, e.split, e.prompt_key, "eval.prompts" +
                                       (name and f".{name}"))
                for name, source in (e.prompts if isinstance(e.prompts, dict) else
                                     {"": e.prompts} if e.prompts else {}).items()}
    readers = {stage.name: contract for stage, contract in zip(plan.rewards, plan.reward_contracts)}
    for found in (data, *held_out.values()):
        check_reward_columns(readers, found, found.source)
        if found.chat and plan.sampling.chat_template:
            raise UserError(f"collector.chat_template: the prompts of {found.source} are chat "
                            f"messages, which rlpipe already applies through the chat template; "
                            f"set collector.chat_template: false")
    if len(data) < d.batch_size:
        print(f"warning: {key} has {len(data)} prompt(s), fewer than data.batch_size="
              f"{d.batch_size}: prompts repeat within a step", file=sys.stderr)
    return data, held_out or None


@dataclass
class Run:
    """The plain objects `build_run` makes of a config, which `rlpipe.Pipeline` holds."""

    dist: Dist                # this process's place in the job
    device: torch.device
    run_dir: Path
    lock: rundir.Held | None  # this process owns the run directory (the main process only)
    status: Status            # start-up lines (main process)
    models: Models            # actor, critic, reference, tokenizer
    ctx: RunContext           # what plugins were built with
    plugins: Plugins          # collector, rewards, advantage, loss
    data: PromptData          # training prompts, checked before any model loads
    eval_data: dict[str, PromptData] | None   # by eval.prompts' name ("": its one source)


def build_run(cfg: Config, plan: RunPlan, overwrite: bool = False, resume: bool = False,
              dataset=None) -> Run:
    """Everything a run of ``cfg`` (planned as ``plan``, `plan_run`) starts from, in order: its
    data (checked first), seeds, processes, the run directory, models (sharded under FSDP2),
    plugins, the data's prompts through the actor's tokenizer."""
    data, eval_data = load_run_data(cfg, plan, dataset)  # bad data fails before models
    seed_everything(cfg.run.seed)
    dist, device_name = distributed.init(cfg.run.device, cfg.distributed.timeout_s)
    device = resolve_device(device_name)
    flush_denormals(cfg.run.flush_denormals)  # x86 runs arithmetic on denormals 10-50x slower
    keep_freed_memory(cfg.run.keep_freed_memory)  # no page faults for a reused large tensor
    run_dir, lock = prepare_run_dir(cfg, overwrite, resume, dist.is_main)
    try:
        return _build_in(cfg, plan, dist, device, run_dir, lock, data, eval_data, dataset)
    except BaseException:  # the run directory is not left locked by a build that failed
        if lock is not None:
            lock.release()
        raise


def _build_in(cfg, plan, dist, device, run_dir, lock, data, eval_data, dataset) -> Run:
    """`build_run`'s part inside the run directory: models, plugins, the data's tokenizer."""
    dist.barrier()  # the run directory exists for every rank from here on
    status = Status(dist.is_main)
    with status.phase(f"loading models from {cfg.models.actor.path} on {device}") as took:
        models = build_models(cfg, device, plan.advantage_contract.needs_critic)
    for line in describe_models(models, took()):
        status.say(line)
    if models.autocast is not None:
        slow = device.type == "cpu" and not cpu_has_bf16()
        status.say("autocast: actor, critic and reference compute in bfloat16 (weights, "
                   "gradients and optimizer state stay float32; models.autocast)" +
                   ("; this CPU has no bf16 instructions (AVX512-BF16, AMX): torch emulates "
                    "them, far slower than float32" if slow else ""))
    if dist.enabled:
        if cfg.data.batch_size < dist.world:
            raise UserError(f"data.batch_size={cfg.data.batch_size} gives some of the "
                            f"{dist.world} processes no prompt; raise it")
        shard_models(models, cfg)
        seed_everything(cfg.run.seed + dist.rank)  # a sampling stream per rank
    ctx = RunContext(tokenizer=models.tokenizer, actor=models.actor, device=device,
                     max_new_tokens=plan.budgets.new_tokens, seed=cfg.run.seed, run_dir=run_dir,
                     shared_prefix=models.shared_prefix)
    names = ", ".join(s.name for s in (plan.collector, *plan.rewards, plan.advantage, plan.loss))
    with status.phase(f"building plugins ({names})") as took:
        plugins = build_plugins(cfg, ctx, plan)
    if plugins.environment is not None:  # training's environment calls (docs/replay.md)
        plugins.environment.journal = Journal(run_dir / FOLDER, dist.rank)
    status.say(f"plugins ready in {took():.1f} s")
    for found in (data, *(eval_data or {}).values()):
        found.use_tokenizer(models.tokenizer)  # chat prompts through the template, every row
    origin = cfg.data.prompts if dataset is None else "the dataset= object"
    status.say(f"data: {len(data)} prompts from {origin}, {cfg.data.batch_size} per step")
    return Run(dist, device, run_dir, lock, status, models, ctx, plugins, data, eval_data)
