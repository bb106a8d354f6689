"""The rules between config keys, checked by `load_config` before any model is built.

Single keys (types, ranges, files) are checked while the YAML is converted (`rlpipe.core.base.yamlconf`);
what needs several keys, or a plugin's signature, or the model's ``config.json``, is here:

- plugin arguments against each plugin constructor's signature (each plugin is resolved here,
  once, and kept on its section for build: `resolve_plugin`);
- ``data.prompts`` and ``eval.prompts``: a path that exists or a Hub dataset name;
- at least one reward, unique reward labels; ``ptx.data`` when ``ptx.coef > 0``;
- the samples of a step (``data.batch_size`` x collector ``n``) split into ``train.minibatches``
  minibatches of at least (processes x ``train.grad_accum``) samples, and a prompt per process;
- ``distributed.rdzv_endpoint`` is HOST:PORT, required when ``distributed.nnodes > 1``;
- the collector's ``max_prompt_tokens + max_new_tokens`` fit the model's context (an unset
  ``max_prompt_tokens`` is lowered to fit, in the run's plan), and so does ``ptx.max_tokens``;
- the ``health`` section: installed rule names, each rule's parameters (`rlpipe.core.observe.health`).
- a ``rollout_correction.mode`` other than none, with top-k / top-p sampling, needs
  ``collector.score_truncated: true`` (else every weight carries the truncation's bias);
  ``rollout_correction.old_log_prob: sampling`` needs mode none (the other modes measure the
  engine against a trainer forward, or take the engine's log-probs);
- ``rollout.staleness: 1`` needs a ``rollout_correction.mode`` other than none (or
  ``rollout.accept_uncorrected``), old log-probs recomputed, and no ``data.dynamic_sampling``;
- ``models.autocast`` and ``distributed.bf16`` are two ways to compute in bf16: one at a time;
- ``eval.*`` settings without ``eval.prompts`` are a warning (nothing is evaluated);
- an advantage that declares ``needs_groups`` (grpo, rloo), and ``data.dynamic_sampling``, need
  collector ``n >= 2``.

The rules that read a plugin's contract (batches, context, rollout correction, groups, critic
pretraining) take the contract as an argument: `rlpipe.core.config.plan.plan_run` computes each
contract once and calls them (with the KL placement, `rlpipe.core.config.kl_placement`).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import typing
from pathlib import Path
from typing import Any

from rlpipe.core.base.truncation import Truncation
from rlpipe.core.contracts import references, registry
from rlpipe.core.models.critic_start import check_critic_start
from rlpipe.core.base.errors import UserError
from rlpipe.core.data.prompts import data_source
from rlpipe.core.observe.health import load_rules
from rlpipe.core.observe.metrics import check_trackers

PLUGIN_GROUPS = {"collector": "collectors", "advantage": "advantages", "loss": "losses",
                 "rewards": "rewards", "environment": "environments"}
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions")


def _eval_sources(prompts, conv):
    """``eval.prompts`` checked as ``data.prompts``; a mapping's names are identifiers."""
    if not isinstance(prompts, dict):
        return data_source(prompts, conv, "eval.prompts")
    if not prompts or not all(str(name).isidentifier() for name in prompts):
        raise UserError(f"eval.prompts: a mapping needs names made of letters, digits and _, "
                        f"got {list(prompts)}")
    return {n: data_source(conv.value(s, Path | str, f"eval.prompts.{n}"), conv, f"eval.prompts.{n}")
            for n, s in prompts.items()}


