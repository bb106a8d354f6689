"""Engine log-probs from HF `generate` and truncation-aware scoring (core/base/truncation.py): the kept
set equals transformers' own top-k/top-p warpers and a float64 loop, and the trainer's truncated
log-probs equal the probabilities `generate` actually sampled from."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from rlpipe.core.base import schema as S
from rlpipe.core.base.context import RunContext
from rlpipe.core.models.lm import response_logprobs
from rlpipe.core.base.truncation import Truncation, keep_mask, truncated_log_prob
from rlpipe.plugins.collectors.hf import HFCollector

PROMPTS = ["the cat sat on the mat", "hello", "big red dog", "one"]
INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)


def oracle(logits: list[float], token: int, top_k: int, top_p: float) -> float:
    """float64 loop: keep the top-k (ties kept), then the smallest prefix of the rest, largest
    first, whose mass reaches top_p; the token always kept; log of its renormalised mass."""
    kept = set(range(len(logits)))
    if top_k > 0:
        kth = sorted(logits, reverse=True)[min(top_k, len(logits)) - 1]
        kept = {i for i in kept if logits[i] >= kth}
    if top_p < 1:
        z = sum(math.exp(logits[i]) for i in kept)
        ascending = sorted(kept, key=lambda i: logits[i])
        cumulative, dropped = 0.0, set()
        for i in ascending[:-1]:
            cumulative += math.exp(logits[i]) / z
            if cumulative <= 1 - top_p:
                dropped.add(i)
        kept -= dropped
    kept.add(token)
    return logits[token] - math.log(sum(math.exp(logits[i]) for i in kept))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.6), (8, 0.9), (1, 1.0)])
def test_truncated_log_prob_equals_a_float64_loop_and_transformers_warpers(top_k, top_p):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(6, 20, generator=g).double() * 2
    logits[0, :4] = 1.5                                    # ties at the boundary
    tokens = torch.randint(0, 20, (6,), generator=g)
    got = truncated_log_prob(logits, tokens, top_k, top_p)
    expected = [oracle(row.tolist(), int(t), top_k, top_p) for row, t in zip(logits, tokens)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    warped = logits.float()
    if top_k:
        warped = TopKLogitsWarper(top_k=top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p=top_p)(None, warped)
    assert torch.equal(keep_mask(logits.float(), top_k, top_p), torch.isfinite(warped))
    if top_k == 0 and top_p == 1:
        torch.testing.assert_close(got, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0])


def test_gradient_flows_through_the_kept_tokens_only():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]], requires_grad=True)
    truncated_log_prob(logits, torch.tensor([1]), top_k=2).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2:].eq(0).all()
    assert logits.grad[0, :2].ne(0).all()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.0, 0, 1.0),
                                                       (1.0, 5, 1.0), (0.8, 0, 0.7), (1.3, 6, 0.8)])
def test_hf_engine_log_probs_are_what_generate_sampled_from(ctx, temperature, top_k, top_p):
    """The HF collector reports the log-probs of the distribution it drew from (0 on padding),
    and the trainer's truncation-aware scoring reproduces them; the untruncated scoring does
    not. (That the draw follows that distribution: tests/test_hf_collector.py.)"""
    kwargs = dict(max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, n=3,
                  micro_batch_size=2)
    torch.manual_seed(5)
    batch = HFCollector(ctx, **kwargs, score_truncated=True).collect(PROMPTS)
    mask = batch[S.RESPONSE_MASK]
    assert batch[S.ENGINE_LOG_PROB][~mask].eq(0).all() and batch[S.ENGINE_LOG_PROB][mask].lt(0).any()
    inputs = [batch[k] for k in INPUTS]
    truncation = Truncation(top_k, top_p) if temperature > 0 else None
    scored, _ = response_logprobs(ctx.actor, *inputs, temperature, truncation=truncation)
    assert (scored - batch[S.ENGINE_LOG_PROB])[mask].abs().max() < 1e-5
    full, _ = response_logprobs(ctx.actor, *inputs, temperature)
    truncated = temperature > 0 and (top_k > 0 or top_p < 1)
    assert ((full - batch[S.ENGINE_LOG_PROB])[mask].abs().mean() > 1e-2) == truncated
