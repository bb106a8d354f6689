"""The PPO loop: one TensorDict passes through the stages of each step, top to bottom.

    prompts -> 1. collect -> 2. log-probs/values -> 3. rewards -> 4. KL shaping
            -> 5. advantage -> 6. PPO epochs -> 7. weight sync -> 8. metrics

>>> from rlpipe import load_config, train                         # doctest: +SKIP
>>> train(load_config("examples/tiny/config.yaml", ["run.steps=2"]))  # doctest: +SKIP
PosixPath('.../runs/tiny')
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from rlpipe.core import build, kl, schema
from rlpipe.core.config import Config
from rlpipe.core.context import RunContext
from rlpipe.core.data import PromptStream, load_prompts
from rlpipe.core.metrics import MetricsWriter, flatten, to_float
from rlpipe.core.models import response_logprobs, response_values
from rlpipe.core.ops import masked_mean

S = schema


class Pipeline:
    """Builds everything a run needs from a `Config`, then `train()` runs ``run.steps`` PPO steps."""

    def __init__(self, cfg: Config, overwrite: bool = False, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        build.seed_everything(cfg.run.seed)
        self.device = build.resolve_device(cfg.run.device)
        self.run_dir = build.prepare_run_dir(cfg, overwrite)
        self.models = build.build_models(cfg, self.device, build.needs_critic(cfg))
        self.ctx = RunContext(tokenizer=self.models.tokenizer, actor=self.models.actor,
                              device=self.device, seed=cfg.run.seed, run_dir=self.run_dir)
        self.plugins = build.build_plugins(cfg, self.ctx)
        self.temperature = float(getattr(self.plugins.collector, "temperature", 1.0))
        self.prompts = PromptStream(load_prompts(cfg.data.prompts), cfg.data.batch_size,
                                    cfg.data.shuffle, cfg.run.seed)
        self.kl_ctl = (kl.AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
                       if cfg.kl.target is not None else kl.FixedKLController(cfg.kl.coef))
        t = cfg.train
        self.actor_opt = build.make_optimizer(self.models.actor, t.lr, t.weight_decay)
        self.critic_opt = (build.make_optimizer(self.models.critic, t.critic_lr, t.weight_decay)
                           if self.models.critic is not None else None)
        self.shuffle = torch.Generator().manual_seed(cfg.run.seed)

    def _check(self, td: TensorDict, keys, where: str) -> None:
        if self.cfg.run.debug:
            schema.validate(td, keys, where)

    @torch.no_grad()
    def _score_tokens(self, td: TensorDict) -> None:
        """old_log_prob, ref_log_prob and value for every response token, in micro-batches."""
        m, out = self.models, {S.OLD_LOG_PROB: [], S.REF_LOG_PROB: [], S.VALUE: []}
        for chunk in td.split(self.cfg.train.forward_batch_size):
            inputs = [chunk[k] for k in (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)]
            out[S.OLD_LOG_PROB].append(response_logprobs(m.actor, *inputs, self.temperature)[0])
            out[S.REF_LOG_PROB].append(response_logprobs(m.reference, *inputs, self.temperature)[0])
            out[S.VALUE].append(response_values(m.critic, *inputs) if m.critic is not None
                                else torch.zeros_like(out[S.OLD_LOG_PROB][-1]))
        for key, parts in out.items():
            td[key] = torch.cat(parts)

    def step(self) -> tuple[TensorDict, dict]:
        """One PPO step; returns the batch and the step's metrics."""
        t0 = time.perf_counter()
        # 1. collect: sample responses for a batch of prompts
        self.models.actor.eval()
        batch = self.plugins.collector.collect(self.prompts.next_batch()).to(self.device)
        self._check(batch, [S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK,
                            S.GROUP_ID, S.FINISHED], "collector")
        t_rollout = time.perf_counter() - t0
        mask = batch[S.RESPONSE_MASK]
        # 2. log-probs of the sampling policy and the reference, values of the critic
        self._score_tokens(batch)
        # 3. rewards: every reward plugin, weighted and summed into the sequence score
        self.plugins.rewards(batch)
        self._check(batch, [S.OLD_LOG_PROB, S.REF_LOG_PROB, S.VALUE, S.SCORE], "rewards")
        # 4. KL shaping: score on the last valid token, -beta * KL on every token
        kl_tok = kl.kl_per_token(batch[S.OLD_LOG_PROB], batch[S.REF_LOG_PROB], self.cfg.kl.estimator)
        kl_tok = kl_tok * mask
        coef = self.kl_ctl.value
        batch[S.REWARD] = kl.shape_reward(batch[S.SCORE], kl_tok, mask, coef)
        # 5. advantage and value targets
        batch = self.plugins.advantage(batch)
        self._check(batch, [S.REWARD, S.ADVANTAGE, S.VALUE_TARGET], "advantage")
        # 6. PPO epochs over minibatches
        t1 = time.perf_counter()
        update_metrics = self.update(batch)
        t_update = time.perf_counter() - t1
        # 7. weight sync: push the updated actor to the generation engine
        self.plugins.collector.sync_weights(self.models.actor)
        seq_kl = to_float((kl_tok.sum(-1)).mean())
        self.kl_ctl.update(seq_kl, batch.batch_size[0])
        # 8. metrics
        elapsed = time.perf_counter() - t0
        metrics = {
            "reward/score": to_float(batch[S.SCORE]),
            **{f"reward/{k}": to_float(v) for k, v in batch[S.SCORE_PARTS].items()},
            "kl/ref": seq_kl, "kl/coef": coef, **update_metrics,
            "response/length": to_float(mask.sum(-1).float()),
            "response/finished_frac": to_float(batch[S.FINISHED].float()),
            "perf/tokens_per_s": float(mask.sum()) / elapsed,
            "time/rollout_s": t_rollout, "time/update_s": t_update, "time/step_s": elapsed,
        }
        return batch, metrics

    def _micro_step(self, micro: TensorDict) -> TensorDict:
        """Forward the current models on one micro-batch, run the loss, backward; return its output."""
        m = self.models
        inputs = [micro[k] for k in (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)]
        micro[S.LOG_PROB], micro[S.ENTROPY] = response_logprobs(
            m.actor, *inputs, self.temperature, with_entropy=True)
        if m.critic is not None:
            micro[S.VALUE_PRED] = response_values(m.critic, *inputs)
        out = self.plugins.loss(micro)
        losses = [v for k, v in out.items() if k.startswith("loss_")]
        sum(losses).backward()
        return out

    def update(self, batch: TensorDict) -> dict:
        """K epochs x shuffled minibatches (one optimizer step each) x gradient-accumulation micro-batches."""
        t, m = self.cfg.train, self.models
        size = batch.batch_size[0]
        mb_size = math.ceil(size / t.minibatches)
        sums: dict[str, float] = {}
        count = 0
        for _ in range(t.epochs):
            for idx in torch.randperm(size, generator=self.shuffle).split(mb_size):
                mb = batch[idx.to(self.device)]
                mb[S.NUM_TOKENS] = mb[S.RESPONSE_MASK].sum().float().expand(len(idx))
                mb[S.NUM_SEQS] = torch.full((len(idx),), float(len(idx)), device=self.device)
                self.actor_opt.zero_grad(set_to_none=True)
                if self.critic_opt is not None:
                    self.critic_opt.zero_grad(set_to_none=True)
                for micro in mb.split(math.ceil(len(idx) / t.grad_accum)):
                    out = self._micro_step(micro)
                    for k, v in flatten(out.exclude(*[k for k in out.keys() if k.startswith("loss_")])).items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
                self._optimizer_step(m.actor, self.actor_opt, t.max_grad_norm)
                if self.critic_opt is not None:
                    self._optimizer_step(m.critic, self.critic_opt, t.max_grad_norm)
        return {k: v / count for k, v in sums.items()}

    @staticmethod
    def _optimizer_step(module, optimizer, max_grad_norm) -> None:
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_grad_norm)
        optimizer.step()

    def train(self) -> Path:
        """Run every step, append metrics, save the final policy; returns the run directory."""
        steps = self.cfg.run.steps
        with MetricsWriter(self.run_dir / "metrics.jsonl", steps, self.progress) as writer:
            for step in range(1, steps + 1):
                _, metrics = self.step()
                writer.write({"step": step, **metrics})
        final = self.run_dir / "final"
        self.models.actor.save_pretrained(final)
        self.models.tokenizer.save_pretrained(final)
        return self.run_dir


def train(cfg: Config, overwrite: bool = False, progress: bool = True) -> Path:
    """Train with ``cfg``; returns the run directory (``config.yaml``, ``metrics.jsonl``, ``final/``)."""
    return Pipeline(cfg, overwrite=overwrite, progress=progress).train()
