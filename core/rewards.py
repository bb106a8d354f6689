"""Reward composition: several reward plugins, each weighted, summed into one sequence score.

Each component's raw output goes to ``("score_parts", label)``; ``score = sum(weight * part)``.
A component that returns the wrong shape, NaN or inf stops the run with an error naming it.

>>> import torch
>>> from tensordict import TensorDict
>>> class Const(torch.nn.Module):
...     def forward(self, td):
...         return torch.ones(td.batch_size[0])
>>> rewards = RewardComposer([("const", 0.5, Const())])
>>> rewards(TensorDict({}, batch_size=[2]))["score"]
tensor([0.5000, 0.5000])
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from rlpipe.core import schema
from rlpipe.core.errors import UserError


def _texts(td, key) -> list[str]:
    value = td.get(key)
    return value.tolist() if hasattr(value, "tolist") else list(value)


def wrap_reward_function(fn) -> type[nn.Module]:
    """Turn ``fn(prompts, responses, **batch) -> Sequence[float]`` into a reward module class.

    The function's keyword parameters after ``prompts, responses`` become the config keys; the
    batch's top-level entries are passed as keyword arguments too (so ``fn`` must take ``**batch``).
    """
    params = list(inspect.signature(fn).parameters.values())[2:]
    config_params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    class FunctionReward(nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.kwargs = kwargs

        def forward(self, td):
            skip = {schema.PROMPT_TEXT, schema.RESPONSE_TEXT, *self.kwargs}
            batch = {k: td.get(k) for k in td.keys() if k not in skip}
            out = fn(_texts(td, schema.PROMPT_TEXT), _texts(td, schema.RESPONSE_TEXT),
                     **batch, **self.kwargs)
            try:
                return torch.as_tensor([float(x) for x in out], dtype=torch.float32)
            except (TypeError, ValueError) as exc:
                raise UserError(f"reward function {fn.__name__} must return numbers: {exc}") from exc

    FunctionReward.__signature__ = inspect.Signature(config_params)
    FunctionReward.__name__ = FunctionReward.__qualname__ = fn.__name__
    FunctionReward.__doc__ = fn.__doc__
    FunctionReward.__module__ = fn.__module__
    return FunctionReward


class RewardComposer(nn.Module):
    """Run each ``(label, weight, module)`` on the batch; write score parts and the score."""

    def __init__(self, components: list[tuple[str, float, nn.Module]]):
        super().__init__()
        self.labels = [label for label, _, _ in components]
        self.weights = [float(weight) for _, weight, _ in components]
        self.parts = nn.ModuleList([module for _, _, module in components])

    @torch.no_grad()
    def forward(self, td):
        batch = td.batch_size[0]
        score = torch.zeros(batch, device=td.device)
        for label, weight, module in zip(self.labels, self.weights, self.parts):
            part = module(td)
            if not isinstance(part, torch.Tensor) or part.shape != (batch,):
                shape = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
                raise UserError(f"reward {label!r} returned {shape}; expected a tensor of shape ({batch},)")
            part = part.to(score.device, torch.float32)
            if not torch.isfinite(part).all():
                raise UserError(f"reward {label!r} returned NaN or inf for "
                                f"{int((~torch.isfinite(part)).sum())} of {batch} samples")
            td.set((schema.SCORE_PARTS, label), part)
            score += weight * part
        td.set(schema.SCORE, score)
        return td
