"""Checkpoint and resume of a `rlpipe.core.run.pipeline.Pipeline`: its state beyond the weights,
checkpoints (one process: full; distributed: sharded per rank), the restore that ``--resume``
runs, and the final export. `RunState` is the part of `Pipeline` that reads and writes them; the
file formats are `rlpipe.core.run.checkpoint`'s."""

from __future__ import annotations

import copy
import random
import shutil
import sys
from pathlib import Path

import torch

from rlpipe.core.run import build, checkpoint, rundir
from rlpipe.core.models import distributed
from rlpipe.core.contracts import registry
from rlpipe.core.config.compose import save_config
from rlpipe.core.base.errors import UserError, option
from rlpipe.core.observe.metrics import keep_steps
from rlpipe.core.config.settings import Config
from rlpipe.core.data.streams import PromptStream
from rlpipe.core.models.critic_start import CriticWarmup
from rlpipe.core.models.distributed import Dist
from rlpipe.core.models.lm import Models
from rlpipe.core.run.build import Plugins
from rlpipe.core.run.offpolicy import OffPolicy
from rlpipe.core.step.kl import KLPenalty
from rlpipe.core.step.update import Updater


class RunState:
    """Checkpoint and resume methods of `Pipeline`: what they read and write is declared below,
    and `Pipeline.__init__` sets every one of them (``tests/test_callbacks.py`` checks)."""

    cfg: Config
    dist: Dist
    run_dir: Path
    models: Models
    plugins: Plugins
    prompts: PromptStream
    updater: Updater
    kl: KLPenalty
    critic_warmup: CriticWarmup
    offpolicy: OffPolicy | None    # rollout.staleness: 1: the batch in flight
    step_count: int

    def _modules(self) -> dict:
        m = self.models
        return {"actor": m.actor, **({"critic": m.critic} if m.critic is not None else {})}

    def state_dict(self, sharded: bool = False) -> dict:
        """Everything but the weights: step, optimizers (``sharded``: each rank's DTensor shards),
        schedulers, RNGs (one per rank), KL, reward statistics, data position, the batch in
        flight (``rollout.staleness: 1``, one per rank). A collective under FSDP: call it on every
        rank."""
        p = self.prompts
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()   # this rank's device; a CPU tensor
        rngs = self.dist.gather_object(rng)
        ahead = self.offpolicy   # rollout.staleness: 1: each rank's batch in flight
        flights = {} if ahead is None else {
            "in_flight": self.dist.gather_object(ahead.state_dict())}
        return {**flights, "step": self.step_count, "updater": self.updater.state_dict(sharded),
                "kl": self.kl.state_dict(), "rewards": self.plugins.rewards.state_dict(),
                "critic_warmup": self.critic_warmup.state_dict(),
                "data": {"generator": p.generator.get_state(), "order": list(p.order),
                         "position": p.position},
                "rng": rngs}

    def load_state_dict(self, state: dict) -> None:
        """The inverse of `state_dict`; ``state["sharded"]`` marks sharded optimizer states."""
        self.step_count = int(state["step"])
        self.updater.load_state_dict(state["updater"], bool(state.get("sharded", False)))
        self.kl.load_state_dict(state["kl"])
        self.plugins.rewards.load_state_dict(state["rewards"])
        self.critic_warmup.load_state_dict(state.get("critic_warmup", {}))
        data = state["data"]
        self.prompts.generator.set_state(data["generator"])
        self.prompts.order, self.prompts.position = list(data["order"]), int(data["position"])
        self._load_in_flight(state.get("in_flight", []))
        if len(state["rng"]) == self.dist.world:
            rng = state["rng"][self.dist.rank]
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        else:  # weights and optimizer reshard; only the per-rank sampling streams cannot
            build.seed_everything(self.cfg.run.seed + 1000 * self.step_count + self.dist.rank)
            if self.dist.is_main:
                print(f"warning: checkpoint written by {len(state['rng'])} process(es), resumed on "
                      f"{self.dist.world}: weights and optimizer resharded, sampling streams "
                      f"reseeded (not bit-identical to an uninterrupted run)", file=sys.stderr)

    def _load_in_flight(self, flights: list) -> None:
        """The batch a checkpoint of ``rollout.staleness: 1`` saved in flight, trained on next
        (written by another number of processes: none, the next batch is sampled anew)."""
        ahead = self.offpolicy
        if ahead is not None:
            ahead.load_state_dict(flights[self.dist.rank] if len(flights) == self.dist.world else {})
        elif any(flights) and self.dist.is_main:
            print("warning: the checkpoint holds a batch sampled ahead (rollout.staleness: 1); "
                  "with rollout.staleness: 0 it is not trained on", file=sys.stderr)

    def _shards(self, state: dict) -> dict:
        """What a distributed checkpoint shards: trainable weights and optimizer states, taken
        out of ``state`` (a ``state_dict(sharded=True)``)."""
        models = {name: checkpoint.trainable_state(m, distributed.sharded_state(m), to_cpu=False)
                  for name, m in self._modules().items()}
        return {"models": models, "optimizers": state["updater"].pop("opts")}

    def _load_checkpoint(self, path: Path) -> dict:
        """Weights into the models and the saved state; a distributed checkpoint is read into this
        run's own (sharded or plain) tensors, resharded by DCP to the present world size."""
        if not checkpoint.is_sharded(path):
            return checkpoint.load(path, self._modules())
        shards = self._shards(self.state_dict(sharded=True))  # this run's tensors, filled in place
        state = checkpoint.load_sharded(path, shards)
        for name, module in self._modules().items():
            distributed.load_sharded_state(module, shards["models"][name])
        state["updater"]["opts"], state["sharded"] = shards["optimizers"], True
        return state

    def save_checkpoint(self) -> None:
        """One process: full weights and states, written atomically. Distributed: every rank
        writes its own shard (torch.distributed.checkpoint); nothing is gathered."""
        if self.dist.enabled:
            state = self.state_dict(sharded=True)
            checkpoint.save_sharded(self.run_dir, self.step_count, self._shards(state), state,
                                    self.cfg.checkpoint.keep, self.dist)
            return
        weights = {name: checkpoint.trainable_state(module, distributed.full_state(module))
                   for name, module in self._modules().items()}
        state = self.state_dict()
        if self.dist.is_main:
            policy = lambda folder: checkpoint.save_policy(  # noqa: E731 - loads without rlpipe
                self.models.actor, self.models.tokenizer, folder / checkpoint.POLICY,
                self.cfg.models.actor.path)
            checkpoint.save(self.run_dir, self.step_count, weights, state, self.cfg.checkpoint.keep,
                            policy)
        self.dist.barrier()

    def _restore(self) -> None:
        """Continue from the newest intact checkpoint (newer damaged ones are skipped, saying so),
        or from step 0 without one; keep each metric row up to there once; apply changed settings."""
        changes = rundir.resume_changes(self.run_dir, self.cfg.to_dict())
        path, skipped = checkpoint.choose(self.run_dir)
        self.dist.barrier()  # every rank has read config.yaml and chosen before rank 0 rewrites it
        damaged = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        if path is None and skipped:
            raise UserError(f"no intact checkpoint in {self.run_dir / 'checkpoints'} ({damaged}); "
                            f"start again with {option('overwrite')}")
        if skipped and self.dist.is_main:
            print(f"warning: skipping damaged checkpoint(s) ({damaged}); resuming from {path.name}",
                  file=sys.stderr)
        metrics = self.run_dir / "metrics.jsonl"
        if path is None and self.dist.is_main and metrics.is_file() and metrics.stat().st_size:
            print(f"warning: no checkpoint in {self.run_dir / 'checkpoints'} (checkpoint.every: "
                  f"{self.cfg.checkpoint.every}); starting again at step 1, without the metric "
                  f"rows written so far", file=sys.stderr)
        pretrain = sorted(k for k in changes if k.startswith("train.critic_pretrain_"))
        if path is not None and pretrain:
            raise UserError(f"{', '.join(pretrain)}: critic pretraining runs only before step 1, "
                            f"and {path.name} is past it, so the change would do nothing; "
                            f"restore it, or start a new run with {option('overwrite')}")
        if path is not None:
            state = self._load_checkpoint(path)
            if int(state["step"]) > self.cfg.run.steps:
                raise UserError(f"run.steps={self.cfg.run.steps}: {path} is already at step "
                                f"{state['step']}; raise run.steps to continue it")
            self._load_changed(state, changes)
            # the engine started from the actor's weights before they were restored
            registry.call(self.plugins.collector.sync_weights, self.models.actor)
        if self.dist.is_main:
            if path is not None and not metrics.is_file():
                print(f"warning: {metrics} is missing: the rows of steps 1-{self.step_count} are "
                      f"lost; resuming from {path.name}, rows from step {self.step_count + 1} "
                      f"on", file=sys.stderr)
            # from step 0 (no checkpoint) every row is written again, evaluation's step 0 too
            keep_steps(metrics, self.step_count if path is not None else -1)
            save_config(self.cfg, self.run_dir / "config.yaml")
        self.dist.barrier()

    def _load_changed(self, state: dict, changes: dict) -> None:
        """`load_state_dict`, then the settings of this config where they differ from the saved
        one: a changed ``kl`` section restarts the KL coefficient, changed rewards keep only the
        score statistics, and the learning rates and weight decay always come from ``train``."""
        fresh_kl, fresh_rewards = self.kl.state_dict(), self.plugins.rewards.state_dict()
        if any(k.startswith(("rewards.", "reward.")) for k in changes):
            state["rewards"] = {**fresh_rewards, **{k: v for k, v in state["rewards"].items()
                                                    if k.startswith("score_")}}
        self.load_state_dict(state)
        if any(k.startswith("kl.") for k in changes):
            self.kl.load_state_dict(fresh_kl)
        self.updater.apply_learning_rates(self.cfg.train)

    def save_final(self) -> Path:
        """``final/``: a ``save_pretrained`` folder of the policy (LoRA merged into a copy, or the
        adapter alone with ``export.merge_lora: false``) and its tokenizer; the run's marker then
        records the step (`rundir.finished_step`)."""
        final, tmp = self.run_dir / "final", self.run_dir / ".tmp-final"
        try:
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            self._export(tmp)  # written beside, then renamed: final/ is whole or absent
            if self.dist.is_main:
                rundir.publish(tmp, final)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if not checkpoint.io_failure(exc):
                raise
            reason = " ".join(str(exc).split())
            raise UserError(f"cannot write {final} ({reason}); the newest checkpoint is intact: "
                            f"free some space and continue with {option('resume')}") from exc
        if self.dist.is_main:
            rundir.write_marker(self.run_dir, "run", finished_step=self.step_count)
        self.dist.barrier()
        return final

    def _export(self, final: Path) -> None:
        actor = self.models.actor
        if self.dist.enabled:  # gather the shards once, on rank 0
            state = distributed.full_state(actor)
            if self.dist.is_main:
                if hasattr(actor, "merge_and_unload") and self.cfg.export.merge_lora:
                    build.merged_lora_copy(self.cfg.models.actor, state).save_pretrained(final)
                else:
                    actor.save_pretrained(final, state_dict=state)
                self.models.tokenizer.save_pretrained(final)
            return
        if hasattr(actor, "merge_and_unload") and self.cfg.export.merge_lora:
            actor = copy.deepcopy(actor).merge_and_unload()  # a copy: the training model keeps LoRA
        actor.save_pretrained(final)
        self.models.tokenizer.save_pretrained(final)
