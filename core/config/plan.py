"""The run, planned once: `plan_run` turns a checked config into one frozen `RunPlan`.

Every fact a run derives from its config is derived here, once, and read from the plan after:
the plugins its sections name, each one's contract, where the KL penalty acts and its
estimator, how stage 2 scores (`Scoring`), where the rollout's values come from, the keys a
collector must return, the token budgets. Nothing is written back into the config: ``rlpipe
config`` shows what the user wrote; ``rlpipe check`` and the run directory's ``plan.json`` show
what was derived. Two facts exist only once the models and the collector are built (the actor's
dtype; whether the collector offers ``record_actor_log_prob`` and ``record_hidden``): `settle`,
the plan's second step, fixes the final scoring path and value source then, and nothing else.

>>> tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"  # a checkout
>>> from rlpipe.core.config.settings import load_config
>>> plan = plan_run(load_config(tiny, ["advantage.name=grpo"]))
>>> plan.kl.in_, plan.kl.estimator, plan.kl.chosen, plan.scoring.value, plan.values
('loss', 'k2', ('kl.in', 'kl.estimator'), 'sampling', 'none')
>>> plan.budgets  # a default prompt budget, lowered to fit the model's context of 256 tokens
Budgets(prompt_tokens=232, new_tokens=24, context_tokens=256)
>>> plan.advantage.name, plan.advantage_contract.needs_groups, plan.collected[-1]
('grpo', True, 'actor_log_prob')
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from types import MappingProxyType

import torch

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.config import checks
from rlpipe.core.config.checks import resolve_plugin
from rlpipe.core.config.kl_placement import check_placement, resolve_placement
from rlpipe.core.contracts import references, registry
from rlpipe.core.contracts import environment as env_contract
from rlpipe.core.contracts.collector import (contract_of, request_actor_log_prob,
                                             request_hidden)
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.contracts.reward_fn import describe_reward
from rlpipe.core.contracts.kinds import (AdvantageContract, CollectorContract, LossContract,
                                         RewardContract, advantage_contract, reward_contract,
                                         undeclared_notice)

INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)
_told: set[str] = set()  # lines said once per process (a config is planned at load and at build)


class Scoring(enum.Enum):
    """Stage 2's path: where ``old_log_prob`` comes from (``ref_log_prob`` is always a forward
    of the reference)."""

    FORWARD = "forward"    # a no-grad forward of the actor (and the critic, in the same pass)
    ENGINE = "engine"      # rollout_correction.mode bypass: the engine's own log-probs
    SAMPLING = "sampling"  # the sampling pass's actor_log_prob (rollout_correction.old_log_prob)


@dataclass(frozen=True)
class Stage:
    """One plugin as the run builds it: its section's ``key`` (``rewards.0``), ``name`` (a
    reward's label, else the section's name), the loaded ``plugin`` and constructor ``args``."""

    key: str
    name: str
    plugin: registry.Plugin
    args: Mapping

    @property
    def label(self) -> str:
        return f"{self.key} ({self.plugin.spec.label})"


@dataclass(frozen=True)
class KLPlan:
    """The ``kl`` section with ``kl.in`` and ``kl.estimator`` resolved (what `KLPenalty` reads);
    ``chosen``: the keys the config left null, chosen for the advantage's contract."""

    in_: str
    estimator: str
    coef: float
    clamp: float | None
    target: float | None
    horizon: int
    chosen: tuple[str, ...] = ()


@dataclass(frozen=True)
class Budgets:
    """Tokens per sample: prompt (a default budget lowered to fit the context), response, and
    the smallest context of the actor, critic and engine (0: unknown)."""

    prompt_tokens: int
    new_tokens: int
    context_tokens: int


