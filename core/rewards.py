"""Reward composition: several reward plugins, each weighted, summed into one sequence score.

Each component's raw output goes to ``("score_parts", label)``; ``score = sum(weight * part)``,
optionally normalised by running statistics across steps (``reward.normalize``) and clipped
(``reward.clip``). A component that returns the wrong shape, NaN or inf stops the run with an
error naming it.

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

from rlpipe.core import registry, schema
from rlpipe.core.errors import UserError


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
    defaults = {p.name: p.default for p in config_params}

    class FunctionReward(nn.Module):
        columns = tuple(p.name for p in named if p.default is p.empty)

        def __init__(self, **kwargs):
            super().__init__()
            self.kwargs = kwargs

        def forward(self, td):
            skip = {schema.PROMPT_TEXT, schema.RESPONSE_TEXT, schema.DATA, *self.kwargs}
            batch = {k: td.get(k) for k in td.keys() if k not in skip}
            if schema.DATA in td.keys():
                columns = list(td.get(schema.DATA).keys())
                shadowing = [c for c in columns if c in defaults]
                if shadowing:  # it would replace the setting's value silently
                    c = shadowing[0]
                    raise UserError(f"reward function {fn.__name__}: the data column {c!r} has the "
                                    f"name of its setting {c} (default {defaults[c]!r}); rename "
                                    f"the column or the parameter")
                batch.update({k: batch_texts(td, (schema.DATA, k)) for k in columns})
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


def _entries(td) -> dict:
    """Each key of ``td`` (text entries too); for a tensor, its object and in-place version."""
    tensors = dict(td.items(include_nested=True, leaves_only=True))
    return {key: (id(tensors[key]), tensors[key]._version) if key in tensors else (None, None)
            for key in td.keys(include_nested=True)}


def _changed(before: dict, after: dict) -> str | None:
    """What a stage did to the batch between two `_entries`, in words, or None.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> td = TensorDict({"response_mask": torch.ones(2, 3, dtype=torch.bool)}, batch_size=[2])
    >>> before = _entries(td)
    >>> td["response_mask"][0] = False
    >>> _changed(before, _entries(td))
    "changed 'response_mask' in place"
    """
    def name(key):
        return "/".join(key) if isinstance(key, tuple) else key

    for key in after.keys() - before.keys():
        return f"wrote {name(key)!r}"
    for key in before.keys() - after.keys():
        return f"deleted {name(key)!r}"
    for key, (ident, version) in after.items():
        if ident != before[key][0]:
            return f"replaced {name(key)!r}"
        if version != before[key][1]:
            return f"changed {name(key)!r} in place"
    return None


class RewardComposer(nn.Module):
    """Run each ``(label, weight, module)`` on the batch; write score parts and the score.

    ``score = sum(weight * part)``; then, with ``normalize``, the running statistics absorb this
    batch's scores and the score becomes ``(score - mean) / sqrt(var + EPS)``; then, with
    ``clip``, it is clamped to ``[-clip, clip]``. The parts are kept raw. The running count, mean
    and sum of squared deviations are float64 buffers (``score_count``, ``score_mean``,
    ``score_m2``), so ``state_dict()`` checkpoints them; they are per process.

    >>> from tensordict import TensorDict
    >>> class Ramp(nn.Module):
    ...     def forward(self, td):
    ...         return torch.arange(td.batch_size[0], dtype=torch.float32)
    >>> rewards = RewardComposer([("ramp", 2.0, Ramp())], clip=1.0, normalize=True)
    >>> rewards(TensorDict({}, batch_size=[3]))["score"]
    tensor([-1.,  0.,  1.])
    >>> rewards.score_mean.item(), rewards.score_count.item()
    (2.0, 3.0)
    """

    EPS = 1e-8  # added to the running variance before the square root

    def __init__(self, components: list[tuple[str, float, nn.Module]], clip: float | None = None,
                 normalize: bool = False):
        super().__init__()
        if clip is not None and not clip > 0:
            raise UserError(f"reward.clip must be > 0 (or null: off), got {clip}")
        self.labels = [label for label, _, _ in components]
        self.weights = [float(weight) for _, weight, _ in components]
        self.parts = nn.ModuleList([module for _, _, module in components])
        self.clip, self.normalize = clip, normalize
        for name in ("score_count", "score_mean", "score_m2"):
            self.register_buffer(name, torch.zeros((), dtype=torch.float64))

    def _part(self, label: str, module: nn.Module, td, device) -> torch.Tensor:
        """One component's [B] float32 output on ``device``, checked for shape and finiteness.
        Whatever the plugin raises becomes one `PluginError` line naming it (`registry.call`)."""
        batch = td.batch_size[0]
        before = _entries(td)
        part = registry.call(module, td)
        origin = getattr(module, registry.LABEL_ATTR, None)
        origin = f" (plugin {origin})" if isinstance(origin, str) else ""
        changed = _changed(before, _entries(td))
        if changed:
            raise UserError(f"reward {label!r} {changed} in the batch{origin}; a reward returns its "
                            f"[B] scores and writes nothing (the composer owns the batch)")
        if not isinstance(part, torch.Tensor) or part.shape != (batch,):
            shape = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
            raise UserError(f"reward {label!r} returned {shape}; expected a tensor of shape "
                            f"({batch},){origin}")
        finite_before = bool(torch.isfinite(part).all())
        part = part.to(device, torch.float32)
        if not torch.isfinite(part).all():
            what = "NaN or inf" if not finite_before else "values beyond float32's range (|x| > 3.4e38)"
            raise UserError(f"reward {label!r} returned {what} for "
                            f"{int((~torch.isfinite(part)).sum())} of {batch} samples{origin}")
        return part

    def update_stats(self, score: torch.Tensor) -> None:
        """Merge a batch into the running statistics (Chan et al.'s parallel variance update)."""
        if score.numel() == 0:
            return
        x = score.detach().to(self.score_mean.device, torch.float64)
        n_a, n_b, mean_b = self.score_count.clone(), float(x.numel()), x.mean()
        delta, n = mean_b - self.score_mean, n_a + n_b
        self.score_mean += delta * n_b / n
        self.score_m2 += ((x - mean_b) ** 2).sum() + delta ** 2 * n_a * n_b / n
        self.score_count += n_b

    def normalized(self, score: torch.Tensor) -> torch.Tensor:
        """``(score - mean) / sqrt(var + EPS)`` under the running statistics (population variance)."""
        mean, var = self.score_mean, self.score_m2 / self.score_count.clamp(min=1.0)
        out = (score.double() - mean.to(score.device)) / torch.sqrt(var + self.EPS).to(score.device)
        return out.to(score.dtype)

    def weighted(self, td) -> torch.Tensor:
        """Write each component to ``("score_parts", label)``; return ``sum(weight * part)``."""
        score = torch.zeros(td.batch_size[0], device=td.device)
        for label, weight, module in zip(self.labels, self.weights, self.parts):
            part = self._part(label, module, td, score.device)
            td.set((schema.SCORE_PARTS, label), part)
            score = score + weight * part
        return score

    @torch.no_grad()
    def evaluate(self, td):
        """The parts and ``score`` for a held-out batch: weighted and clipped, never normalised,
        and the running statistics are left as they are."""
        score = self.weighted(td)
        if self.clip is not None:
            score = score.clamp(-self.clip, self.clip)
        td.set(schema.SCORE, score)
        return td

    @torch.no_grad()
    def forward(self, td):
        score = self.weighted(td)
        if self.normalize:
            self.update_stats(score)  # this batch counts before it is normalised
            score = self.normalized(score)
        if self.clip is not None:
            score = score.clamp(-self.clip, self.clip)
        if not torch.isfinite(score).all():  # finite parts, but weight * part overflowed float32
            raise UserError(f"reward score is not finite for {int((~torch.isfinite(score)).sum())} "
                            f"samples: weight x part overflows float32 (rewards: "
                            f"{', '.join(self.labels)}); lower the weights or set reward.clip")
        td.set(schema.SCORE, score)
        return td
