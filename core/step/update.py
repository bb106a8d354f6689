"""Stage 7 of the loop: PPO epochs over a rollout batch, in one block (`Updater.update`).

K epochs x shuffled minibatches (one optimizer step each) x gradient-accumulation micro-batches.
The forward's outputs go into a copy of each micro-batch: the caller's batch is never written.
Losses are normalised by the token and sequence counts of the whole minibatch (``num_tokens``,
``num_seqs`` in every micro-batch), so the micro-batch split does not change the gradient. A
minibatch whose loss or gradient is not finite is skipped; ``train.max_bad_steps`` in a row stop
the run. What the trainer computes for the loss, and how the loss's metrics reduce, is the loss's
declared `rlpipe.core.step.loss.LossContract`.
"""

from __future__ import annotations

import math
import warnings

import torch
from tensordict import TensorDict

from rlpipe.core.step import optim
from rlpipe.core.contracts import guards, registry
from rlpipe.core.step import kl
from rlpipe.core.base import schema
from rlpipe.core.data.streams import PtxStream
from rlpipe.core.base.errors import UserError
from rlpipe.core.step.loss import (LossContract, add_parts, contract_of, exceeds, finish,
                                  micro_parts)
from rlpipe.core.models.lm import checkpointing, logprobs_and_values, response_values
from rlpipe.core.models.distributed import Dist

S = schema


class TrainingDiverged(UserError):
    """Too many consecutive non-finite losses or gradients; the last checkpoint is left intact."""