@dataclass(frozen=True)
class RunPlan:
    """Everything a run derives from its config (module docstring)."""

    collector: Stage
    rewards: tuple[Stage, ...]
    advantage: Stage
    loss: Stage
    sampling: CollectorContract          # the collector's contract, for the plan's args
    advantage_contract: AdvantageContract
    reward_contracts: tuple[RewardContract, ...]
    loss_contract: LossContract
    kl: KLPlan
    scoring: Scoring
    values: str                          # none, forward, critic or rollout (`_values`)
    budgets: Budgets
    settled: bool = False                # `settle` has run: scoring and values are final
    environment: Stage | None = None     # multi-turn: the environment answering each turn
    environment_contract: EnvironmentContract | None = None
    reward_lines: tuple[str, ...] = ()   # `settle`: each reward's convention and columns read

    @property
    def collected(self) -> tuple[str, ...]:
        """The keys every collected batch must hold."""
        return (*INPUTS, S.GROUP_ID, S.FINISHED, S.ENGINE_LOG_PROB,
                *([S.ACTOR_LOG_PROB] if self.scoring is Scoring.SAMPLING else []),
                *([S.ACTION_MASK, S.TURN_ID, S.TURN_REWARD, S.NUM_TURNS, S.STOP_REASON]
                  if self.environment is not None else []))

    def to_dict(self) -> dict:
        """The plan as plain values (``plan.json``, ``rlpipe check``)."""
        stages = (self.collector, *self.rewards, self.advantage, self.loss,
                  *([self.environment] if self.environment else []))
        return {
            "stages": {s.key: s.plugin.spec.label for s in stages},
            "contracts": {"collector": _plain(self.sampling),
                          "advantage": _plain(self.advantage_contract),
                          "rewards": {s.name: _plain(c) for s, c in
                                      zip(self.rewards, self.reward_contracts)},
                          "loss": _plain(self.loss_contract),
                          "environment": _plain(self.environment_contract)},
            "kl": {("in" if k == "in_" else k): v for k, v in _plain(self.kl).items()},
            "scoring": self.scoring.value, "values": self.values,
            "settled": self.settled, "collected": list(self.collected),
            "rewards_detected": list(self.reward_lines),
            "budgets": _plain(self.budgets)}


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (frozenset, set)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _stage(section, key: str, group: str) -> tuple[Stage, dict | None]:
    """The stage of ``section``, and the arguments its contract is asked with (None: an
    instance given from Python, whose attributes say them)."""
    plugin = resolve_plugin(section, group)
    spec = plugin.spec
    if getattr(spec, "instance", None) is not None:
        args = None
    else:
        args = dict(spec.kwargs) if hasattr(spec, "factory") else references.plugin_args(section)
    name = section.key if group == "rewards" else str(section.name)
    return Stage(key, name, plugin, MappingProxyType(dict(args or {}))), args


def _tell(line: str) -> None:
    """Print ``line`` on stderr once per process, on the main process."""
    if line not in _told and os.environ.get("RANK", "0") == "0":
        _told.add(line)
        print(f"warning: {line}", file=sys.stderr)


def plan_run(cfg) -> RunPlan:
    """The `RunPlan` of ``cfg`` (a checked `Config`); what the plugins' contracts rule out is a
    `UserError` naming the key, and an advantage that declares no contract is told on one line."""
    collector, collector_args = _stage(cfg.collector, "collector", "collectors")
    sampling = contract_of(collector.plugin.obj, collector_args or {}, collector.label)
    checks.check_batches(cfg, sampling.samples_per_prompt)
    prompt_tokens, context = checks.check_context(cfg, sampling)
    if prompt_tokens != sampling.max_prompt_tokens:  # a default prompt budget lowered to fit
        args = {**collector.args, sampling.budget_args[0]: prompt_tokens}
        collector = replace(collector, args=MappingProxyType(args))
        sampling = replace(sampling, max_prompt_tokens=prompt_tokens)
    checks.check_rollout_correction(cfg, sampling)
    advantage, advantage_args = _stage(cfg.advantage, "advantage", "advantages")
    label = f"advantage {advantage.plugin.spec.label}"
    declared = advantage_contract(advantage.plugin.obj, advantage_args, label)
    notice = undeclared_notice(label, declared)
    if notice:
        _tell(notice)
    checks.check_groups(cfg, label, declared.needs_groups, sampling.samples_per_prompt)
    where, estimator, chosen = resolve_placement(cfg.kl, declared)
    check_placement(where, cfg.kl.coef, declared, label)
    rewards = [_stage(r, f"rewards.{i}", "rewards") for i, r in enumerate(cfg.rewards)]
    reward_contracts = tuple(reward_contract(s.plugin.obj, args, s.label) for s, args in rewards)
    checks.check_critic_pretrain(cfg, label, declared.needs_critic,
                                 {s.name: c for (s, _), c in zip(rewards, reward_contracts)})
    loss = _stage(cfg.loss, "loss", "losses")[0]
    environment, env_declared = _environment(cfg)
    if declared.needs_turns and environment is None:
        raise UserError(f"{label} scores turns (turn_reward), which a run without an environment "
                        f"does not have; add an environment section, or use grpo")
    scoring = _scoring(cfg)
    return RunPlan(collector, tuple(s for s, _ in rewards), advantage, loss, sampling, declared,
                   reward_contracts, getattr(loss.plugin.obj, "contract", None) or LossContract(),
                   KLPlan(where, estimator, cfg.kl.coef, cfg.kl.clamp, cfg.kl.target,
                          cfg.kl.horizon, chosen),
                   scoring, _values(cfg, declared, scoring),
                   Budgets(prompt_tokens, sampling.max_new_tokens, context),
                   environment=environment, environment_contract=env_declared)