def check_config(cfg, conv) -> None:
    """Every rule above; the first one broken is a `UserError` naming its key."""
    cfg.data.prompts = data_source(cfg.data.prompts, conv, "data.prompts")
    cfg.eval.prompts = _eval_sources(cfg.eval.prompts, conv)
    for key, group in PLUGIN_GROUPS.items():
        sections = getattr(cfg, key)
        for i, section in enumerate(sections if isinstance(sections, list) else
                                    [sections] if sections is not None else []):
            check_plugin_args(section, f"{key}.{i}" if key == "rewards" else key, group, conv)
    labels = [r.key for r in cfg.rewards]  # none: `Pipeline(rewards=...)` must give them
    if len(set(labels)) != len(labels):
        raise UserError(f"rewards: duplicate reward names {labels}; give repeated plugins a `label`")
    if cfg.ptx.coef > 0 and cfg.ptx.data is None:
        raise UserError("ptx.data: required when ptx.coef > 0")
    if cfg.train.min_lr_ratio > 0 and cfg.train.schedule != "cosine":
        raise UserError("train.min_lr_ratio: the floor of the cosine schedule; set "
                        "train.schedule: cosine, or leave it at 0")
    check_rendezvous(cfg.distributed)
    if cfg.kl.target is not None and cfg.kl.coef == 0:  # also refused by the controller itself
        raise UserError(f"kl.coef: 0 with kl.target: {cfg.kl.target:g}: the adaptive controller "
                        f"multiplies the coefficient, so it would stay 0 and the KL never be "
                        f"penalised; set kl.coef > 0 (the starting value, e.g. 0.05), or "
                        f"kl.target: null for no KL penalty")
    if cfg.models.autocast != "none" and cfg.distributed.bf16:
        raise UserError("models.autocast: distributed.bf16 already computes in bf16 (FSDP mixed "
                        "precision); set one of the two")
    check_critic_start(cfg)
    _warn_unused_eval(cfg.eval)
    check_staleness(cfg)
    check_trackers(cfg.log)  # a missing tracker package: now, not after the models load
    cfg.health.resolved = load_rules(cfg.health, conv)


def _warn_unused_eval(section) -> None:
    """``eval.*`` settings without ``eval.prompts`` do nothing: one warning line says so."""
    import dataclasses
    import sys

    if section.prompts is not None or os.environ.get("RANK", "0") != "0":
        return
    default = type(section)()
    unused = [f"eval.{f.name}" for f in dataclasses.fields(section)
              if getattr(section, f.name) != getattr(default, f.name)]
    if unused:
        print(f"warning: {', '.join(unused)} set without eval.prompts: no evaluation runs",
              file=sys.stderr)


def resolve_plugin(section, group: str) -> registry.Plugin:
    """The plugin a config section names, resolved once: `load_config` keeps it on the section
    (``section.resolved``) and build takes it from there. A section built by hand, or renamed
    since, is resolved now."""
    plugin = section.resolved
    if plugin is None or (plugin.spec.group, plugin.spec.name) != (group, references.spec_name(section)):
        plugin = section.resolved = references.load(section, group)
    return plugin


def check_plugin_args(section, key: str, group: str, conv) -> None:
    """Check a plugin section's arguments against the plugin constructor's signature (a reward
    file's ``path`` first becomes absolute, relative to the config file)."""
    if getattr(section, "function", None) is not None or section.name is None:
        references.check_reward_file(section, key, conv)
    elif f"{key}.name" in conv.cli_keys:  # the plugin changed on the command line
        references.drop_foreign_args(section, key, group, conv.cli_keys)
    plugin = resolve_plugin(section, group)
    spec, params = plugin.spec, registry.init_params(plugin.obj)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    for arg, value in references.plugin_args(section).items():
        if arg not in named and not takes_any:
            raise UserError(f"{key}.{arg}: unknown argument for plugin {spec.label}; "
                            f"accepted: {', '.join(named) or 'none'}")
        if arg in named and named[arg].annotation is not inspect.Parameter.empty:
            hint = named[arg].annotation
            if isinstance(hint, str):  # `from __future__ import annotations` in the plugin
                obj = plugin.obj
                hint = typing.get_type_hints(obj.__init__ if inspect.isclass(obj) else obj).get(arg, Any)
            section.args[arg] = conv.value(value, hint, f"{key}.{arg}")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in section.args]
    if missing:
        raise UserError(f"{key}: plugin {spec.label} needs argument(s) {', '.join(missing)}")


def _count(value) -> bool:
    """A whole number >= 1 (anything else is left to the plugin's own constructor check)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def world_size(dist_cfg) -> int:
    """Processes in the job: torchrun's ``WORLD_SIZE`` when launched, else nproc x nnodes."""
    launched = os.environ.get("WORLD_SIZE", "")
    return int(launched) if launched.isdigit() and int(launched) >= 1 else dist_cfg.nproc * dist_cfg.nnodes


