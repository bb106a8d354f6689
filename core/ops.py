"""Masked tensor helpers: means, variances and whitening over valid tokens only.

Masks are bool tensors shaped like the data, true on real tokens. Values at masked-out
positions are never read (``torch.where``, not multiplication), so padding may hold garbage.
An empty mask gives 0, never NaN.

>>> import torch
>>> x = torch.tensor([[1.0, 3.0, 99.0]])
>>> m = torch.tensor([[True, True, False]])
>>> masked_mean(x, m).item(), masked_var(x, m).item()
(2.0, 1.0)
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over true entries of ``mask``, over all entries (``dim=None``) or along
    ``dim``. A slice with no true entry gives 0.

    >>> masked_mean(torch.tensor([[1.0, 5.0], [2.0, 7.0]]),
    ...             torch.tensor([[True, False], [False, False]]), dim=-1).tolist()
    [1.0, 0.0]
    """
    total = torch.where(mask, x, 0).sum() if dim is None else torch.where(mask, x, 0).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (divides by the count, no Bessel correction) of ``x`` over all true
    entries of ``mask``; 0 for an empty mask or a single entry.

    >>> masked_var(torch.tensor([0.0, 2.0, 50.0]), torch.tensor([True, True, False])).item()
    1.0
    """
    centred = x - masked_mean(x, mask)
    return masked_mean(centred * centred, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to mean 0 and (population) std 1 over all true entries of ``mask`` (the
    whole batch at once); 0 at masked-out positions. With ``shift_mean=False`` only the scale
    changes (the mean is added back).

    >>> masked_whiten(torch.tensor([1.0, 3.0, 7.0]), torch.tensor([True, True, False])).tolist()
    [-1.0, 1.0, 0.0]
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] long index of the last true entry of each row of a [B, R] mask; -1 for a row with
    no true entry (a zero-length response).

    >>> last_token_index(torch.tensor([[True, True, False], [True, True, True],
    ...                                [False, False, False]])).tolist()
    [1, 2, -1]
    """
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, positions, -1).amax(dim=-1)
