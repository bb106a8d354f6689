"""core/base/ops.py: masked statistics against plain float64 loops over the selected entries only."""

import math

import pytest
import torch

from rlpipe.core.base.ops import last_token_index, masked_mean, masked_var, masked_whiten


def selected(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(v) for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def population_var(values: list[float]) -> float:
    mu = mean(values)
    return mean([(v - mu) ** 2 for v in values])


def batch(seed: int, shape=(6, 9), p_valid: float = 0.6):
    """Random data whose masked-out entries hold NaN and inf (they must never be read)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(shape, generator=g) < p_valid
    garbage = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
    x = torch.where(mask, x, garbage[torch.arange(x.numel()).reshape(shape) % 3])
    return x, mask


@pytest.mark.parametrize("seed", range(4))
def test_masked_mean_and_var_match_loops_and_ignore_garbage(seed):
    x, mask = batch(seed)
    values = selected(x, mask)
    assert masked_mean(x, mask).item() == pytest.approx(mean(values), rel=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(population_var(values), rel=1e-12)
    rows = masked_mean(x, mask, dim=-1)
    assert rows.tolist() == pytest.approx([mean(selected(r, m)) for r, m in zip(x, mask)], rel=1e-12)
    cols = masked_mean(x, mask, dim=0)
    assert cols.tolist() == pytest.approx([mean(selected(c, m)) for c, m in zip(x.T, mask.T)],
                                          rel=1e-12)


def test_empty_masks_give_zero_not_nan():
    x = torch.full((2, 3), math.nan)
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x, none).item() == 0.0
    assert masked_var(x, none).item() == 0.0
    assert masked_mean(x, none, dim=-1).tolist() == [0.0, 0.0]
    assert masked_whiten(x, none).tolist() == [[0.0] * 3] * 2
    one = torch.tensor([[False, True, False]])
    assert masked_var(torch.tensor([[math.nan, 4.0, math.inf]]), one).item() == 0.0


def test_gradient_never_reaches_padding():
    x, mask = batch(7)
    x = x.clone().requires_grad_(True)
    masked_mean(x, mask).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~mask] == 0).all()
    assert torch.allclose(x.grad[mask], torch.full_like(x.grad[mask], 1 / mask.sum().item()))


@pytest.mark.parametrize("seed", range(3))
def test_whiten_standardises_the_valid_entries_only(seed):
    x, mask = batch(seed, shape=(5, 7))
    white = masked_whiten(x, mask)
    values = selected(white, mask)
    assert mean(values) == pytest.approx(0.0, abs=1e-9)
    assert population_var(values) == pytest.approx(1.0, rel=1e-6)  # eps=1e-8 in the denominator
    assert (white[~mask] == 0).all()
    expected = [(v - mean(selected(x, mask))) / math.sqrt(population_var(selected(x, mask)))
                for v in selected(x, mask)]
    assert values == pytest.approx(expected, rel=1e-6)


def test_whiten_without_shift_keeps_the_mean():
    x = torch.tensor([2.0, 4.0, 6.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    out = masked_whiten(x, mask, shift_mean=False)
    # (x - 4) / std + 4 with std = sqrt(8/3), padding 0
    std = math.sqrt(8 / 3)
    assert out.tolist() == pytest.approx([4 - 2 / std, 4.0, 4 + 2 / std, 0.0], rel=1e-6)
    assert mean(selected(out, mask)) == pytest.approx(4.0)


def test_last_token_index_is_the_last_true_entry():
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(32, 11, generator=g) < 0.4  # holes inside rows, and some empty rows
    mask[0] = False
    expected = [max((i for i, m in enumerate(row) if m), default=-1) for row in mask.tolist()]
    assert last_token_index(mask).tolist() == expected
    assert last_token_index(mask).dtype == torch.long
    assert last_token_index(torch.tensor([[True, False, True, False]])).tolist() == [2]
