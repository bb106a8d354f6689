"""Policies that load without rlpipe: ``rlpipe export RUN_DIR [--step N] OUT``.

A one-process checkpoint ``checkpoints/step-N/`` holds ``policy/``, written with the checkpoint
(inside its manifest; `rlpipe.core.run.checkpoint.save_policy`): the actor as a
``save_pretrained`` folder with its tokenizer, readable by ``AutoModelForCausalLM.from_pretrained``; for a LoRA actor the peft adapter alone
(``adapter_config.json`` names the base model folder), readable by
``PeftModel.from_pretrained(base, folder)``. `export` writes such a folder from any checkpoint of a
run (distributed ones too, and a LoRA actor merged into its base, which also covers a base built
with ``init: random``): it rebuilds the actor from the run's ``config.yaml``, loads the
checkpoint's weights into it and saves it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from rlpipe.core.base.errors import UserError
from rlpipe.core.run import build
from rlpipe.core.models.distributed import load_full_state
from rlpipe.core.models.lm import load_causal_lm, load_tokenizer
from rlpipe.core.config.settings import load_config
from rlpipe.core.run import checkpoint, runlock


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """Checkpoint ``step`` of the run (intact), or the newest intact one."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not an rlpipe run directory (no config.yaml)")
    if step is None:
        path, skipped = checkpoint.choose(run_dir)
        if path is None and not skipped:
            hint = "; final/ already holds the trained policy" if (run_dir / "final").is_dir() else ""
            raise UserError(f"{run_dir} has no intact checkpoint: set checkpoint.every to write "
                            f"them{hint}")
        if skipped:  # never an older policy than asked for without saying so
            newest, why = skipped[0]
            older = f"pass --step {path.name.split('-')[1].lstrip('0') or 0} to export the newest " \
                    f"intact one, {path.name}" if path is not None else "no older one is intact"
            raise UserError(f"the newest checkpoint {newest} is damaged ({why}); {older}")
        return path
    found = {int(p.name.split("-")[1]): p for p in checkpoint.complete(run_dir)}
    if step not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        raise UserError(f"{run_dir} has no checkpoint of step {step} (steps: {have})")
    problem = checkpoint.verify(found[step])
    if problem:
        raise UserError(f"checkpoint {found[step]} is damaged: {problem}")
    return found[step]


def _check_out(out: Path, run_dir: Path) -> Path:
    out = Path(out).expanduser().resolve()
    if out == run_dir or run_dir in out.parents or out in run_dir.parents:
        raise UserError(f"OUT {out} {'is inside' if run_dir in out.parents else 'is or holds'} "
                        f"the run directory {run_dir}, which holds only rlpipe's own files (its "
                        f"--resume would refuse it); choose a folder outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory; choose another OUT")
    return out


def _rebuilt_actor(cfg, path: Path):
    """The run's actor (LoRA applied) with the weights of checkpoint ``path``, on CPU."""

    actor_cfg = cfg.models.actor
    build.seed_everything(cfg.run.seed)  # a random-init base is rebuilt exactly as the run did
    tokenizer = load_tokenizer(actor_cfg.path, actor_cfg.trust_remote_code)
    actor = load_causal_lm(actor_cfg.path, actor_cfg.init, actor_cfg.dtype,
                           actor_cfg.trust_remote_code)
    if actor_cfg.lora is not None:
        actor = build.apply_lora(actor, actor_cfg.lora, "CAUSAL_LM", "models.actor.lora")
    if checkpoint.is_sharded(path):
        import torch.distributed.checkpoint as dcp

        state = checkpoint.trainable_state(actor, actor.state_dict(), to_cpu=True)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.filterwarnings("ignore", ".*single process", UserWarning)
                dcp.load({"models": {"actor": state}}, checkpoint_id=str(path / checkpoint.SHARDS))
        except Exception as exc:  # noqa: BLE001 - DCP names the mismatched keys in its text
            raise UserError(f"checkpoint {path} does not match the run's actor "
                            f"({' '.join(str(exc).split())[:300]})") from exc
        load_full_state(actor, state)
    else:
        checkpoint.load(path, {"actor": actor})
    return actor.eval(), tokenizer


def export(run_dir: Path, out: Path, step: int | None = None, merge: bool = True) -> Path:
    """Write the policy of checkpoint ``step`` (default: the newest) of ``run_dir`` to ``out`` as a
    ``save_pretrained`` folder with its tokenizer: a LoRA actor merged into its base (``merge``)
    or as the adapter alone. Returns ``out``."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not an rlpipe run directory (no config.yaml)")
    lock = runlock.hold(run_dir, "RUN_DIR", shared=True)  # no run, --resume or --overwrite meanwhile
    try:
        return _export(run_dir, out, step, merge)
    finally:
        lock.release()


def _export(run_dir: Path, out, step: int | None, merge: bool) -> Path:
    path = find_checkpoint(run_dir, step)
    cfg = load_config(run_dir / "config.yaml")
    lora = cfg.models.actor.lora is not None
    if not (lora or merge):
        raise UserError(f"--adapter: {run_dir}'s actor has no LoRA adapter (models.actor.lora is "
                        f"null); export without --adapter writes the full model")
    out = _check_out(out, run_dir)
    tmp = out.with_name(f".{out.name}.tmp-export-{os.getpid()}")  # beside OUT, then renamed
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        saved = path / checkpoint.POLICY
        if saved.is_dir() and not (lora and merge):  # the checkpoint's own folder is the answer
            shutil.copytree(saved, tmp)
        else:
            with torch.no_grad():
                actor, tokenizer = _rebuilt_actor(cfg, path)
                if lora and merge:
                    actor = actor.merge_and_unload()
                checkpoint.save_policy(actor, tokenizer, tmp, cfg.models.actor.path)
        tmp.rename(out)  # onto a missing or empty OUT
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
