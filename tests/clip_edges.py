"""Clip fractions of two float32 computations of one update: which tokens may differ.

A clip fraction counts tokens past a hard edge; two computations of the same update (1 and 2
processes, 1 and 3 micro-batches, shared prefix on and off) differ by reduction-order round-off,
which can move a token across the edge only if it lies within that round-off of the edge. The
log-ratio ``log(pi / pi_old)`` is the difference of two float32 log-probs, each a log-softmax over
the vocabulary (n = 1000 terms, the longest reduction in either forward of the tiny model), each
within ``n * u`` of its exact value (u = 2^-24): the difference is within ``EDGE = 2 n u``
(1.2e-4). A value delta ``v - v_old`` is within ``EDGE * (1 + |v| + |v_old|)`` likewise. Measured
on the tiny example (1 process padded against 2 packed, AVX-512): log-ratios differ by at most
40 u, value deltas by 1.5 u, far inside these bounds. Two computations' clip fractions then differ
by at most ``min(edge tokens of either) / tokens``, and `tolerance` says so.

>>> import torch
>>> edges(torch.tensor([0.0, math.log(1.2) + 1e-5, math.log(0.8) - 1e-3]), 0.2, 0.2).tolist()
[False, True, False]
"""

import math

import torch

from rlpipe.plugins.losses import ppo

EDGE = 2 * 1000 * 2.0 ** -24
FRACTIONS = ("policy/clipfrac", "value/clipfrac")


def edges(log_ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Tokens whose log-ratio lies within `EDGE` of ``log(1 - clip_low)`` or
    ``log(1 + clip_high)``."""
    return (((log_ratio - math.log1p(-clip_low)).abs() <= EDGE)
            | ((log_ratio - math.log1p(clip_high)).abs() <= EDGE))


def value_edges(value: torch.Tensor, old: torch.Tensor, value_clip: float) -> torch.Tensor:
    """Tokens whose ``|v - v_old|`` lies within round-off (`EDGE` scaled) of ``value_clip``."""
    return ((value - old).abs() - value_clip).abs() <= EDGE * (1 + value.abs() + old.abs())


def count_edges(monkeypatch) -> dict[str, int]:
    """``{clip fraction: edge tokens}``, counted from now on in this process as PPO's losses run
    (padding included: it can only add to the count)."""
    counts = dict.fromkeys(FRACTIONS, 0)
    policy, value = ppo.ppo_policy_loss, ppo.ppo_value_loss

    def policy_edges(log_prob, old_log_prob, advantage, *, clip_low, clip_high, **kw):
        near = edges((log_prob - old_log_prob).detach(), clip_low, clip_high)
        counts["policy/clipfrac"] += int(near.sum())
        return policy(log_prob, old_log_prob, advantage, clip_low=clip_low, clip_high=clip_high,
                      **kw)

    def value_edges_(value_pred, old_value, value_target, *, value_clip=0.2, **kw):
        if value_clip is not None:
            near = value_edges(value_pred.detach(), old_value.detach(), value_clip)
            counts["value/clipfrac"] += int(near.sum())
        return value(value_pred, old_value, value_target, value_clip=value_clip, **kw)

    monkeypatch.setattr(ppo, "ppo_policy_loss", policy_edges)
    monkeypatch.setattr(ppo, "ppo_value_loss", value_edges_)
    return counts


def counted(counts: dict[str, int], fn, *args):
    """``(fn(*args), {clip fraction: edge tokens counted while it ran})`` (``counts`` from
    `count_edges`)."""
    before = dict(counts)
    out = fn(*args)
    return out, {k: counts[k] - before[k] for k in counts}


def tolerance(key: str, a: dict[str, int], b: dict[str, int], tokens: float) -> float:
    """How far two runs' ``key`` (a clip fraction over ``tokens`` token passes) may differ: a
    token that flips lies within round-off of the edge in both runs (edge counts ``a``, ``b``)."""
    return min(a[key], b[key]) / tokens
