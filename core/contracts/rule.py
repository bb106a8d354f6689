"""What a health rule is, and the metric history it reads.

A rule is a dataclass subclassing `Rule`: its fields are its parameters (each with a default and a
range, ``num(5, ">= 1")``, so ``health.rules.<rule>.<param>`` is checked like any config key),
and it declares ``reads`` (the metrics it looks at; it must stay quiet when they are absent),
``panel`` (the ``rlpipe report`` plot that shows them) and ``remedy`` (one line naming the
config keys that address it). ``check(history)`` returns what it saw at the newest step, one
line with the numbers, or None.

>>> from dataclasses import dataclass
>>> from rlpipe.core.base.yamlconf import num
>>> @dataclass
... class LowReward(Rule):
...     threshold: float = num(0.0, "<= 100")
...     reads, panel, remedy = ("reward/score",), "reward", "check the reward plugins (rewards)"
...     def check(self, h):
...         score = h.last("reward/score", 1)
...         return f"reward/score {score[0]:.3g} < {self.threshold:g}" if score and score[0] < self.threshold else None
>>> h = History([{"step": 1, "reward/score": -2.0}])
>>> LowReward().check(h), LowReward().check(History([{"step": 1}]))
('reward/score -2 < 0', None)
"""

from __future__ import annotations

import math
from typing import Sequence


def finite(value) -> bool:
    """A metric value a rule may use: an int or float (not a bool) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class History:
    """The metric rows of a run, one dict per step, oldest first; a rule sees the rows up to
    ``end`` (the newest step it judges). Reads look at a few rows, never the whole run, so a
    check costs the same at step 10 and step 100000.

    >>> h = History([{"step": 1, "a": 1.0}, {"step": 2, "a": float("nan")}, {"step": 3, "a": 3.0}])
    >>> h.step, h.last("a", 2), h.first("a", 5), h.last("b", 3)
    (3, [3.0], [1.0, 3.0], [])
    """

    def __init__(self, rows: Sequence[dict], end: int | None = None):
        self.rows = rows
        self.end = len(rows) if end is None else end

    @property
    def step(self) -> int:
        """The step being judged."""
        return int(self.rows[self.end - 1]["step"])

    @property
    def latest(self) -> dict:
        return self.rows[self.end - 1]

    def last(self, key: str, n: int) -> list[float]:
        """The finite values of ``key`` in the newest ``n`` rows, oldest first."""
        return [float(r[key]) for r in self.rows[max(0, self.end - n):self.end]
                if finite(r.get(key))]

    def first(self, key: str, n: int) -> list[float]:
        """The first ``n`` finite values of ``key`` in the run (its starting level)."""
        out = []
        for row in self.rows[:self.end]:
            if finite(row.get(key)):
                out.append(float(row[key]))
                if len(out) == n:
                    break
        return out

    def names(self, prefix: str) -> list[str]:
        """The metrics of the judged step whose names start with ``prefix``."""
        return [k for k in self.latest if k.startswith(prefix)]


class Rule:
    """Base class of health rules (see the module docstring). Subclasses are dataclasses."""

    reads: tuple[str, ...] = ()  # metrics read; a prefix ending in "/" means every such metric
    panel: str = ""              # the report panel that shows them
    remedy: str = ""             # one line: the usual causes and the config keys that address them

    def check(self, history: History) -> str | None:
        raise NotImplementedError


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def halves(values: Sequence[float]) -> tuple[float, float]:
    """Means of the older and the newer half of ``values`` (the middle one, if odd, left out).

    >>> halves([1.0, 2.0, 9.0, 3.0, 5.0])
    (1.5, 4.0)
    """
    k = len(values) // 2
    return mean(values[:k]), mean(values[len(values) - k:])


def slope(values: Sequence[float]) -> float:
    """Least-squares change per step of ``values`` (one per step, at least two).

    >>> slope([1.0, 3.0, 5.0]), slope([2.0, 2.0])
    (2.0, 0.0)
    """
    n = len(values)
    x_mean, y_mean = (n - 1) / 2, mean(values)
    num = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    return num / sum((i - x_mean) ** 2 for i in range(n))