def check_batches(cfg, n: int) -> None:
    """The runtime split of a step's samples (`rlpipe.core.step.update`), checked at load;
    ``n``: samples per prompt (the collector's contract)."""
    t, prompts, world = cfg.train, cfg.data.batch_size, world_size(cfg.distributed)
    samples = prompts * n
    if world > 1 and prompts < world:
        raise UserError(f"data.batch_size={prompts} gives some of the {world} processes no prompt; "
                        f"raise it to at least {world}")
    if samples % t.minibatches:
        raise UserError(f"train.minibatches: {t.minibatches} does not divide the {samples} samples "
                        f"per step (data.batch_size={prompts} x collector n={n})")
    size, need = samples // t.minibatches, world * t.grad_accum
    if size < need:
        key = "train.grad_accum" if t.grad_accum > 1 else "train.minibatches"
        split = (f"train.grad_accum={t.grad_accum} micro-batches" if world == 1 else
                 f"{world} processes x train.grad_accum={t.grad_accum} = {need} micro-batches")
        raise UserError(f"{key}: a minibatch of {size} samples ({samples} samples per step / "
                        f"train.minibatches={t.minibatches}) cannot be split into {split}")


def check_rendezvous(d) -> None:
    if d.rdzv_endpoint is not None:
        match = _ENDPOINT.fullmatch(d.rdzv_endpoint)
        if not match or not 1 <= int(match.group(2)) <= 65535:
            raise UserError(f"distributed.rdzv_endpoint: expected HOST:PORT with a port in "
                            f"1..65535 (for example node0:29500), got {d.rdzv_endpoint!r}")
    elif d.nnodes > 1:
        raise UserError(f"distributed.rdzv_endpoint: required when distributed.nnodes > 1 "
                        f"(got nnodes={d.nnodes}); give HOST:PORT of the rendezvous, e.g. node0:29500")
    if not d.rdzv_id.strip():
        raise UserError("distributed.rdzv_id: must not be empty")


def context_limit(folder: Path) -> tuple[int, str] | None:
    """``(tokens, "max_position_embeddings=N in FILE")`` from a model folder's ``config.json``;
    None when the folder has no readable context length (the model loader reports a bad file)."""
    file = Path(folder) / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sections = [data, data.get("text_config")] if isinstance(data, dict) else []
    for section in filter(lambda s: isinstance(s, dict), sections):
        for name in _CONTEXT_KEYS:
            if _count(section.get(name)):
                return section[name], f"{name}={section[name]} in {file}"
    return None


def check_context(cfg, sampling) -> tuple[int, int]:
    """Prompt + response budget of the collector (``sampling``: its contract), and
    ``ptx.max_tokens``, within the context. Returns ``(prompt_tokens, context_tokens)``: the
    prompt budget (a default one lowered to fit) and the smallest context (0: none known)."""
    limits = [(f"the {role} model's context", context_limit(path)) for role, path in
              (("actor", cfg.models.actor.path), ("critic", cfg.models.critic.path)) if path]
    if sampling.context_tokens:
        limits.append(("the collector's engine length", (sampling.context_tokens,
                                                          "its contract's context_tokens")))
    limits = [(what, limit) for what, limit in limits if limit is not None]
    prompt, new = sampling.max_prompt_tokens, sampling.max_new_tokens
    (prompt_arg, new_arg), defaults = sampling.budget_args, sampling.defaults
    if prompt and new:
        for what, (tokens, source) in limits:
            if prompt + new <= tokens:
                continue
            if prompt_arg in defaults and new < tokens:  # the default prompt budget shrinks to fit
                prompt = tokens - new
                continue
            raise UserError(
                f"collector.{prompt_arg} + collector.{new_arg} = {prompt}"
                f"{' (default)' if prompt_arg in defaults else ''} + {new}"
                f"{' (default)' if new_arg in defaults else ''}"
                f" = {prompt + new} tokens exceed {what} of {tokens} tokens ({source}); lower one")
    actor = context_limit(cfg.models.actor.path)
    if cfg.ptx.coef > 0 and actor is not None and cfg.ptx.max_tokens > actor[0]:
        raise UserError(f"ptx.max_tokens: {cfg.ptx.max_tokens} exceeds the actor model's context "
                        f"of {actor[0]} tokens ({actor[1]})")
    return prompt, min((tokens for _, (tokens, _) in limits), default=0)


