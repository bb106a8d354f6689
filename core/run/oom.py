"""Out of memory: one line that says in which stage, how much was in use, and which settings
shrink that stage, instead of a traceback.

A PPO step that does not fit raises `torch.OutOfMemoryError` (CUDA) or a `RuntimeError` from
torch's CPU allocator. `explained` turns either into a `UserError` (one ``error:`` line, exit 2):
the stage comes from where in rlpipe the allocation failed (the traceback's frames), the hints
from the run's settings, each with its current value.

>>> stage_of([("core/run/pipeline.py", "step"), ("core/step/update.py", "update"),
...           ("core/models/lm.py", "_forward")])
'the PPO update'
>>> stage_of([("core/run/pipeline.py", "step"), ("core/run/pipeline.py", "_score_tokens"),
...           ("core/models/lm.py", "_forward")])
'scoring (reference log-probs, values)'
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from pathlib import Path

import torch

from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.registry import is_oom
from rlpipe.core.run.build import needs_critic

ROOT = Path(__file__).resolve().parents[2]
# (file, function or None for any) -> stage; the outermost frame that matches names the stage
STAGES = ((("core/step/update.py", None), "the PPO update"),
          (("core/run/pipeline.py", "_score_tokens"), "scoring (reference log-probs, values)"),
          (("core/step/evaluation.py", None), "evaluation"),
          (("core/run/preflight.py", None), "the preflight"),
          (("core/run/run_state.py", None), "a checkpoint or the final save"),
          (("core/run/build.py", None), "loading the models"),
          (("plugins/collectors/", None), "generation"),
          (("core/step/rewards.py", None), "the rewards"),
          (("plugins/rewards/", None), "the rewards"))


def stage_of(frames: list[tuple[str, str]]) -> str:
    """The stage of ``frames`` ((path relative to the package, function), outermost first)."""
    for path, function in frames:
        for (where, name), stage in STAGES:
            if path.startswith(where) and name in (None, function):
                return stage
    return "the run"


def _frames(exc: BaseException) -> list[tuple[str, str]]:
    out = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT):
            out.append((path.relative_to(ROOT).as_posix(), frame.name))
    return out


def hints(cfg, stage: str, critic: bool = True) -> list[str]:
    """Settings that shrink ``stage``, with their values now; savers already on, and the critic's
    where the run has none, are left out."""
    m, t = cfg.models, cfg.train
    models = [f"models.actor.lora (now {'set' if m.actor.lora else 'null'})",
              *([] if m.critic.shared_backbone or not critic
                else ["models.critic.shared_backbone: true"]),
              *([] if m.reference.offload else ["models.reference.offload: true"]),
              f"models.actor.dtype (now {m.actor.dtype})",
              f"distributed.nproc (now {cfg.distributed.nproc}: FSDP2 shards the models)"]
    budget = cfg.collector.args.get("max_new_tokens", "the collector's default")
    new_tokens = f"collector.max_new_tokens (now {budget})"
    by_stage = {
        "the PPO update": [f"train.grad_accum (now {t.grad_accum}: raise it, fewer sequences "
                           f"at once)",
                           *[f"models.{k}.gradient_checkpointing: true"
                             for k in ("actor", "critic")[:2 if critic else 1]
                             if not getattr(m, k).gradient_checkpointing], new_tokens, *models],
        "scoring (reference log-probs, values)": [
            f"train.forward_batch_size (now {t.forward_batch_size})", *models],
        "generation": [new_tokens, "the collector's own batch and memory arguments"],
        "the rewards": ["the reward plugins' batch_size and offload arguments"],
        "evaluation": [f"eval.batch_size (now {cfg.eval.batch_size})", new_tokens],
        "loading the models": models,
    }
    return by_stage.get(stage, models)


def _in_use() -> str:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return f", {torch.cuda.memory_allocated() / 2**30:.1f} of {total / 2**30:.1f} GiB allocated"


def _has_critic(cfg) -> bool:
    """Whether ``cfg``'s advantage estimator trains a critic, before the models are built
    (yes where the config cannot say)."""
    try:
        return needs_critic(cfg)
    except Exception:  # noqa: BLE001 - an unresolvable plugin fails on its own line elsewhere
        return True


@contextlib.contextmanager
def explained(cfg, critic: bool | None = None):
    """Within the block, running out of memory is a `UserError` naming the stage and hints
    (``critic``: whether the run has a critic to shrink; None: as ``cfg``'s estimator says)."""
    try:
        yield
    except Exception as exc:
        if not is_oom(exc):
            raise
        critic = _has_critic(cfg) if critic is None else critic
        stage, plugin = stage_of(_frames(exc)), getattr(exc, "rlpipe_plugin", None)
        where = stage   # with the plugin whose call ran out (`registry.calling`)
        if plugin is not None:
            where = plugin if stage == "the run" else f"{stage}, {plugin}"
        first = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else type(exc).__name__
        raise UserError(f"out of memory in {where}{_in_use()} ({first}); to fit, try "
                        + "; ".join(hints(cfg, stage, critic))) from exc


def explains(method):
    """`explained` around a `Pipeline` method (``__init__``, ``step``, ``train``), with the
    pipeline's config (or the first argument, for ``__init__`` before it sets ``cfg``) and
    whether its models include a critic (before they are built: what the estimator declares);
    an inner one has explained it already, so an outer one sees a `UserError` and lets it pass."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        models = getattr(self, "models", None)
        critic = None if models is None else models.critic is not None
        with explained(getattr(self, "cfg", None) or args[0], critic):
            return method(self, *args, **kwargs)
    return wrapper
