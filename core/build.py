"""Turn a `Config` into live objects: run directory, models, plugins, optimizers.

Everything the pipeline needs is built here, so `core/pipeline.py` reads as the algorithm only.
Plugins are looked up by name in the registry and never special-cased.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe.core import registry
from rlpipe.core.config import Config, save_config
from rlpipe.core.context import RunContext
from rlpipe.core.errors import UserError
from rlpipe.core.models import ValueModel, frozen_copy, load_causal_lm, load_tokenizer
from rlpipe.core.rewards import RewardComposer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UserError(f"run.device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"run.device: {name!r} requested but CUDA is not available")
    return device


def prepare_run_dir(cfg: Config, overwrite: bool = False) -> Path:
    """Create the run directory and write the resolved config; refuse to clobber an earlier run."""
    run_dir = Path(cfg.run.output_dir).expanduser().resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise UserError(f"run directory {run_dir} is not empty; choose another "
                            f"run.output_dir=... or pass --overwrite")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


@dataclass
class Models:
    actor: torch.nn.Module
    reference: torch.nn.Module
    critic: ValueModel | None
    tokenizer: object


def build_models(cfg: Config, device: torch.device, need_critic: bool) -> Models:
    """Actor, frozen reference (a copy of the initial actor), and critic when the advantage needs one."""
    actor_cfg = cfg.models.actor
    tokenizer = load_tokenizer(actor_cfg.path)
    actor = load_causal_lm(actor_cfg.path, actor_cfg.init, actor_cfg.dtype).to(device)
    reference = frozen_copy(actor)
    critic = None
    if need_critic:
        critic_cfg = cfg.models.critic
        critic = (ValueModel.from_actor(actor) if critic_cfg.path is None
                  else ValueModel.from_pretrained(critic_cfg.path, critic_cfg.init))
        critic = critic.to(device).eval()
    return Models(actor, reference, critic, tokenizer)


@dataclass
class Plugins:
    collector: object
    rewards: RewardComposer
    advantage: torch.nn.Module
    loss: torch.nn.Module


def _make(group: str, section, ctx: RunContext, where: str):
    obj = registry.load(group, section.name)
    label = f"{where} ({registry.resolve(group, section.name).label})"
    return registry.instantiate(obj, dict(section.args), ctx, label)


def build_plugins(cfg: Config, ctx: RunContext) -> Plugins:
    collector = _make("collectors", cfg.collector, ctx, "collector")
    ctx.max_new_tokens = int(getattr(collector, "max_new_tokens", 0))
    parts = [(r.key, r.weight, _make("rewards", r, ctx, f"rewards.{i}"))
             for i, r in enumerate(cfg.rewards)]
    advantage = _make("advantages", cfg.advantage, ctx, "advantage")
    loss = _make("losses", cfg.loss, ctx, "loss")
    return Plugins(collector, RewardComposer(parts).to(ctx.device), advantage.to(ctx.device),
                   loss.to(ctx.device))


def needs_critic(cfg: Config) -> bool:
    """Critic-free estimators declare ``needs_critic = False``; no critic is built or trained then."""
    return bool(getattr(registry.load("advantages", cfg.advantage.name), "needs_critic", True))


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float):
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
