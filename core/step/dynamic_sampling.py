"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2): a group whose samples all scored the same
has a group-relative advantage of 0 and teaches nothing, so it is dropped, and more prompts are
collected until the step holds ``data.batch_size`` groups that do carry a signal
(``data.dynamic_sampling``: ``enabled``, ``max_rounds`` extra collection rounds at most; then the
batch is topped up with flat groups, oldest first, so that every step has the same size).
The extra rounds of a step also stop after `MAX_SECONDS`; a collection that goes on says how far
it got every `PROGRESS_S` seconds, and a cap that is hit says so (a constant reward makes every
group flat: without the line, a large ``max_rounds`` collects for hours in silence).

`GroupFilter` takes the scored rounds one by one and returns the step's batch:

>>> import torch
>>> from tensordict import TensorDict
>>> def round_(scores):  # groups of two samples
...     s = torch.tensor(scores)
...     return TensorDict({S.SCORE: s, S.GROUP_ID: torch.arange(len(s)) // 2,
...                        S.RESPONSE_IDS: torch.zeros(len(s), 3, dtype=torch.long)}, [len(s)])
>>> f = GroupFilter(groups=2, max_rounds=3)
>>> f.add(round_([1.0, 1.0, 0.0, 1.0]))   # group 0 flat, group 1 kept: not full yet
True
>>> f.add(round_([0.0, 2.0, 5.0, 5.0]))   # one more kept group: full
False
>>> batch, metrics = f.result()
>>> batch[S.SCORE].tolist(), batch[S.GROUP_ID].tolist(), metrics
([0.0, 1.0, 0.0, 2.0], [0, 0, 1, 1], {'data/dropped_groups': 2, 'data/extra_rounds': 1, 'data/flat_groups_trained': 0, 'data/flat_frac': 0.5})
"""

from __future__ import annotations

import sys
import time

import torch
from tensordict import TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.observe.samples import flat_groups

_PROMPT_KEYS = (S.PROMPT_IDS, S.PROMPT_MASK)
MAX_SECONDS = 900.0   # the extra rounds of one step stop after this long (then topped up)
PROGRESS_S = 30.0     # a long collection says how far it got this often
_SAID: set[str] = set()  # the rounds cap is said once per process (the metrics say the rest)


class GroupFilter:
    """The groups of the rounds of one step: those with a reward signal, and the flat ones.

    Args:
        groups: the groups a step trains on (``data.batch_size``).
        max_rounds: extra rounds at most after the first.
        max_seconds: extra rounds stop once the step's collection took this long (default
            `MAX_SECONDS`).
        dist: the run's `Dist`: every rank agrees on the time cap, the main one prints.
    """

    def __init__(self, groups: int, max_rounds: int, max_seconds: float | None = None,
                 dist=None):
        self.groups, self.max_rounds, self.dist = groups, max_rounds, dist
        self.max_seconds = MAX_SECONDS if max_seconds is None else max_seconds
        self.kept: list[TensorDict] = []   # per round, the samples of its groups with a signal
        self.flat: list[TensorDict] = []   # per round, the samples of its flat groups
        self.n_kept = self.n_flat = self.rounds = 0
        self.start = self.said = time.monotonic()

    def add(self, batch: TensorDict) -> bool:
        """Sort one scored round's groups; True while another round is wanted (not full, and
        neither cap, extra rounds or time, reached)."""
        batch = batch.clone(False)  # the group ids are renumbered on a copy
        _, member = torch.unique(batch[S.GROUP_ID], return_inverse=True)
        batch[S.GROUP_ID] = member + self._next_id()
        flat, _ = flat_groups(batch[S.SCORE], batch[S.GROUP_ID])
        for rows, parts in ((~flat, self.kept), (flat, self.flat)):
            if rows.any():   # (a TensorDict of texts cannot take an all-false mask)
                parts.append(batch[rows.nonzero().squeeze(1).to(batch.device)])
        self.n_kept, self.n_flat = _count_groups(self.kept), _count_groups(self.flat)
        self.rounds += 1
        if self.n_kept >= self.groups:
            return False
        if self.rounds > self.max_rounds:
            if "rounds" not in _SAID:
                _SAID.add("rounds")
                self._say(f"the cap of data.dynamic_sampling.max_rounds ({self.max_rounds}) "
                          f"(said once)")
            return False
        elapsed = time.monotonic() - self.start
        if self._agreed(elapsed > self.max_seconds):
            self._say(f"the cap of {self.max_seconds:.0f} s of collection per step")
            return False
        if time.monotonic() - self.said >= PROGRESS_S:
            self.said = time.monotonic()
            self._print(f"rlpipe: dynamic sampling: {self.n_kept} of {self.groups} groups with a "
                        f"reward signal after {self.rounds} rounds ({elapsed:.0f} s; "
                        f"{self.n_flat} flat groups dropped), collecting again")
        return True

    def _agreed(self, flag: bool) -> bool:
        """``flag`` on any rank (the time cap: each rank's clock differs)."""
        if self.dist is not None and self.dist.enabled:
            return self.dist.mean({"over": float(flag)})["over"] > 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return False   # no `dist` to agree with: the rounds cap alone
        return flag

    def _say(self, cap: str) -> None:
        self._print(f"warning: dynamic sampling stopped at {cap}: {self.n_kept} of "
                    f"{self.groups} groups had a reward signal after {self.rounds - 1} extra "
                    f"rounds; the step is topped up with flat groups (samples that all scored "
                    f"the same: is the reward constant?)")

    def _print(self, line: str) -> None:
        if self.dist is None or self.dist.is_main:
            print(line, file=sys.stderr, flush=True)

    def _next_id(self) -> int:
        """The first group id not used by an earlier round."""
        return max((int(td[S.GROUP_ID].max()) + 1 for td in self.kept + self.flat), default=0)

    def result(self) -> tuple[TensorDict, dict]:
        """The step's batch, ``groups`` groups (those with a signal first, in the order they were
        collected; flat ones only past the cap), and the ``data/*`` metrics."""
        kept = [_first_groups(concat_rounds(self.kept), self.groups)] if self.kept else []
        short = self.groups - _count_groups(kept)
        topped = [_first_groups(concat_rounds(self.flat), short)] if short > 0 and self.flat else []
        batch = concat_rounds(kept + topped)
        used_flat = _count_groups(topped)
        batch[S.GROUP_ID] = torch.unique(batch[S.GROUP_ID], return_inverse=True)[1]  # 0, 1, ...
        metrics = {"data/dropped_groups": self.n_kept + self.n_flat - _count_groups([batch]),
                   "data/extra_rounds": self.rounds - 1, "data/flat_groups_trained": used_flat,
                   "data/flat_frac": self.n_flat / max(1, self.n_kept + self.n_flat)}
        return batch, metrics


def _count_groups(parts: list[TensorDict]) -> int:
    """Groups in ``parts`` (their ids are distinct across parts)."""
    return sum(len(torch.unique(td[S.GROUP_ID])) for td in parts)


def _first_groups(td: TensorDict, k: int) -> TensorDict:
    """The samples of the ``k`` lowest group ids of ``td``."""
    ids = torch.unique(td[S.GROUP_ID])[:k]
    return td[torch.isin(td[S.GROUP_ID], ids)]


def concat_rounds(parts: list[TensorDict]) -> TensorDict:
    """Rounds stacked along the batch: prompt tensors left-padded, response tensors (width of the
    round's ``response_ids``) right-padded, to the widest round, with zeros (masks mark the real
    tokens)."""
    width_p = max((td[S.PROMPT_IDS].shape[1] for td in parts if S.PROMPT_IDS in td.keys()),
                  default=0)
    width_r = max(td[S.RESPONSE_IDS].shape[1] for td in parts)
    padded = []
    for td in parts:
        td, r = td.clone(False), td[S.RESPONSE_IDS].shape[1]
        for key in td.keys(include_nested=True, leaves_only=True):
            value = td.get(key)
            if not isinstance(value, torch.Tensor) or value.ndim < 2:
                continue
            if key in _PROMPT_KEYS:
                td.set(key, _pad_dim1(value, width_p - value.shape[1], left=True))
            elif value.shape[1] == r:
                td.set(key, _pad_dim1(value, width_r - r, left=False))
        padded.append(td)
    return torch.cat(padded) if len(padded) > 1 else padded[0]


def _pad_dim1(value: torch.Tensor, extra: int, left: bool) -> torch.Tensor:
    if extra <= 0:
        return value
    zeros = value.new_zeros((value.shape[0], extra, *value.shape[2:]))
    return torch.cat([zeros, value] if left else [value, zeros], dim=1)
