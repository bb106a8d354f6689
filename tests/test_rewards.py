"""Rule-based reward components: length penalty (band, overlong buffer, missing EOS) and loop
penalty (repeated n-grams, periodic tail), on hand-built batches."""

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.schema import FINISHED, RESPONSE_IDS, RESPONSE_MASK
from rlpipe.plugins.rewards.length import LengthPenalty
from rlpipe.plugins.rewards.loop import LoopPenalty, repeat_fraction, tail_fraction

GARBAGE = 7  # id written after the mask: it must change nothing


def batch(responses, finished=None, width=None):
    """Right-padded batch of token lists; padding holds GARBAGE, masks come from the lists."""
    width = width or max(len(r) for r in responses) + 3
    ids = torch.full((len(responses), width), GARBAGE)
    mask = torch.zeros(len(responses), width, dtype=torch.bool)
    for i, response in enumerate(responses):
        ids[i, :len(response)] = torch.tensor(response, dtype=torch.long)
        mask[i, :len(response)] = True
    finished = torch.ones(len(responses), dtype=torch.bool) if finished is None else finished
    return TensorDict({RESPONSE_IDS: ids, RESPONSE_MASK: mask,
                       FINISHED: torch.as_tensor(finished, dtype=torch.bool)},
                      batch_size=[len(responses)])


def of_lengths(*lengths, finished=None):
    return batch([list(range(1, n + 1)) for n in lengths], finished)


# --- length ---------------------------------------------------------------------------------

def test_band_zero_inside_linear_outside():
    reward = LengthPenalty(min_tokens=4, max_tokens=8, per_token=0.5, truncated_penalty=0.0)
    out = reward(of_lengths(0, 2, 4, 6, 8, 10, 13))
    assert out.dtype == torch.float32 and out.shape == (7,)
    assert out.tolist() == [-2.0, -1.0, 0.0, 0.0, 0.0, -1.0, -2.5]


def test_band_without_upper_bound_only_penalises_short():
    out = LengthPenalty(min_tokens=3, per_token=1.0, truncated_penalty=0.0)(of_lengths(1, 3, 50))
    assert out.tolist() == [-2.0, 0.0, 0.0]


def test_overlong_buffer_exact_values():
    reward = LengthPenalty(buffer=8, max_new_tokens=20, penalty=2.0, truncated_penalty=0.0)
    out = reward(of_lengths(5, 12, 13, 14, 16, 19, 20))
    assert out.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.75, -2.0]


def test_overlong_budget_comes_from_run_context():
    reward = LengthPenalty(buffer=4, truncated_penalty=0.0, ctx=RunContext(max_new_tokens=10))
    assert reward(of_lengths(6, 8, 10)).tolist() == [0.0, -0.5, -1.0]
    explicit = LengthPenalty(buffer=4, max_new_tokens=8, truncated_penalty=0.0,
                             ctx=RunContext(max_new_tokens=10))
    assert explicit(of_lengths(6, 8)).tolist() == [-0.5, -1.0]


def test_truncated_penalised_finished_not():
    out = LengthPenalty(truncated_penalty=0.3)(of_lengths(5, 5, finished=[True, False]))
    assert out.tolist() == pytest.approx([0.0, -0.3])
    assert out[0].item() == 0.0 and not out[0].signbit()  # +0.0, not -0.0


def test_terms_add_up():
    reward = LengthPenalty(max_tokens=10, per_token=0.25, buffer=4, max_new_tokens=16,
                           truncated_penalty=1.0)
    out = reward(of_lengths(8, 14, 16, finished=[True, True, False]))
    assert out.tolist() == [0.0, -1.0 - 0.5, -1.5 - 1.0 - 1.0]


def test_length_ignores_garbage_after_mask():
    td = of_lengths(3, 9)
    expected = LengthPenalty(max_tokens=4, per_token=0.5)(td)
    td[RESPONSE_IDS][:] = 12345
    assert torch.equal(LengthPenalty(max_tokens=4, per_token=0.5)(td), expected)


