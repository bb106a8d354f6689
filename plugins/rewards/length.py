"""Rule-based length penalty: a target band, a DAPO overlong buffer and a missing-EOS penalty.

The three terms are independent and add up; each is <= 0. All are off until configured,
except the missing-EOS penalty (``truncated_penalty: 1.0``). Config keys:

- band: ``min_tokens`` (0), ``max_tokens`` (None: no upper bound), ``per_token`` (0.01):
  0 inside ``[min_tokens, max_tokens]``, ``-per_token`` per token outside it;
- DAPO overlong buffer: ``buffer`` (0: off), ``penalty`` (1.0), ``max_new_tokens`` (None: the
  collector's, ``ctx.max_new_tokens``): 0 up to ``max_new_tokens - buffer`` tokens, then
  linear down to ``-penalty`` at ``max_new_tokens``;
- missing EOS: ``truncated_penalty`` (1.0) is subtracted where ``finished`` is false.

>>> import torch
>>> length_penalty(torch.tensor([4, 12, 16]), torch.tensor([True, True, False]),
...                buffer=8, max_new_tokens=16, truncated_penalty=0.5)
tensor([ 0.0000, -0.5000, -1.5000])
"""

import torch
from torch import nn

from rlpipe.plugin import FINISHED, RESPONSE_MASK, RewardContract, RunContext, UserError


def length_penalty(lengths: torch.Tensor, finished: torch.Tensor, *, min_tokens: int = 0,
                   max_tokens: int | None = None, per_token: float = 0.01, buffer: int = 0,
                   penalty: float = 1.0, max_new_tokens: int | None = None,
                   truncated_penalty: float = 1.0) -> torch.Tensor:
    """Sum of the band, overlong-buffer and missing-EOS penalties for each response.

    Args:
        lengths: [B] response lengths in tokens.
        finished: [B] bool, true where the response ended with EOS.
        The keyword arguments are the config keys of the module docstring; ``max_new_tokens``
        is needed only when ``buffer > 0``.

    Returns:
        [B] float32 tensor, every entry <= 0.

    >>> length_penalty(torch.tensor([2, 5, 9]), torch.tensor([True] * 3),
    ...                min_tokens=4, max_tokens=6, per_token=0.5)
    tensor([-1.0000,  0.0000, -1.5000])
    """
    lengths = lengths.float()
    upper = float("inf") if max_tokens is None else max_tokens
    cost = per_token * ((min_tokens - lengths).clamp(min=0) + (lengths - upper).clamp(min=0))
    if buffer > 0:
        cost = cost + penalty * (lengths - (max_new_tokens - buffer)).clamp(0, buffer) / buffer
    cost = cost + truncated_penalty * (~finished.bool()).float()
    return 0.0 - cost  # not -cost: no penalty reads +0.0, not -0.0


class LengthPenalty(nn.Module):
    """Length penalty reward component: reads ``response_mask`` and ``finished``, returns [B].

    Args:
        min_tokens: band start: per_token per token below it
        max_tokens: band end: per_token per token above it (null: none)
        per_token: penalty per token outside the band
        buffer: DAPO overlong buffer: tokens before max_new_tokens where the penalty ramps up to penalty (0: off)
        penalty: the overlong buffer's full penalty
        max_new_tokens: the budget the buffer ends at (null: the collector's)
        truncated_penalty: penalty for a response cut without EOS

    >>> from tensordict import TensorDict
    >>> td = TensorDict({RESPONSE_MASK: torch.tensor([[1, 1, 0], [1, 1, 1]]).bool(),
    ...                  FINISHED: torch.tensor([True, False])}, batch_size=[2])
    >>> LengthPenalty(max_tokens=2, per_token=0.25)(td)
    tensor([ 0.0000, -1.2500])
    """

    in_keys = [RESPONSE_MASK, FINISHED]

    @classmethod
    def contract(cls, **args) -> RewardContract:
        """No dataset column; a prefix's length says nothing of the finished response's."""
        return RewardContract()

    def __init__(self, *, min_tokens: int = 0, max_tokens: int | None = None,
                 per_token: float = 0.01, buffer: int = 0, penalty: float = 1.0,
                 max_new_tokens: int | None = None, truncated_penalty: float = 1.0,
                 ctx: RunContext | None = None):
        super().__init__()
        if max_new_tokens is None and ctx is not None and ctx.max_new_tokens:
            max_new_tokens = ctx.max_new_tokens
        self.config = dict(min_tokens=min_tokens, max_tokens=max_tokens, per_token=per_token,
                           buffer=buffer, penalty=penalty, max_new_tokens=max_new_tokens,
                           truncated_penalty=truncated_penalty)
        _validate(**self.config)

    def forward(self, td) -> torch.Tensor:
        mask = td.get(RESPONSE_MASK)
        return length_penalty(mask.sum(-1), td.get(FINISHED), **self.config)


def _validate(min_tokens, max_tokens, per_token, buffer, penalty, max_new_tokens,
              truncated_penalty) -> None:
    """Raise `UserError` on a non-number, a negative value, an empty band, a buffer without
    (or wider than) a budget, or every term off.

    >>> _validate(0, None, 0.01, 0, 1.0, None, 1.0)
    """
    try:
        rules = [
            (min_tokens >= 0, f"min_tokens must be >= 0, got {min_tokens}"),
            (max_tokens is None or max_tokens >= min_tokens,
             f"max_tokens ({max_tokens}) must be >= min_tokens ({min_tokens})"),
            (per_token >= 0, f"per_token must be >= 0, got {per_token}"),
            (buffer >= 0, f"buffer must be >= 0, got {buffer}"),
            (penalty >= 0, f"penalty must be >= 0, got {penalty}"),
            (truncated_penalty >= 0, f"truncated_penalty must be >= 0, got {truncated_penalty}"),
            (max_new_tokens is None or max_new_tokens > 0,
             f"max_new_tokens must be > 0, got {max_new_tokens}"),
            (buffer <= 0 or max_new_tokens is not None,
             "buffer needs max_new_tokens (set it, or use a collector that has one)"),
            (max_new_tokens is None or buffer <= max_new_tokens,
             f"buffer ({buffer}) must be <= max_new_tokens ({max_new_tokens})"),
        ]
        band_on = per_token > 0 and (min_tokens > 0 or max_tokens is not None)
        any_on = band_on or (buffer > 0 and penalty > 0) or truncated_penalty > 0
    except TypeError as err:
        raise UserError(f"length: every setting must be a number ({err})") from None
    errors = [message for ok, message in rules if not ok]
    if not errors and not any_on:
        errors.append("every term is off: set min_tokens/max_tokens, buffer, or truncated_penalty")
    if errors:
        raise UserError("length: " + "; ".join(errors))