class Updater:
    """Owns the optimizers and schedulers of actor and critic and runs the PPO update.

    ``train``: the config's train section; ``kl_penalty``: the run's `KLPenalty` (shared with the
    loop); ``steps``, ``seed``: ``run.steps`` (the schedule's length) and ``run.seed`` (the
    minibatch shuffle); ``ptx``: the ptx section (read when its coef > 0); ``rollout_mode``:
    ``rollout_correction.mode``; ``truncation``: the sampler's top-k/top-p (score_truncated)."""

    def __init__(self, train, models, loss, kl_penalty: kl.KLPenalty, *, steps: int, seed: int,
                 ptx=None, rollout_mode: str = "none", temperature: float = 1.0,
                 device: torch.device = torch.device("cpu"), dist=None, truncation=None):
        self.kl = kl_penalty
        self.contract = _checked_contract(train, rollout_mode, models, loss, kl_penalty)  # first
        self.train, self.models, self.loss = train, models, loss
        self.temperature, self.device, self.dist = temperature, device, dist or Dist()
        self.truncation = truncation
        self.params = {"actor": optim.trainable(models.actor)}
        if models.critic is not None:  # a shared backbone is stepped by the actor's optimizer
            self.params["critic"] = optim.trainable(models.critic, exclude=models.actor)
        lrs = {"actor": train.lr, "critic": train.critic_lr}
        self.opts = {k: optim.make_optimizer(p, lrs[k], train.weight_decay)
                     for k, p in self.params.items()}
        self.ptx_coef = ptx.coef if ptx is not None else 0.0
        self.ptx = PtxStream(ptx, models.tokenizer, self.dist) if self.ptx_coef > 0 else None
        self.scheds = {k: optim.make_scheduler(o, train, steps) for k, o in self.opts.items()}
        self.shuffle = torch.Generator().manual_seed(seed)
        self.bad_in_a_row = 0
        self.bad_terms: list[str] = []  # non-finite loss_* entries of this minibatch
        self.grad_norms: dict[str, list[float]] = {}  # pre-clip norms of this step's optimizer steps

    def update(self, batch: TensorDict, train_actor: bool = True) -> dict:
        """Run the PPO epochs on ``batch`` (the global rollout; each rank trains on its slice of
        every minibatch; ``batch`` itself is not written). Returns ``loss/*`` averaged over the
        stepped minibatches and the loss's other metrics reduced as its contract declares
        (token- or sequence-weighted over all micro-batches and ranks, or pooled), so that
        neither depends on how the batch is split. Skipped (non-finite) minibatches are left out
        of both, and of ``train/grad_norm`` and ``train/critic_grad_norm``: the mean pre-clip
        gradient norms of the optimizer steps."""
        t, need, who = self.train, self.contract, registry.label_of(self.loss)
        total: dict[str, list[float]] = {}  # the one accumulator: parts of the stepped minibatches
        done = skipped = stopped = 0
        kl_name = need.approx_kl_metric if t.target_kl is not None else None  # train.target_kl's
        self.grad_norms = {}
        with checkpointing(self.models.actor, self.models.critic):  # no-op unless enabled
            for _ in range(t.epochs):
                for idx in self._minibatches(batch.batch_size[0]):
                    parts: dict[str, list[float]] = {}  # this minibatch's, over its micro-batches
                    for micro in self._micro_batches(batch[idx.to(self.device)]):
                        with self.models.compute():  # per micro-batch: its cast of the weights
                            out = self._micro_step(micro)
                        losses, metrics = micro_parts(out, need, float(S.action_mask(micro).sum()),
                                                      float(len(micro)), who)
                        add_parts(parts, {**{k: [v] for k, v in losses.items()}, **metrics})
                    if self.ptx is not None and train_actor:
                        add_parts(parts, self._ptx_parts())
                    if kl_name is not None and kl_name not in parts:
                        raise UserError(f"train.target_kl: {who} declares approx_kl_metric "
                                        f"{kl_name!r} but did not write it")
                    kl_parts = {"kl": parts[kl_name]} if kl_name is not None else {}
                    agreed = _rank_mean(self.dist, {"loss": parts["loss_total"], **kl_parts})
                    if self._optimizer_step(train_actor, agreed["loss"][0]):
                        done += 1
                        add_parts(total, parts)
                    else:
                        skipped += 1
                    stopped = kl_name is not None and exceeds(
                        agreed["kl"], need.reduction(kl_name), t.target_kl)
                    if stopped:
                        break
                if stopped:
                    break
        total = _rank_mean(self.dist, total)
        metrics = {f"loss/{k[5:]}": v[0] / max(done, 1) for k, v in total.items()
                   if k.startswith("loss_")}
        metrics.update(finish({k: v for k, v in total.items() if not k.startswith("loss_")}, need))
        metrics.update({"train/skipped_minibatches": skipped, "train/early_stopped": int(stopped),
                        "train/lr": self.scheds["actor"].get_last_lr()[0]})
        names = {"actor": "train/grad_norm", "critic": "train/critic_grad_norm"}
        metrics.update({names[k]: sum(v) / len(v) for k, v in self.grad_norms.items()})
        return metrics

    def _minibatches(self, size: int):
        """Global minibatch indices (the same permutation on every rank)."""
        t, world = self.train, self.dist.world
        mb_size = math.ceil(size / t.minibatches)
        if size % t.minibatches or mb_size < world * t.grad_accum:
            raise UserError(f"train.minibatches={t.minibatches} must divide the {size} samples of a "
                            f"step into minibatches of at least distributed.nproc x "
                            f"train.grad_accum = {world * t.grad_accum} samples")
        return torch.randperm(size, generator=self.shuffle).split(mb_size)

    def _micro_batches(self, mb: TensorDict):
        """This rank's rows of minibatch ``mb`` (a copy) in ``train.grad_accum`` micro-batches,
        each carrying the minibatch-wide ``num_tokens`` and ``num_seqs`` / world (FSDP averages
        the ranks' gradients, the losses want their sum)."""
        d, n = self.dist, mb.batch_size[0]
        mb[S.NUM_TOKENS] = (S.action_mask(mb).sum().float() / d.world).expand(n)
        mb[S.NUM_SEQS] = (S.action_mask(mb).any(-1).sum().float() / d.world).expand(n)
        local = mb[d.rank::d.world]
        if self.train.grad_accum > 1 and S.GROUP_ID in local.keys():  # a prompt's samples in the
            # same micro-batches share its tokens (core/models/prefix.py); the sum is the same
            local = local[local[S.GROUP_ID].argsort(stable=True)]
        for part in torch.arange(len(local)).tensor_split(self.train.grad_accum):
            yield local[part.to(self.device)]

    def _micro_step(self, micro: TensorDict) -> TensorDict:
        """Forward the current models on one micro-batch as the loss's contract asks, into a copy
        of it, run the loss, backward; return its output. With declared ``critic_terms`` and a
        critic of its own: the actor's forward and backward, then the critic's
        (`LossContract.critic_terms`)."""
        m, need, td = self.models, self.contract, micro.copy()  # TorchRL's rule: never the caller's
        inputs = [td[k] for k in (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)]
        split = bool(need.critic_terms) and m.critic is not None and not m.critic.shared
        logp, entropy, values = logprobs_and_values(
            m.actor, None if split else m.critic, inputs, self.temperature,
            with_entropy=need.entropy != "none", entropy_grad=need.entropy == "grad",
            truncation=self.truncation, shared_prefix=m.shared_prefix,
            packed=m.packed, compiled=m.compile_logprobs)
        td[S.LOG_PROB] = logp
        if entropy is not None:
            td[S.ENTROPY] = entropy
        if values is not None:
            td[S.VALUE_PRED] = values
        if split:  # the actor's terms now; value_pred stands in (its terms are dropped)
            td[S.VALUE_PRED] = td[S.VALUE].detach()
            actor_terms = [v for k, v in self._loss(td).items()
                           if k.startswith("loss_") and k not in need.critic_terms]
            if actor_terms:
                sum(actor_terms).backward()
            td[S.LOG_PROB] = logp.detach()   # same numbers: the metrics below are the joint's
            if entropy is not None:
                td[S.ENTROPY] = entropy.detach()
            td[S.VALUE_PRED] = response_values(m.critic, *inputs, shared_prefix=m.shared_prefix,
                                               packed=m.packed)
        out = self._loss(td)
        losses = [v for k, v in out.items() if k.startswith("loss_")]
        self.bad_terms += [k for k, v in out.items() if k.startswith("loss_")
                           and k not in self.bad_terms and guards.nonfinite(v)]
        total = sum(losses)
        (sum(out[k] for k in need.critic_terms if k in out.keys()) if split else total).backward()
        out["loss_total"] = total.detach()
        return out

    def _loss(self, td: TensorDict) -> TensorDict:
        """The loss plugin's output on ``td``, with the trainer's ``loss_kl`` where it adds it:
        the one place the KL penalty enters the loss."""
        out = registry.call(self.loss, td)  # an error in the plugin names it
        terms = guards.loss_terms(out, self.loss)
        if self.kl.loss_coef:  # kl.in: loss -- the KL penalty as a loss term
            if not self.contract.kl_term:  # the documented default: the trainer adds the term
                out["loss_kl"] = self.kl.loss_term(td[S.LOG_PROB], td[S.REF_LOG_PROB],
                                                   S.action_mask(td), td[S.NUM_TOKENS][0])
            elif "loss_kl" not in terms:
                raise UserError(f"{registry.label_of(self.loss)} declares kl_term but wrote no "
                                f"loss_kl with kl.in: loss")
        return out

    def _ptx_parts(self) -> dict[str, list[float]]:
        """PPO-ptx: backward of the LM loss on pretraining text; its parts (`update`)."""
        with self.models.compute():
            lm = self.models.actor(**self.ptx.next_batch(self.device), use_cache=False).loss
        (self.ptx_coef * lm).backward()
        term = self.ptx_coef * float(lm)
        return {"loss_ptx": [term], "loss_total": [term], "policy/ptx_loss": [float(lm), 1.0]}

    def _optimizer_step(self, train_actor: bool, loss_total: float) -> bool:
        """Clip, check for non-finite values, step. Returns False when the minibatch was skipped."""
        max_norm = self.train.max_grad_norm
        names = [n for n in self.opts if n != "actor" or train_actor]
        norms = [grad_norm(self.params[n], max_norm) for n in names]
        norms = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in norms]  # FSDP
        finite = math.isfinite(loss_total) and all(bool(torch.isfinite(x)) for x in norms)
        if finite:
            for name, norm in zip(names, norms):
                self.grad_norms.setdefault(name, []).append(float(norm))
            for name in names:
                self.opts[name].step()
                self.scheds[name].step()
            self.bad_in_a_row = 0
        else:
            self.bad_in_a_row += 1
            warnings.warn(f"non-finite loss or gradient: minibatch skipped "
                          f"({self.bad_in_a_row} in a row)", RuntimeWarning, stacklevel=2)
            if self.bad_in_a_row >= self.train.max_bad_steps:
                what = (f"non-finite {', '.join(self.bad_terms)}" if self.bad_terms else
                        "non-finite loss" if not math.isfinite(loss_total) else "non-finite gradient")
                raise TrainingDiverged(
                    f"training diverged: {self.bad_in_a_row} consecutive minibatches with a "
                    f"non-finite loss or gradient (last: {what}; loss plugin "
                    f"{registry.label_of(self.loss)}); the last checkpoint is intact (lower "
                    f"train.lr, set train.max_grad_norm, or check the rewards)")
        for opt in self.opts.values():
            opt.zero_grad(set_to_none=True)
        self.bad_terms = []
        return finite

    def apply_learning_rates(self, train) -> None:
        """Set ``train.lr``, ``train.critic_lr`` and ``train.weight_decay`` on loaded optimizers:
        the schedules keep their position and scale the new base rates (a resume that changed
        them)."""
        lrs = {"actor": train.lr, "critic": train.critic_lr}
        for name, opt in self.opts.items():
            sched = self.scheds[name]
            sched.base_lrs = [lrs[name]] * len(opt.param_groups)
            for group, factor in zip(opt.param_groups, sched.lr_lambdas):
                group.update(initial_lr=lrs[name], lr=lrs[name] * factor(sched.last_epoch),
                             weight_decay=train.weight_decay)
            sched._last_lr = [group["lr"] for group in opt.param_groups]

    def state_dict(self, sharded: bool = False) -> dict:
        """Optimizer states keyed by parameter name (a collective under FSDP): full and on CPU,
        or with ``sharded`` each rank's own DTensor shards, for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=not sharded, cpu_offload=not sharded)
        opts = {k: get_optimizer_state_dict(getattr(self.models, k), o, options=options)
                for k, o in self.opts.items()}
        return {"opts": opts, "scheds": {k: s.state_dict() for k, s in self.scheds.items()},
                "shuffle": self.shuffle.get_state(), "bad_in_a_row": self.bad_in_a_row}

    def load_state_dict(self, state: dict, sharded: bool = False) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=not sharded)
        for k, o in self.opts.items():
            set_optimizer_state_dict(getattr(self.models, k), o, optim_state_dict=state["opts"][k],
                                     options=options)
            self.scheds[k].load_state_dict(state["scheds"][k])
        self.shuffle.set_state(state["shuffle"])
        self.bad_in_a_row = int(state["bad_in_a_row"])


def _rank_mean(dist: Dist, parts: dict[str, list[float]]) -> dict[str, list[float]]:
    """Every part averaged over ranks (the ratios `rlpipe.core.step.loss.finish` takes stay)."""
    flat = dist.mean({f"{k}[{i}]": x for k, v in parts.items() for i, x in enumerate(v)})
    return {k: [flat[f"{k}[{i}]"] for i in range(len(v))] for k, v in parts.items()}


def grad_norm(params: list, max_norm: float | None) -> torch.Tensor:
    """The total L2 norm of the ``params``' gradients, then the gradients clipped to ``max_norm``
    as `torch.nn.utils.clip_grad_norm_` clips them (times ``max_norm / (norm + 1e-6)`` where that
    is below 1; no pass over them where it is not, a multiply by 1). ``None``: the norm alone,
    for the finiteness check and the metric.

    On CPU the squares are summed in float64, `NORM_CHUNK` elements at a time: a float32 or
    bfloat16 entry's square is exact in float64, so for n entries the float64 norm is within
    (n/2 + 1) 2^-53 of the exact one in any summation order, and the float32 result within
    2^-24 + (n/2 + 1) 2^-53 (one rounding, 6e-8), on every CPU and kernel path. A float32 dot
    product's bound is n 2^-24 of the sum for its n terms (1/16 for 1 Mi; MKL's kernels for AVX2,
    AVX-512 and AMD parts reach 1e-6 on 1 Mi random entries, ``vector_norm`` 1.6e-3 on 28 M).
    Sharded (FSDP2) and accelerator gradients take torch's own functions.

    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> grad_norm([w], None).item(), w.grad.tolist()
    (5.0, [3.0, 4.0])
    >>> grad_norm([w], 1.0).item(), [round(x, 4) for x in w.grad.tolist()]
    (5.0, [0.6, 0.8])
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or any(g.device.type != "cpu" or hasattr(g, "full_tensor") for g in grads):
        if max_norm is not None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm(grads)
    norm = _float64_sum_of_squares(grads).sqrt()
    norm = norm.to(torch.float64 if grads[0].dtype == torch.float64 else torch.float32)
    if max_norm is not None:
        coef = max_norm / (norm + 1e-6)  # clip_grad_norm_'s factor, in the norm's dtype
        if bool(coef < 1.0):
            torch._foreach_mul_(grads, coef)
    return norm


