"""Repetition ("loop") penalty: repeated n-grams, and a span repeating itself to the end.

Each response gets ``-penalty * max(repeat_fraction, tail_fraction)``:

- ``repeat_fraction``: the share of the response's token n-grams that repeat an earlier one,
  ``1 - unique / total`` (0 when no n-gram repeats);
- ``tail_fraction`` (the tail-loop detector, ``tail: true``): the share of the response covered
  by its periodic tail, the longest suffix that repeats one span of at most ``max_period``
  tokens at least ``min_repeats`` times (0 when there is none).

No repetition gives exactly 0; a response that is one phrase repeated to the end (the classic
"same sentence until max length" failure) gives exactly ``-penalty``. Only tokens under
``response_mask`` count. Config keys: ``n`` (3), ``penalty`` (1.0), ``tail`` (true),
``max_period`` (64), ``min_repeats`` (3).

>>> import torch
>>> ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 7, 8, 7, 8]])
>>> loop_penalty(ids, torch.ones_like(ids, dtype=torch.bool))
tensor([ 0., -1.])
"""

import torch
from torch import nn

from rlpipe.plugin import RESPONSE_IDS, RESPONSE_MASK, RewardContract, UserError


def repeat_fraction(tokens: torch.Tensor, n: int = 3) -> float:
    """Share of the n-grams of 1-D ``tokens`` that repeat an earlier one: ``1 - unique/total``.

    >>> repeat_fraction(torch.tensor([1, 2, 3, 1, 2, 3]), n=3)
    0.25
    """
    if tokens.numel() < n:
        return 0.0
    ngrams = tokens.unfold(0, n, 1)
    return 1.0 - len(torch.unique(ngrams, dim=0)) / len(ngrams)


def tail_fraction(tokens: torch.Tensor, max_period: int = 64, min_repeats: int = 3) -> float:
    """Share of 1-D ``tokens`` covered by a periodic tail: the longest suffix with some period
    ``p <= max_period`` (token ``i`` equals token ``i - p``) spanning ``>= min_repeats * p``
    tokens. The whole response counts when it is one span repeated (the last copy may be cut).

    >>> tail_fraction(torch.tensor([9, 9, 1, 2, 1, 2, 1, 2, 1]))
    0.7777777777777778
    """
    length = tokens.numel()
    max_period = min(max_period, length // min_repeats)
    if max_period == 0:
        return 0.0
    backward = tokens.flip(0)  # backward[j] is the j-th token from the end
    padded = torch.cat([backward, backward.new_full((max_period,), -1)])  # -1: never a token id
    earlier = padded.unfold(0, length, 1)[1:]  # [P, L] view: earlier[p - 1, j] = backward[j + p]
    # the first mismatch from the end (the -1 padding guarantees one) is the periodic run
    run = (earlier != backward).byte().argmax(dim=1)
    periods = torch.arange(1, max_period + 1)
    covered = run + periods  # periodic suffix length for each period
    covered = torch.where(covered >= min_repeats * periods, covered, 0)
    return covered.max().item() / length


def loop_penalty(ids: torch.Tensor, mask: torch.Tensor, *, n: int = 3, penalty: float = 1.0,
                 tail: bool = True, max_period: int = 64, min_repeats: int = 3) -> torch.Tensor:
    """Loop penalty of each response of a batch (see the module docstring).

    Args:
        ids: [B, R] response token ids.
        mask: [B, R] bool, true on real tokens; ids elsewhere are ignored.

    Returns:
        [B] float32 on ``ids.device``, in ``[-penalty, 0]``.

    >>> loop_penalty(torch.tensor([[5, 5, 5, 5, 0]]), torch.tensor([[1, 1, 1, 1, 0]]).bool(),
    ...              penalty=0.5)
    tensor([-0.5000])
    """
    fractions = []
    for row, row_mask in zip(ids.cpu(), mask.cpu().bool()):
        tokens = row[row_mask]
        fraction = repeat_fraction(tokens, n)
        if tail:
            fraction = max(fraction, tail_fraction(tokens, max_period, min_repeats))
        fractions.append(fraction)
    fractions = torch.tensor(fractions, dtype=torch.float32, device=ids.device)
    return 0.0 - penalty * fractions  # not -(...): no repetition reads +0.0, not -0.0


class LoopPenalty(nn.Module):
    """Loop penalty reward component: ``-penalty`` times the larger of the share of repeated
    n-grams and the share of the response inside a loop at its end, so 0 without repetition
    and ``-penalty`` for a response that loops to its end; reads ``response_ids`` and
    ``response_mask``, returns [B].

    Args:
        n: n-gram length of the repeated-n-gram fraction
        penalty: a response that loops to its end gets -penalty
        tail: also detect a span repeating itself to the end
        max_period: longest repeating span the tail detector looks for, in tokens
        min_repeats: repeats of a span at the end that count as a loop

    >>> from tensordict import TensorDict
    >>> td = TensorDict({RESPONSE_IDS: torch.tensor([[1, 2, 1, 2, 1, 2]]),
    ...                  RESPONSE_MASK: torch.ones(1, 6, dtype=torch.bool)}, batch_size=[1])
    >>> LoopPenalty(penalty=2.0)(td)
    tensor([-2.])
    """

    in_keys = [RESPONSE_IDS, RESPONSE_MASK]

    @classmethod
    def contract(cls, **args) -> RewardContract:
        """No dataset column; a prefix's loops are not the finished response's."""
        return RewardContract()

    def __init__(self, *, n: int = 3, penalty: float = 1.0, tail: bool = True,
                 max_period: int = 64, min_repeats: int = 3):
        super().__init__()
        rules = [
            (isinstance(n, int) and n >= 1, f"n must be an integer >= 1, got {n!r}"),
            (isinstance(penalty, (int, float)) and penalty > 0,
             f"penalty must be a number > 0, got {penalty!r}"),
            (isinstance(tail, bool), f"tail must be true or false, got {tail!r}"),
            (isinstance(max_period, int) and max_period >= 1,
             f"max_period must be an integer >= 1, got {max_period!r}"),
            (isinstance(min_repeats, int) and min_repeats >= 2,
             f"min_repeats must be an integer >= 2, got {min_repeats!r}"),
        ]
        errors = [message for ok, message in rules if not ok]
        if errors:
            raise UserError("loop: " + "; ".join(errors))
        self.config = dict(n=n, penalty=penalty, tail=tail, max_period=max_period,
                           min_repeats=min_repeats)

    def forward(self, td) -> torch.Tensor:
        return loop_penalty(td.get(RESPONSE_IDS), td.get(RESPONSE_MASK), **self.config)