def check_rollout_correction(cfg, sampling) -> None:
    """Weights against truncated engine log-probs need the trainer to score truncated too
    (``sampling``: the collector's contract)."""
    mode = cfg.rollout_correction.mode
    if mode != "none" and cfg.rollout_correction.old_log_prob == "sampling":
        raise UserError(f"rollout_correction.old_log_prob: sampling needs rollout_correction.mode: "
                        f"none, got {mode} (which compares the engine with a trainer forward, or, "
                        f"bypass, takes the engine's own log-probs); use old_log_prob: auto")
    top_k, top_p = sampling.top_k, sampling.top_p
    truncated = Truncation(top_k, top_p).active and sampling.temperature > 0
    if mode != "none" and truncated and not sampling.score_truncated:
        raise UserError(f"rollout_correction.mode: {mode} compares the trainer's log-probs with the "
                        f"engine's, which come from the top-k/top-p truncated distribution "
                        f"(collector.top_k={top_k}, collector.top_p={top_p}); set "
                        f"collector.score_truncated: true")


def check_staleness(cfg) -> None:
    """``rollout.staleness: 1`` trains on tokens of the policy before the last update: corrected
    (tis, mis; bypass: PPO's ratio against the sampling policy), or ``accept_uncorrected``; the
    old log-probs recomputed at the current weights; one collection per step."""
    if not cfg.rollout.staleness:
        return
    section = cfg.rollout_correction
    if section.mode == "none" and not cfg.rollout.accept_uncorrected:
        raise UserError("rollout.staleness: 1 trains on tokens sampled before the last update, and "
                        "rollout_correction.mode: none leaves that uncorrected; set mode: tis or "
                        "mis, or rollout.accept_uncorrected: true")
    if section.old_log_prob == "sampling":
        raise UserError("rollout_correction.old_log_prob: sampling takes old log-probs from the "
                        "sampling pass, one update behind under rollout.staleness: 1; use auto")
    if cfg.data.dynamic_sampling.enabled:
        raise UserError("data.dynamic_sampling collects again within a step, which "
                        "rollout.staleness: 1 (one collection per step, a step ahead) does not "
                        "do; use one of them")


def check_critic_pretrain(cfg, label: str, needs_critic: bool, rewards: dict) -> None:
    """``train.critic_pretrain_rollouts`` (`rlpipe.core.step.critic_pretrain`) needs a critic of
    its own, raw scores and a reward that declares ``scores_prefixes`` (``rewards``: each
    reward's label and `RewardContract`; ``label``: the advantage's)."""
    if not cfg.train.critic_pretrain_rollouts:
        if cfg.train.critic_pretrain_epochs != 3:  # set without rollouts: it would do nothing
            raise UserError(f"train.critic_pretrain_epochs: {cfg.train.critic_pretrain_epochs} "
                            f"passes over no rollouts: critic pretraining runs only with "
                            f"train.critic_pretrain_rollouts > 0 (e.g. 96); set it, or leave "
                            f"critic_pretrain_epochs out")
        return
    key = "train.critic_pretrain_rollouts"
    if not needs_critic:
        raise UserError(f"{key}: {label} reads no value, so this run has no critic; set it to 0")
    if cfg.models.critic.shared_backbone:
        raise UserError(f"{key}: models.critic.shared_backbone puts the value head on the actor's "
                        f"own backbone, so pretraining the critic would move the policy; use a "
                        f"critic of its own")
    if cfg.reward.normalize:
        raise UserError(f"{key}: reward.normalize rescales the scores as the run goes, so the "
                        f"raw prefix scores are not the critic's target; turn one of them off")
    if rewards and not any(c.scores_prefixes for c in rewards.values()):
        raise UserError(f"{key}: none of the rewards ({', '.join(rewards)}) scores partial "
                        f"responses (declares scores_prefixes, as reward_model does)")


def check_groups(cfg, label: str, needs_groups: bool, n: int) -> None:
    """Groups of ``n >= 2`` samples for an advantage whose contract ``needs_groups`` (``label``
    names it), and for ``data.dynamic_sampling``."""
    if needs_groups and n < 2:
        raise UserError(f"collector.n: {label} compares the samples of each prompt, so it needs "
                        f"collector.n >= 2 (got {n}); with one sample per prompt it never updates")
    if cfg.data.dynamic_sampling.enabled and n < 2:
        raise UserError(f"data.dynamic_sampling drops the prompts whose samples all score the "
                        f"same, so it needs collector.n >= 2 (got {n})")