def _float64_sum_of_squares(grads: list) -> torch.Tensor:
    """Sum of every squared entry of ``grads``, accumulated in float64: each chunk is copied into
    one cache-sized float64 buffer and dotted with itself (float32 and bfloat16 squares are exact
    there; the copy costs ~2x a float32 dot product, BENCHMARKS.md)."""
    buf = torch.empty(NORM_CHUNK, dtype=torch.float64)
    chunks = [c for g in grads for c in g.reshape(-1).split(NORM_CHUNK)]
    out = torch.empty(len(chunks), dtype=torch.float64)
    for i, c in enumerate(chunks):
        x = c if c.dtype == torch.float64 else buf[:c.numel()].copy_(c)
        torch.dot(x, x, out=out[i])
    return out.sum()


# Elements per float64 dot product in `grad_norm`: 64 Ki (a 512 KiB buffer, in L2 cache).
NORM_CHUNK = 1 << 16


def _checked_contract(train, rollout_mode: str, models, loss, penalty: kl.KLPenalty) -> LossContract:
    """The loss's contract, checked against the run before any step: ``train.target_kl`` needs
    a declared approx-KL metric, ``rollout_correction.mode`` tis/mis a loss that applies the
    weights, a critic a loss that trains it; a loss that adds the KL term itself is handed the
    run's `KLPenalty`."""
    declared = contract_of(loss)
    who = registry.label_of(loss)
    if train.target_kl is not None and declared.approx_kl_metric is None:
        raise UserError(f"train.target_kl is set but {who} declares no approx-KL metric "
                        f"(LossContract.approx_kl_metric); unset train.target_kl")
    if rollout_mode in ("tis", "mis") and not declared.rollout_weights:
        raise UserError(f"rollout_correction.mode: {rollout_mode} weights the policy gradient, but "
                        f"{who} does not declare LossContract.rollout_weights; use mode none or "
                        f"bypass")
    if models.critic is not None and not declared.values:
        raise UserError(f"the advantage needs a critic, but {who} declares values=False: nothing "
                        f"would train the critic")
    if declared.kl_term:
        loss.set_kl(penalty)
    return declared
