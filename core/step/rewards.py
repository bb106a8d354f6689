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

import torch
from torch import nn

from rlpipe.core.contracts import registry
from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError


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

    def _part(self, label: str, module: nn.Module, td, device) -> dict[str, torch.Tensor]:
        """One component's output as ``{"score": [B], "applies": [B] bool, KEY: [B]}`` float32 on
        ``device``, each checked for shape and finiteness (where it applies). A module returns a
        [B] tensor, or such a dict: ``applies`` False is "not applicable" (TRL's ``None``: the
        sample's score leaves it out, its part is 0), other keys are logged. Whatever the plugin
        raises becomes one `PluginError` line naming it (`registry.call`)."""
        before = _entries(td)
        out = registry.call(module, td)
        origin = getattr(module, registry.LABEL_ATTR, None)
        origin = f" (plugin {origin})" if isinstance(origin, str) else ""
        changed = _changed(before, _entries(td))
        if changed:
            raise UserError(f"reward {label!r} {changed} in the batch{origin}; a reward returns its "
                            f"[B] scores and writes nothing (the composer owns the batch)")
        out = dict(out) if isinstance(out, dict) else {"score": out}
        applies = out.pop("applies", None)
        if applies is None:
            applies = torch.ones(td.batch_size[0], dtype=torch.bool, device=device)
        else:
            applies = self._checked(f"{label}/applies", applies, td, origin).to(device, torch.bool)
        parts = {k: self._checked(label if k == "score" else f"{label}/{k}", v, td, origin,
                                  applies).to(device, torch.float32) for k, v in out.items()}
        if "score" not in parts:
            raise UserError(f"reward {label!r} returned a dict without 'score'{origin}")
        parts["score"] = parts["score"].where(applies, 0.0)
        return {**parts, "applies": applies}

    @staticmethod
    def _checked(label: str, part, td, origin: str, applies=None) -> torch.Tensor:
        """``part`` if it is a [B] tensor, finite in float32 where it ``applies``; else one line."""
        batch = td.batch_size[0]
        if not isinstance(part, torch.Tensor) or part.shape != (batch,):
            shape = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
            raise UserError(f"reward {label!r} returned {shape}; expected a tensor of shape "
                            f"({batch},){origin}")
        if part.dtype is torch.bool:
            return part
        applies = torch.ones(batch, dtype=torch.bool) if applies is None else applies.cpu()
        finite_before = torch.isfinite(part).cpu() | ~applies
        bad = ~(torch.isfinite(part.to(torch.float32)).cpu() | ~applies)
        if bad.any():
            what = ("NaN or inf" if not finite_before.all()
                    else "values beyond float32's range (|x| > 3.4e38)")
            raise UserError(f"reward {label!r} returned {what} for "
                            f"{int(bad.sum())} of {batch} samples{origin}")
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
        """Write each component to ``("score_parts", label)`` (its other keys to ``label/KEY``);
        return ``sum(weight * part)`` over the components that apply to each sample (TRL's
        ``nansum``); a sample no component applies to is one line naming them."""
        score = torch.zeros(td.batch_size[0], device=td.device)
        applies = torch.zeros(td.batch_size[0], dtype=torch.bool, device=score.device)
        for label, weight, module in zip(self.labels, self.weights, self.parts):
            parts = self._part(label, module, td, score.device)
            for key, part in parts.items():
                if key == "applies" and part.all():
                    continue
                name = label if key == "score" else f"{label}/{key}"
                td.set((schema.SCORE_PARTS, name), part.to(torch.float32))
            score = score + weight * parts["score"]
            applies |= parts["applies"]
        if td.batch_size[0] and not applies.all():
            i = int((~applies).nonzero()[0])
            raise UserError(f"sample {i}: every reward returned None (not applicable) for it "
                            f"({', '.join(self.labels)}); at least one must score each sample")
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
