"""The PPO loop: one TensorDict passes through the stages of each step, top to bottom.

    prompts -> 1. collect -> 2. log-probs/values -> 3. rewards -> 4. rollout correction
            -> 5. KL shaping -> 6. advantage -> 7. PPO epochs -> 8. weight sync -> 9. metrics

`Pipeline.train` runs the steps with the callbacks of `rlpipe.core.run.callbacks` around them.

One PPO step of the tiny example (a few seconds on CPU):

>>> import shutil, tempfile
>>> from rlpipe import load_config, train
>>> tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"  # a checkout
>>> out = Path(tempfile.mkdtemp()) / "tiny"
>>> run_dir = train(load_config(tiny, ["run.steps=1", f"run.output_dir={out}"]), progress=False)
>>> run_dir == out, sorted(p.name for p in out.iterdir())
(True, ['.rlpipe-run', 'config.yaml', 'final', 'metrics.jsonl', 'plan.json', 'samples'])
>>> shutil.rmtree(out.parent)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from rlpipe.core.run import build, checkpoint, oom
from rlpipe.core.run.callbacks import Hooks, default_callbacks
from rlpipe.core.run.offpolicy import OffPolicy
from rlpipe.core.config import compose
from rlpipe.core.observe import console, samples
from rlpipe.core.contracts import guards, registry
from rlpipe.core.step import critic_pretrain, kl
from rlpipe.core.base import schema
from rlpipe.core.step import rollout_correction as correction
from rlpipe.core.config.settings import Config, load_config
from rlpipe.core.config.plan import INPUTS, RunPlan, Scoring, plan_run, settle
from rlpipe.core.contracts.collector import close_collector
from rlpipe.core.models.critic_start import CriticWarmup
from rlpipe.core.data.streams import PromptStream
from rlpipe.core.step.evaluation import Evaluator, eval_collector
from rlpipe.core.base.errors import option, writing
from rlpipe.core.observe.metrics import to_float
from rlpipe.core.models.lm import logprobs_and_values, response_logprobs, response_values
from rlpipe.core.base.ops import masked_mean
from rlpipe.core.run.run_state import RunState
from rlpipe.core.step.actions import place_turn_rewards, run_advantage
from rlpipe.core.step.multiturn import env_metrics
from rlpipe.core.step.update import Updater
from rlpipe.core.step.dynamic_sampling import GroupFilter

S = schema


class Pipeline(RunState):
    """Builds everything a run needs from a `Config`; `train()` runs ``run.steps`` PPO steps.

    ``resume=True`` (or ``run.resume: auto``) continues from the newest complete checkpoint.
    ``collector``, ``rewards``, ``advantage``, ``loss``, ``environment``: stage objects that
    replace the config's sections (`rlpipe.core.config.compose`); ``dataset`` (a `datasets.Dataset`) replaces ``data.prompts``.
    """

    @console.quiet_libraries()  # transformers' own bars would cut through rlpipe's lines
    @oom.explains
    def __init__(self, cfg: Config, overwrite: bool = False, progress: bool = True,
                 resume: bool = False, *, dataset=None, collector=None, rewards=None,
                 advantage=None, loss=None, environment=None):
        cfg = cfg if isinstance(cfg, Config) else load_config(cfg)  # a dict or a YAML path
        self.cfg = cfg = compose.apply(cfg, collector=collector, rewards=rewards,
                                       advantage=advantage, loss=loss, environment=environment)
        self.progress = progress and cfg.log.progress
        self.resume = resume or cfg.run.resume == "auto"
        plan = plan_run(cfg)  # every fact derived from cfg, once (rlpipe.core.config.plan)
        self.built = build.build_run(cfg, plan, overwrite, self.resume, dataset)
        self.plan = self._settle(plan)
        self.prompts = PromptStream(list(range(len(self.data))), cfg.data.batch_size,
                                    cfg.data.shuffle, cfg.run.seed)
        self.evaluator = self._evaluator()
        self.kl = kl.KLPenalty(self.plan.kl)  # estimator, clamp, placement, coefficient
        self.updater = Updater(cfg.train, self.models, self.plugins.loss, self.kl,
                               steps=cfg.run.steps, seed=cfg.run.seed, ptx=cfg.ptx,
                               rollout_mode=cfg.rollout_correction.mode,
                               temperature=self.temperature, device=self.device, dist=self.dist,
                               truncation=self.truncation)
        self.critic_warmup = CriticWarmup(cfg.train, self.models.critic is not None)
        # rollout.staleness: 1: the next batch is sampled while a step updates (a thread where
        # the collector's engine computes apart); its one weight sync is at the step's start
        self.offpolicy = OffPolicy(self._prompt_rows, self._collect, self._sync_engine,
                                   self.sampling.overlaps_update) if cfg.rollout.staleness else None
        self.step_count = 0
        self.stopped_by: str | None = None  # the health rule (health.stop_on) that stopped train()

    # the built run's parts (`build.Run`) and the plan's sampling facts, read as attributes
    dist = property(lambda self: self.built.dist)
    device = property(lambda self: self.built.device)
    run_dir = property(lambda self: self.built.run_dir)
    lock = property(lambda self: self.built.lock)
    status = property(lambda self: self.built.status)
    models = property(lambda self: self.built.models)
    ctx = property(lambda self: self.built.ctx)
    plugins = property(lambda self: self.built.plugins)
    data = property(lambda self: self.built.data)
    sampling = property(lambda self: self.plan.sampling)  # the collector's contract
    temperature = property(lambda self: self.plan.sampling.temperature)
    truncation = property(lambda self: self.plan.sampling.truncation)
    old_from_sampling = property(lambda self: self.plan.scoring is Scoring.SAMPLING)
    values_from_rollout = property(lambda self: self.plan.values == "rollout")

    def _settle(self, plan: RunPlan) -> RunPlan:
        """The plan's second step (`settle`, once the models and plugins exist), said (`train`
        records it in the run directory: ``plan.json``)."""
        plan = settle(plan, self.cfg, self.models, self.plugins, self.dist)
        for line in plan.reward_lines:  # which convention each reward function was read as
            self.status.say(line)
        if plan.scoring is Scoring.SAMPLING:
            self.status.say("old log-probs: from the sampling pass (no actor forward in scoring; "
                            "rollout_correction.old_log_prob)")
        return plan

    def _record_plan(self) -> None:
        if self.dist.is_main:
            with writing(self.run_dir, "plan.json"):
                (self.run_dir / "plan.json").write_text(json.dumps(self.plan.to_dict(), indent=1))

    def _evaluator(self) -> Evaluator | None:
        """Held-out evaluation of ``eval.prompts`` (None without), sampling through the run's
        collector where it offers a view of its engine."""
        if self.built.eval_data is None:
            return None
        sampler, own_engine = eval_collector(self.cfg, self.ctx, self.plugins.collector)
        turns = build.multi_turn(self.plan, self.ctx, sampler)  # the same conversations, greedy
        return Evaluator(self.cfg, self.built.eval_data, sampler, self.plugins.rewards, self.dist,
                         self.device, self.run_dir, self.models.compute, own_engine, turns)

    def _check(self, td: TensorDict, keys, where: str) -> None:
        if self.cfg.run.debug:
            schema.validate(td, keys, where)

    @torch.no_grad()
    def _score_tokens(self, td: TensorDict) -> None:
        """old_log_prob, ref_log_prob and value for every response token, in micro-batches, by
        the plan's `Scoring` path and value source (``plan.values``)."""
        m, path = self.models, self.plan.scoring
        chunks = [[c[k] for k in INPUTS] for c in td.split(self.cfg.train.forward_batch_size)]
        if path is Scoring.FORWARD:  # one no-grad forward of the actor (and the critic)
            outs = [logprobs_and_values(m.actor, m.critic, c, self.temperature,
                                        truncation=self.truncation, shared_prefix=m.shared_prefix,
                                        packed=m.packed, compiled=m.compile_logprobs)
                    for c in chunks]
            td[S.OLD_LOG_PROB] = torch.cat([logp for logp, _, _ in outs])
            values = [v for _, _, v in outs] if m.critic is not None else []
        else:  # no actor forward: the engine's log-probs (bypass) or the sampling pass's
            logp = td[S.ENGINE_LOG_PROB] if path is Scoring.ENGINE else td.pop(S.ACTOR_LOG_PROB)
            td[S.OLD_LOG_PROB] = logp.float() * td[S.RESPONSE_MASK]
            values = []
            if self.plan.values == "rollout" and S.ENGINE_HIDDEN in td.keys():
                # V(s_t) = head(the hidden state the rollout drew token t from)
                hidden = td.pop(S.ENGINE_HIDDEN).to(m.critic.head.weight.dtype)
                values = [m.critic.values(hidden) * td[S.RESPONSE_MASK]]
            elif m.critic is not None:
                values = [response_values(m.critic, *c, shared_prefix=m.shared_prefix,
                                          packed=m.packed)
                          for c in chunks]
        td[S.VALUE] = torch.cat(values) if values else torch.zeros_like(td[S.OLD_LOG_PROB])
        with m.reference() as reference:  # one visit of an offloaded reference per step
            td[S.REF_LOG_PROB] = torch.cat([
                response_logprobs(reference, *c, self.temperature, shared_prefix=m.shared_prefix,
                                  packed=m.packed, compiled=m.compile_logprobs)[0]
                for c in chunks])

    def _engine_gap(self, batch: TensorDict) -> dict:
        """Mean |engine log-prob - trainer log-prob| over response tokens (not with bypass: no
        trainer log-probs): the canary for stale or wrongly synced weights."""
        if self.plan.scoring is Scoring.ENGINE:
            return {}
        gap = (batch[S.ENGINE_LOG_PROB] - batch[S.OLD_LOG_PROB]).abs()
        return {"collector/logprob_gap": to_float(masked_mean(gap, S.action_mask(batch)))}

    def _shape_reward(self, batch: TensorDict) -> torch.Tensor:
        """Write ``reward`` (stage 5); return the per-token KL [B, R] (0 on padding)."""
        mask = S.action_mask(batch)  # the policy's tokens: the score on its last one
        kl_tok = self.kl.per_token(batch[S.OLD_LOG_PROB], batch[S.REF_LOG_PROB], mask)
        guards.check_kl(batch, kl_tok, self.kl.estimator)
        batch[S.REWARD] = self.kl.shape_reward(batch[S.SCORE], kl_tok, mask)
        if S.TURN_REWARD in batch.keys():  # an environment's reward per turn, on its last action
            batch[S.REWARD] += place_turn_rewards(batch[S.TURN_REWARD], batch[S.TURN_ID], mask)
        return kl_tok

    def _prompt_rows(self) -> list[int]:
        """This rank's share of the next batch of prompts."""
        return self.dist.share(self.prompts.next_batch())

    def _collect(self, rows: list[int]) -> TensorDict:
        """Stage 1 for the prompts ``rows``: the collector's batch (`OffPolicy` runs it ahead, in
        a thread where the engine computes apart: so this leaves the actor's mode alone)."""
        collector = self.plugins.collector  # plugin calls: an error names the plugin
        turns = self.plugins.environment  # multi-turn: the collector's engine, turn by turn
        with self.models.compute():  # models.autocast (the HF collector runs the actor)
            if turns is not None:
                seed = self.cfg.run.seed * 1_000_003 + self.step_count * 10_007
                return turns.collect(self.data.records(rows), seed, self.step_count + 1)
            return guards.check_output(registry.call(collector.collect, self.data.texts(rows)),
                                       collector, required=self.plan.collected)

    def _sync_engine(self) -> None:
        """Stage 8: push the actor's weights to the generation engine."""
        registry.call(self.plugins.collector.sync_weights, self.models.actor)

    def _rollout(self, collected: tuple | None = None) -> tuple[TensorDict, float, float]:
        """Stages 1-3 for one batch of prompts (``collected``: stage 1's batch, rows and seconds,
        sampled ahead by `OffPolicy`): the scored rollout of every rank, and the seconds spent
        collecting and scoring."""
        t0 = time.perf_counter()
        self.models.actor.eval()  # sampling and scoring without dropout
        # 1. collect: sample responses for this rank's share of a batch of prompts
        if collected is None:
            rows = self._prompt_rows()
            batch, seconds = self._collect(rows), 0.0
        else:
            batch, rows, seconds = collected
        batch = batch.to(self.device)
        self.data.attach(batch, rows)  # ("data", COLUMN) of each sample's prompt row
        self._check(batch, self.plan.collected, "collector")
        correction.check_engine_log_prob(batch, self.cfg.rollout_correction.mode,
                                         self.plugins.collector)
        t1 = time.perf_counter()
        t_rollout = seconds + t1 - t0
        # 2. log-probs of the sampling policy and the reference, values of the critic
        with self.models.compute():
            self._score_tokens(batch)
        # 3. rewards: every reward plugin, weighted and summed into the sequence score
        self.plugins.rewards(batch)
        t_score = time.perf_counter() - t1
        self._check(batch, [S.OLD_LOG_PROB, S.REF_LOG_PROB, S.VALUE, S.SCORE], "rewards")
        return self.dist.gather(batch), t_rollout, t_score  # every rank: the whole rollout

    def _filled_rollout(self) -> tuple[TensorDict, float, float, dict]:
        """`_rollout`, with ``data.dynamic_sampling``: again until ``data.batch_size`` groups
        have a reward signal (flat groups dropped; ``max_rounds`` extra rounds at most)."""
        ahead = self.offpolicy  # rollout.staleness: 1: the batch sampled during the last step
        batch, t_rollout, t_score = self._rollout(ahead.take() if ahead else None)
        setting = self.cfg.data.dynamic_sampling
        if not setting.enabled:
            return batch, t_rollout, t_score, ahead.metrics() if ahead else {}
        groups = GroupFilter(self.cfg.data.batch_size, setting.max_rounds, dist=self.dist)
        while groups.add(batch):
            batch, more_rollout, more_score = self._rollout()
            t_rollout, t_score = t_rollout + more_rollout, t_score + more_score
        batch, metrics = groups.result()
        return batch, t_rollout, t_score, metrics

    def _pretrain_critic(self) -> None:
        """``train.critic_pretrain_rollouts``: the critic regresses the rewards' prefix scores of
        rollouts of the initial policy (`rlpipe.core.step.critic_pretrain`)."""
        t = self.cfg.train
        if not t.critic_pretrain_rollouts:
            return
        per_round = self.cfg.data.batch_size * self.sampling.samples_per_prompt
        self.models.actor.eval()
        with self.models.compute():
            said = critic_pretrain.pretrain(
                t, lambda: self._collect(self._prompt_rows()).to(self.device),
                -(-t.critic_pretrain_rollouts // per_round), self.models.critic,
                self.updater.opts["critic"], self.plugins.rewards, self.models.tokenizer,
                max(1, per_round // t.minibatches), self.cfg.run.seed, self.dist)
        self.status.say(said)

    @oom.explains
    def step(self) -> tuple[TensorDict, dict]:
        """One PPO step; returns the batch and the step's metrics."""
        t0 = time.perf_counter()
        # 1-3. collect, score, rewards (data.dynamic_sampling: more prompts for flat groups)
        batch, t_rollout, t_score, sampling_metrics = self._filled_rollout()
        mask, engine_gap = batch[S.RESPONSE_MASK], self._engine_gap(batch)
        # 4. rollout correction: weights pi_old / pi_engine for the loss (tis, mis), rollout/*
        rollout_metrics = correction.apply(batch, self.cfg.rollout_correction)
        # 5. KL shaping: score on the last valid token, -beta * KL on every token (kl.in: reward;
        #    with kl.in: loss beta goes to the loss in stage 7)
        coef = self.kl.coef  # this step's, before the controller moves (after stage 7)
        kl_tok = self._shape_reward(batch)
        # 6. advantage and value targets
        #    (multi-turn: on each row's action tokens, compacted, so no estimator sees a hole)
        advantage = self.plugins.advantage
        estimate = (registry.call(advantage, batch) if S.ACTION_MASK not in batch.keys() else
                    run_advantage(lambda td: registry.call(advantage, td), batch))
        batch = guards.check_output(estimate, advantage, (S.ADVANTAGE, S.VALUE_TARGET),
                                    required=(S.ADVANTAGE,))
        self._check(batch, [S.REWARD, S.ADVANTAGE, S.VALUE_TARGET], "advantage")
        # 7. PPO epochs over minibatches (the critic alone during critic warm-up)
        t1 = time.perf_counter()
        warmup = self.critic_warmup.active(self.step_count)
        update_metrics = self.updater.update(batch, train_actor=not warmup)
        self.critic_warmup.observe(update_metrics)
        t_update = time.perf_counter() - t1
        # 8. weight sync: push the updated actor to the generation engine (rollout.staleness:
        #    1: at the next step's start, once the batch in flight has been sampled)
        if self.offpolicy is None:
            self._sync_engine()
        seq_kl = to_float(kl_tok.sum(-1).mean())
        self.kl.update(seq_kl, batch.batch_size[0])
        self.step_count += 1
        # 9. metrics
        elapsed = time.perf_counter() - t0
        metrics = {
            "reward/score": to_float(batch[S.SCORE]),
            **{f"reward/{k}": to_float(v) for k, v in batch[S.SCORE_PARTS].items()},
            "kl/ref": seq_kl, "kl/coef": coef, **engine_gap, **rollout_metrics, **update_metrics,
            **sampling_metrics,
            "train/critic_only": int(warmup),
            **samples.step_stats(batch, kl_tok, self.plan.budgets.new_tokens,
                                 self.models.critic is not None),
            "response/length": to_float(mask.sum(-1).float()),
            "response/finished_frac": to_float(batch[S.FINISHED].float()),
            "perf/tokens_per_s": float(mask.sum()) / elapsed,
            "time/rollout_s": t_rollout, "time/score_s": t_score, "time/update_s": t_update,
            "time/step_s": elapsed,
            **(env_metrics(batch, getattr(self.plugins.environment, "journal", None))
               if S.NUM_TURNS in batch.keys() else {}),
        }
        return batch, metrics

    @oom.explains
    @console.quiet_libraries()
    def train(self, callbacks: list | None = None) -> Path:
        """Run the remaining steps with `default_callbacks` (evaluation, health, your ``callbacks``,
        metrics and samples, checkpoints), then save the final policy. Resuming a run
        whose ``final/`` is at ``run.steps`` already says so and trains nothing. A callback that
        sets ``stopped_by`` (health, for ``health.stop_on``) stops the run after a checkpoint,
        without ``final/``. The run directory's lock is released however it ends."""
        try:
            return self._train(callbacks)
        finally:
            if self.lock is not None:
                self.lock.release()

    def _train(self, callbacks: list | None) -> Path:
        if self.resume:
            done = build.finished_message(self.cfg, resume=True)
            if done:
                print(done)
                return self.run_dir
            self._restore()
        self._record_plan()  # after a resume is accepted: a refused one changes no file
        with Hooks(self, default_callbacks(self, callbacks or ())) as hooks:
            if self.step_count == 0:
                self._pretrain_critic()
                hooks.step_end(None, {"step": 0})  # before any update: evaluation's row
            while self.step_count < self.cfg.run.steps and self.stopped_by is None:
                batch, metrics = self.step()
                hooks.step_end(batch, {"step": self.step_count, **metrics})
        if self.stopped_by is None:
            self.save_final()
        elif self.dist.is_main:
            why = (f"health: run stopped after step {self.step_count}: {self.stopped_by} is in "
                   f"health.stop_on" if self.stopped_by in self.cfg.health.stop_on else
                   f"run stopped after step {self.step_count} by {self.stopped_by}")
            print(f"{why}; checkpoint {checkpoint.latest(self.run_dir)} written, no final/; "
                  f"change the settings and continue with {option('resume')}", file=sys.stderr)
        if self.offpolicy is not None:
            self.offpolicy.close()  # a generation in flight ends before its engine stops
        if self.plugins.environment is not None:
            self.plugins.environment.close()  # the environments' worker threads
        close_collector(self.plugins.collector)  # e.g. stop a vLLM engine
        if self.evaluator is not None:
            self.evaluator.close()  # its environments' worker threads
            close_collector(self.evaluator.collector)
        return self.run_dir


def train(cfg: Config | dict | str | Path, overwrite: bool = False, progress: bool = True,
          resume: bool = False, callbacks: list | None = None, **stages) -> Path:
    """Train with ``cfg`` (a `Config`, a dict or a YAML path, `load_config`); returns the run
    directory (``config.yaml``, ``metrics.jsonl``, ``final/``).
    ``stages``: ``dataset`` and stage objects, as for `Pipeline`; ``callbacks``: your own
    `rlpipe.core.run.callbacks.Callback` objects (`Pipeline.train`)."""
    return Pipeline(cfg, overwrite=overwrite, progress=progress, resume=resume,
                    **stages).train(callbacks)
