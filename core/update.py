"""Stage 6 of the loop: PPO epochs over a rollout batch.

K epochs x shuffled minibatches (one optimizer step each) x gradient-accumulation micro-batches.
Losses are normalised by the token and sequence counts of the whole minibatch (``num_tokens``,
``num_seqs`` in every micro-batch), so the micro-batch split does not change the gradient. A
minibatch whose loss or gradient is not finite is skipped; ``train.max_bad_steps`` in a row stop
the run.
"""

from __future__ import annotations

import math
import warnings

import torch
from tensordict import TensorDict

from rlpipe.core import build, kl, schema
from rlpipe.core.errors import UserError
from rlpipe.core.metrics import flatten
from rlpipe.core.models import response_logprobs, response_values

S = schema


class TrainingDiverged(UserError):
    """Too many consecutive non-finite losses or gradients; the last checkpoint is left intact."""


class Updater:
    """Owns the optimizers and schedulers of actor and critic and runs the PPO update."""

    def __init__(self, cfg, models, loss, temperature: float, device: torch.device):
        t = cfg.train
        self.cfg, self.models, self.loss = cfg, models, loss
        self.temperature, self.device = temperature, device
        self.opts = {"actor": build.make_optimizer(models.actor, t.lr, t.weight_decay)}
        if models.critic is not None:
            self.opts["critic"] = build.make_optimizer(models.critic, t.critic_lr, t.weight_decay)
        self.scheds = {k: build.make_scheduler(o, cfg) for k, o in self.opts.items()}
        self.shuffle = torch.Generator().manual_seed(cfg.run.seed)
        self.bad_in_a_row = 0

    def _micro_step(self, micro: TensorDict, kl_coef: float) -> TensorDict:
        """Forward the current models on one micro-batch, run the loss, backward; return its output."""
        m = self.models
        inputs = [micro[k] for k in (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)]
        micro[S.LOG_PROB], micro[S.ENTROPY] = response_logprobs(
            m.actor, *inputs, self.temperature, with_entropy=True)
        if m.critic is not None:
            micro[S.VALUE_PRED] = response_values(m.critic, *inputs)
        out = self.loss(micro)
        if kl_coef:  # kl.in: loss -- the KL penalty as a loss term instead of in the reward
            kl_tok = kl.kl_per_token(micro[S.LOG_PROB], micro[S.REF_LOG_PROB], self.cfg.kl.estimator)
            kl_sum = torch.where(micro[S.RESPONSE_MASK], kl_tok, 0.0).sum()
            out["loss_kl"] = kl_coef * kl_sum / micro[S.NUM_TOKENS][0].clamp(min=1)
        losses = [v for k, v in out.items() if k.startswith("loss_")]
        total = sum(losses)
        total.backward()
        out["loss_total"] = total.detach()
        return out

    def _optimizer_step(self, train_actor: bool, loss_total: float) -> bool:
        """Clip, check for non-finite values, step. Returns False when the minibatch was skipped."""
        max_norm = self.cfg.train.max_grad_norm or float("inf")
        names = [n for n in self.opts if n != "actor" or train_actor]
        norms = [torch.nn.utils.clip_grad_norm_(getattr(self.models, n).parameters(), max_norm)
                 for n in names]
        finite = math.isfinite(loss_total) and all(torch.isfinite(x) for x in norms)
        if finite:
            for name in names:
                self.opts[name].step()
                self.scheds[name].step()
            self.bad_in_a_row = 0
        else:
            self.bad_in_a_row += 1
            warnings.warn(f"non-finite loss or gradient: minibatch skipped "
                          f"({self.bad_in_a_row} in a row)", RuntimeWarning, stacklevel=2)
            if self.bad_in_a_row >= self.cfg.train.max_bad_steps:
                raise TrainingDiverged(
                    f"training diverged: {self.bad_in_a_row} consecutive minibatches with a "
                    f"non-finite loss or gradient; the last checkpoint is intact (lower train.lr, "
                    f"set train.max_grad_norm, or check the rewards)")
        for opt in self.opts.values():
            opt.zero_grad(set_to_none=True)
        return finite

    def update(self, batch: TensorDict, train_actor: bool = True, kl_coef: float = 0.0) -> dict:
        """Run the PPO epochs on ``batch``; returns metrics averaged over micro-batches."""
        t = self.cfg.train
        size = batch.batch_size[0]
        mb_size = math.ceil(size / t.minibatches)
        sums: dict[str, float] = {}
        count, skipped, stopped = 0, 0, False
        for _ in range(t.epochs):
            for idx in torch.randperm(size, generator=self.shuffle).split(mb_size):
                mb = batch[idx.to(self.device)]
                mb[S.NUM_TOKENS] = mb[S.RESPONSE_MASK].sum().float().expand(len(idx))
                mb[S.NUM_SEQS] = torch.full((len(idx),), float(len(idx)), device=self.device)
                loss_total, approx_kl, n_micro = 0.0, 0.0, 0
                for micro in mb.split(math.ceil(len(idx) / t.grad_accum)):
                    out = self._micro_step(micro, kl_coef)
                    loss_total += float(out["loss_total"])
                    for k, v in flatten(out).items():
                        sums[k] = sums.get(k, 0.0) + v
                    approx_kl += float(out.get(("policy", "approx_kl"), 0.0))
                    count, n_micro = count + 1, n_micro + 1
                skipped += not self._optimizer_step(train_actor, loss_total)
                if t.target_kl is not None and approx_kl / n_micro > t.target_kl:
                    stopped = True
                    break
            if stopped:
                break
        metrics = {k: v / count for k, v in sums.items() if not k.startswith("loss_")}
        metrics.update({f"loss/{k[5:]}": v / count for k, v in sums.items() if k.startswith("loss_")})
        metrics.update({"train/skipped_minibatches": skipped, "train/early_stopped": int(stopped),
                        "train/lr": self.scheds["actor"].get_last_lr()[0]})
        return metrics

    def state_dict(self) -> dict:
        return {"opts": {k: o.state_dict() for k, o in self.opts.items()},
                "scheds": {k: s.state_dict() for k, s in self.scheds.items()},
                "shuffle": self.shuffle.get_state(), "bad_in_a_row": self.bad_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        for k, o in self.opts.items():
            o.load_state_dict(state["opts"][k])
            self.scheds[k].load_state_dict(state["scheds"][k])
        self.shuffle.set_state(state["shuffle"])
        self.bad_in_a_row = int(state["bad_in_a_row"])