def _environment(cfg) -> tuple[Stage | None, EnvironmentContract | None]:
    """The environment's stage and contract (none without an ``environment`` section). A
    multi-turn run samples a step ahead only without one (one-step off-policy would run the
    environments in a thread during the update: not supported yet)."""
    if cfg.environment is None:
        return None, None
    stage, args = _stage(cfg.environment, "environment", "environments")
    if cfg.rollout.staleness:
        raise UserError("rollout.staleness: 1 is not supported with an environment yet (its "
                        "turns would run during the update); set rollout.staleness: 0")
    declared = env_contract.contract_of(stage.plugin.obj, args or {}, stage.label)
    return stage, declared


def _scoring(cfg) -> Scoring:
    """The path the config asks for; `settle` keeps `Scoring.SAMPLING` only where the actor
    computes in float32 (for ``auto``) and the collector offers ``record_actor_log_prob``."""
    section = cfg.rollout_correction
    if section.mode == "bypass":
        return Scoring.ENGINE
    exact = not cfg.distributed.bf16 and cfg.models.autocast == "none"  # float32 round-off
    if section.mode != "none" or section.old_log_prob == "recompute" or cfg.rollout.staleness \
            or (section.old_log_prob == "auto" and not exact) or cfg.environment is not None:
        return Scoring.FORWARD
    return Scoring.SAMPLING


def _values(cfg, declared: AdvantageContract, scoring: Scoring) -> str:
    """Where the rollout's values come from: none (no critic: 0), the scoring forward, a critic
    forward, or (no actor forward, a critic on the actor's backbone, one process, on-policy) the
    critic's head on the rollout's own hidden states, where the collector offers them (`settle`)."""
    if not declared.needs_critic:
        return "none"
    if scoring is Scoring.FORWARD:
        return "forward"
    one_process = checks.world_size(cfg.distributed) == 1
    shared = cfg.models.critic.shared_backbone
    return "rollout" if shared and one_process and not cfg.rollout.staleness else "critic"


def settle(plan: RunPlan, cfg, models, plugins, dist) -> RunPlan:
    """The plan's second step, once the models and plugins exist: the final `Scoring` (the
    collector asked to write ``actor_log_prob``, or the plan falls back to a forward) and value
    source (the collector asked to write ``engine_hidden``), and the loss instance's contract."""
    scoring, collector = plan.scoring, plugins.collector
    if scoring is Scoring.SAMPLING:
        exact = next(models.actor.parameters()).dtype == torch.float32  # also a model handed in
        wanted = cfg.rollout_correction.old_log_prob
        if wanted == "auto" and not exact:
            scoring = Scoring.FORWARD
        elif not request_actor_log_prob(collector, plan.sampling.temperature,
                                        plan.sampling.truncation):
            if wanted == "sampling":
                raise UserError(f"rollout_correction.old_log_prob: sampling needs a collector "
                                f"that writes actor_log_prob, and {registry.label_of(collector)} "
                                f"declares no record_actor_log_prob; use auto or recompute")
            scoring = Scoring.FORWARD
    values = plan.values if scoring is plan.scoring else _values(cfg, plan.advantage_contract,
                                                                  scoring)
    if values == "rollout" and not (models.critic is not None and models.critic.shared
                                    and not dist.enabled and request_hidden(collector)):
        values = "critic"
    loss_contract = getattr(plugins.loss, "contract", None) or plan.loss_contract
    lines = tuple(describe_reward(label, module, contract.columns) for label, module, contract
                  in zip(plugins.rewards.labels, plugins.rewards.parts, plan.reward_contracts))
    return replace(plan, scoring=scoring, values=values, loss_contract=loss_contract,
                   settled=True, reward_lines=lines)