@pytest.mark.parametrize("kwargs", [
    dict(min_tokens=-1),
    dict(min_tokens=5, max_tokens=3),
    dict(per_token=-0.1),
    dict(buffer=-2),
    dict(penalty=-1.0),
    dict(truncated_penalty=-1.0),
    dict(buffer=4),  # no budget anywhere
    dict(buffer=4, ctx=RunContext()),  # a context without a budget
    dict(buffer=30, max_new_tokens=20),
    dict(max_new_tokens=0),
    dict(truncated_penalty=0.0),  # every term off
    dict(min_tokens="3"),
])
def test_length_bad_args(kwargs):
    with pytest.raises(UserError, match="^length: "):
        LengthPenalty(**kwargs)


# --- loop -----------------------------------------------------------------------------------

def test_no_repetition_is_exactly_zero():
    out = LoopPenalty()(batch([list(range(10, 40)), [1, 2], [], [3]]))
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert not out.signbit().any()


@pytest.mark.parametrize("response", [
    [5, 6, 7] * 6,                 # one phrase repeated to the end
    [5, 6, 7, 8] * 4 + [5, 6],     # ... cut mid-phrase by max_new_tokens
    [9] * 12,                      # one token
])
def test_full_loop_is_full_penalty(response):
    assert LoopPenalty(penalty=1.5)(batch([response])).tolist() == [-1.5]


def test_partial_repetition_in_between():
    # one repeated 3-gram among 11: repeat fraction 1/11; the tail repeats too few times
    out = LoopPenalty()(batch([list(range(1, 11)) + [1, 2, 3]]))
    assert out.item() == pytest.approx(-1 / 11)


def test_loop_after_preamble_counts_covered_share():
    response = [1, 2, 3, 4] + [20, 21] * 6  # 16 tokens, the last 12 periodic
    assert tail_fraction(torch.tensor(response)) == 0.75
    assert repeat_fraction(torch.tensor(response)) == pytest.approx(8 / 14)
    assert LoopPenalty()(batch([response])).item() == pytest.approx(-0.75)
    assert LoopPenalty(tail=False)(batch([response])).item() == pytest.approx(-8 / 14)


def test_tail_needs_min_repeats_and_max_period():
    twice = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4])
    assert tail_fraction(twice, min_repeats=3) == 0.0
    assert tail_fraction(twice, min_repeats=2) == 1.0
    assert tail_fraction(twice, max_period=3, min_repeats=2) == 0.0


def test_ngram_size():
    tokens = torch.tensor([1, 2, 3, 1, 2, 4])
    assert repeat_fraction(tokens, n=2) == pytest.approx(1 / 5)
    assert repeat_fraction(tokens, n=3) == 0.0


def test_loop_ignores_garbage_after_mask():
    responses = [[1, 2, 3, 4, 5], [5, 6, 5, 6, 5, 6, 5], [1, 2, 1, 2, 8, 9, 10]]
    clean = LoopPenalty()(batch(responses, width=12))
    garbage = batch(responses, width=12)
    garbage[RESPONSE_IDS][~garbage[RESPONSE_MASK]] = 5  # would extend the loops if read
    assert torch.equal(LoopPenalty()(garbage), clean)
    assert clean[0].item() == 0.0 and clean[1].item() == -1.0


@pytest.mark.parametrize("kwargs", [
    dict(n=0), dict(n=2.5), dict(penalty=0.0), dict(penalty=-1.0), dict(penalty="high"),
    dict(tail="yes"), dict(max_period=0), dict(min_repeats=1),
])
def test_loop_bad_args(kwargs):
    with pytest.raises(UserError, match="^loop: "):
        LoopPenalty(**kwargs)


def naive_tail_fraction(tokens, max_period, min_repeats):
    best = 0
    for p in range(1, max_period + 1):
        k = p
        while k < len(tokens) and tokens[-k - 1] == tokens[-k - 1 + p]:
            k += 1
        if k <= len(tokens) and k >= min_repeats * p:
            best = max(best, k)
    return best / len(tokens) if tokens else 0.0


def test_tail_fraction_matches_naive_loop():
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        length = int(torch.randint(0, 30, (1,), generator=generator))
        tokens = torch.randint(0, 3, (length,), generator=generator)
        for max_period, min_repeats in [(64, 3), (4, 2)]:
            expected = naive_tail_fraction(tokens.tolist(), max_period, min_repeats)
            assert tail_fraction(tokens, max_period, min_repeats) == expected
