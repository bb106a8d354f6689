"""The update's optimizers: AdamW over the trainable parameters, and the learning-rate schedule.

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> len(trainable(layer)), type(make_optimizer(trainable(layer), 1e-3, 0.0)).__name__
(2, 'AdamW')
"""

from __future__ import annotations

import math

import torch


def trainable(module: torch.nn.Module, exclude: torch.nn.Module | None = None) -> list:
    """Parameters that require grad, without those ``exclude`` owns (a shared backbone)."""
    owned = {id(p) for p in exclude.parameters()} if exclude is not None else set()
    return [p for p in module.parameters() if p.requires_grad and id(p) not in owned]


def make_optimizer(params: list, lr: float, weight_decay: float):
    """AdamW; fused (one kernel over all parameters) where torch has
    that kernel for these tensors, else torch's default foreach implementation."""
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                                 for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def make_scheduler(optimizer, train, steps: int):
    """Linear warmup over ``train.warmup_steps`` optimizer steps, then constant or cosine down to
    ``train.min_lr_ratio`` of the rate at the last optimizer step of ``steps`` (``run.steps``)."""
    t = train
    total = max(1, steps * t.epochs * t.minibatches)

    def factor(it: int) -> float:
        if it < t.warmup_steps:
            return (it + 1) / (t.warmup_steps + 1)
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (it - t.warmup_steps) / max(1, total - t.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
