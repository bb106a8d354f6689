"""Reward functions as reward modules: ``f(prompts, responses, **batch) -> Sequence[float]``
wrapped into an ``nn.Module`` class whose ``forward(td)`` returns a [B] float tensor.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError


def batch_texts(td, key) -> list:
    """A non-tensor entry of the batch (``prompt_text``, ``response_text``, a data column) as a
    list; a tensor entry as a list of Python numbers."""
    value = td.get(key)
    return value.tolist() if hasattr(value, "tolist") else list(value)


def wrap_reward_function(fn) -> type[nn.Module]:
    """Turn ``fn(prompts, responses, **batch) -> Sequence[float]`` into a reward module class.

    The function's keyword parameters after ``prompts, responses`` that have a default become
    its config keys; those without one name the dataset columns it reads (declared as
    ``columns``, so a missing column is an error before the first step). Every column arrives as
    a list under its own name (``answer=[...]``, one value per sample), with the batch's other
    top-level entries (``response_mask``, ...), so ``fn`` must take ``**batch``. A column named
    like a batch entry shadows that entry here; reward modules read both (``td["data", name]``).

    >>> import torch
    >>> from tensordict import TensorDict, NonTensorStack
    >>> def exact(prompts, responses, answer, **batch):
    ...     return [float(r == a) for r, a in zip(responses, answer)]
    >>> Reward = wrap_reward_function(exact)
    >>> Reward.columns
    ('answer',)
    >>> td = TensorDict({"prompt_text": NonTensorStack("q", "q"),
    ...                  "response_text": NonTensorStack("4", "5"),
    ...                  ("data", "answer"): NonTensorStack("4", "4")}, batch_size=[2])
    >>> Reward()(td)
    tensor([1., 0.])
    """
    params = list(inspect.signature(fn).parameters.values())[2:]
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    config_params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in named
                     if p.default is not p.empty]

    class FunctionReward(nn.Module):
        columns = tuple(p.name for p in named if p.default is p.empty)

        def __init__(self, **kwargs):
            super().__init__()
            self.kwargs = kwargs

        def forward(self, td):
            skip = {schema.PROMPT_TEXT, schema.RESPONSE_TEXT, schema.DATA, *self.kwargs}
            batch = {k: td.get(k) for k in td.keys() if k not in skip}
            if schema.DATA in td.keys():
                batch.update({k: batch_texts(td, (schema.DATA, k)) for k in td.get(schema.DATA).keys()})
            out = fn(batch_texts(td, schema.PROMPT_TEXT), batch_texts(td, schema.RESPONSE_TEXT),
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
