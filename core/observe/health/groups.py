"""Groups whose samples are one and the same response (``collector.temperature`` 0 or nearly):
their scores are equal, a group-relative advantage is 0 and the step's loss and gradient with
it; the health rule ``flat_groups`` says so at the first step it sees them.

>>> import torch
>>> ids = torch.tensor([[5, 6, 0], [5, 6, 9], [7, 8, 0], [7, 8, 0]])
>>> mask = ids != 0
>>> identical_frac(ids, mask, torch.tensor([0, 0, 1, 1]))
{'response/identical_frac': 0.5}
"""

from __future__ import annotations

import torch


def identical_frac(response_ids: torch.Tensor, response_mask: torch.Tensor,
                   group_id: torch.Tensor) -> dict[str, float]:
    """``{"response/identical_frac": f}``: the fraction of groups (of two or more samples) whose
    responses are the same tokens (padding aside); empty without such a group (``n: 1``)."""
    rows = torch.where(response_mask.bool(), response_ids, -1)
    rows = torch.cat([rows, response_mask.sum(-1, keepdim=True)], dim=1)  # the length counts too
    _, kind = torch.unique(rows, dim=0, return_inverse=True)
    groups, member = torch.unique(group_id, return_inverse=True)
    size = torch.bincount(member, minlength=len(groups))
    high = kind.new_full((len(groups),), -1).scatter_reduce(0, member, kind, "amax")
    low = kind.new_full((len(groups),), len(kind)).scatter_reduce(0, member, kind, "amin")
    several = size >= 2
    if not several.any():
        return {}
    return {"response/identical_frac": int(((high == low) & several).sum()) / int(several.sum())}
