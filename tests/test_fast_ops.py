"""The update's and scoring's speed-ups change no result beyond float32 round-off:

- `token_logprobs` (chunked log-softmax + gather + entropy, its own backward) against autograd
  through ``log_softmax(...).gather(...)``: bit-identical log-probs, entropies and gradients
  (the same kernels row by row), and against a float64 oracle; the entropy gradient, which has
  its own formula, against float64 autograd.
- `trim_padding` in the forwards: a micro-batch with columns that are padding in every row
  gives the outputs and parameter gradients of the untrimmed forward (float64 models, so the
  comparison is exact up to float64 round-off).
- `grad_norm`: the float64 definition of the norm within its arithmetic bound (float64 sums of
  exact squares, then one float32 rounding: `norm_bound`), over many sizes and seeds, gradients
  untouched without clipping or under ``max_grad_norm``, and clipped by `clip_grad_norm_`'s
  factor otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.core.base import ops
from rlpipe.core.models.lm import ValueModel, logprobs_and_values, response_logprobs, response_values
from rlpipe.core.base.ops import pad_positions, token_logprobs, trim_padding
from rlpipe.core.step.update import grad_norm


def autograd_reference(logits, ids, start, temperature, entropy_grad):
    """The code token_logprobs replaced: slice, scale, log_softmax, gather; entropy as
    logsumexp - sum p x, all through autograd."""
    R = ids.shape[1]
    x = logits[:, start:start + R].float() / temperature
    logp = torch.log_softmax(x, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad):
        logz = torch.logsumexp(x, dim=-1, keepdim=True)
        entropy = logz.squeeze(-1) - (torch.exp(x - logz) * x).sum(-1)
    return logp, entropy


def float64_oracle(logits, ids, start, temperature):
    """Plain float64 formulas, written out: log p = x - max - log sum exp(x - max)."""
    R = ids.shape[1]
    x = logits[:, start:start + R].double() / temperature
    shifted = x - x.max(-1, keepdim=True).values
    logp_all = shifted - shifted.exp().sum(-1, keepdim=True).log()
    return logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.fixture(params=[(1.0, 1 << 22), (0.7, 1 << 22), (1.0, 300)], ids=["t1", "t0.7", "chunks"])
def setup(request, monkeypatch):
    temperature, chunk = request.param
    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", chunk)  # 300: 3 rows of 97 per chunk, ragged
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 97, generator=gen) * 4
    ids = torch.randint(97, (3, 7), generator=gen)
    return logits, ids, 1, temperature


def test_token_logprobs_is_bit_identical_to_log_softmax_gather(setup):
    logits, ids, start, temperature = setup
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want_logp, want_ent = autograd_reference(a, ids, start, temperature, entropy_grad=False)
    logp, ent = token_logprobs(b, ids, start, temperature, with_entropy=True)
    (want_logp * g).sum().backward()
    (logp * g).sum().backward()
    assert torch.equal(logp, want_logp) and torch.equal(ent, want_ent)
    assert torch.equal(b.grad, a.grad)
    assert not ent.requires_grad
    oracle_logp, oracle_ent = float64_oracle(logits, ids, start, temperature)
    torch.testing.assert_close(logp.double(), oracle_logp, rtol=1e-6, atol=1e-5)
    # log Z - sum p x subtracts two numbers of the size of the logits (~20 here): float32
    # round-off of that size, the same in the code it replaced
    torch.testing.assert_close(ent.double(), oracle_ent, rtol=1e-6, atol=1e-4)


def test_entropy_gradient_matches_float64_autograd(setup):
    logits, ids, start, temperature = setup
    gen = torch.Generator().manual_seed(2)
    g, h = torch.randn(ids.shape, generator=gen), torch.randn(ids.shape, generator=gen)
    ref = logits.double().requires_grad_()
    want_logp, want_ent = autograd_reference(ref, ids, start, temperature, entropy_grad=True)
    ((want_logp * g).sum() + (want_ent * h).sum()).backward()
    got = logits.clone().requires_grad_()
    logp, ent = token_logprobs(got, ids, start, temperature, with_entropy=True, entropy_grad=True)
    ((logp * g).sum() + (ent * h).sum()).backward()
    torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-5)


def test_bfloat16_logits_get_a_bfloat16_gradient_like_autograd():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 64, generator=gen) * 3).bfloat16()
    ids = torch.randint(64, (2, 4), generator=gen)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    autograd_reference(a, ids, 0, 1.0, False)[0].sum().backward()
    logp, _ = token_logprobs(b, ids, 0)
    logp.sum().backward()
    assert logp.dtype == torch.float32 and b.grad.dtype == torch.bfloat16
    assert torch.equal(b.grad, a.grad)


def double_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    return LlamaForCausalLM(config).double().eval()


def padded_inputs():
    """A micro-batch cut from a larger batch: 2 all-pad prompt columns on the left, 3 all-pad
    response columns on the right, and ragged rows inside."""
    prompt_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    gen = torch.Generator().manual_seed(4)
    prompt_ids = torch.where(prompt_mask, torch.randint(3, 40, (2, 5), generator=gen), 0)
    response_ids = torch.where(response_mask, torch.randint(3, 40, (2, 6), generator=gen), 0)
    return [prompt_ids, prompt_mask, response_ids, response_mask]


def untrimmed(model, critic, inputs):
    """The forward without trimming, written out: joined ids, cumsum positions, full logits
    (log-probs in float32, as rlpipe computes them from any model)."""
    prompt_ids, prompt_mask, response_ids, response_mask = inputs
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    R = response_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -(R + 1):-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    values = critic(input_ids=ids, attention_mask=mask, position_ids=pos)[:, -(R + 1):-1]
    return logp * response_mask, values * response_mask


def test_trim_padding_drops_only_all_padding_columns():
    trimmed = trim_padding(*padded_inputs())
    assert [tuple(x.shape) for x in trimmed] == [(2, 3), (2, 3), (2, 3), (2, 3)]
    assert trimmed[1].any(0).all() and trimmed[3].any(0).all()
    assert pad_positions(torch.ones(2, 3), 6)[:, 3:].abs().sum() == 0


@pytest.mark.parametrize("shared", [False, True], ids=["critic", "shared-backbone"])
def test_trimmed_forward_matches_the_untrimmed_one(shared):
    actor = double_llama()
    critic = ValueModel.from_actor(actor, shared=shared).double()
    inputs = padded_inputs()
    logp, _, values = logprobs_and_values(actor, critic, inputs, with_entropy=True)
    assert logp.shape == values.shape == inputs[3].shape
    (logp.sum() + values.sum()).backward()
    got = {n: p.grad.clone() for n, p in [*actor.named_parameters(), *critic.named_parameters()]
           if p.grad is not None}
    actor.zero_grad(), critic.zero_grad()
    want_logp, want_values = untrimmed(actor, critic, inputs)
    (want_logp.sum() + want_values.sum()).backward()
    torch.testing.assert_close(logp, want_logp.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(values, want_values.float(), rtol=0, atol=1e-6)
    for name, p in [*actor.named_parameters(), *critic.named_parameters()]:
        if p.grad is not None or name in got:
            # float32 round-off: the log-probs and values are float32 (as in rlpipe) and their
            # gradients flow back through that cast into the float64 weights
            scale = float(p.grad.abs().max())
            assert torch.allclose(got[name], p.grad, rtol=1e-5, atol=1e-6 * scale), name


def test_reference_and_value_passes_trim_too():
    actor = double_llama()
    critic = ValueModel.from_actor(actor).double()
    inputs = padded_inputs()
    want_logp, want_values = untrimmed(actor, critic, inputs)
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(actor, *inputs)[0], want_logp.float(),
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(response_values(critic, *inputs), want_values.float(),
                                   rtol=0, atol=1e-6)


def _params_with_grads(seed: int, sizes, scale: float = 1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = (scale * torch.randn(n := p.numel(), generator=gen, dtype=torch.float64)).to(dtype)
    return params


def oracle_norm(grads) -> float:
    """The plain float64 definition: sqrt of the sum of every squared entry."""
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def norm_bound(n: int, dtype=torch.float32) -> float:
    """Relative distance allowed between `grad_norm` and `oracle_norm` over n entries: both sum
    exact squares in float64 (each within (n - 1) 2^-53 of the exact sum in any order, half that
    on the square root, plus its 2^-53 rounding), and `grad_norm` rounds once to its dtype."""
    rounding = 0.0 if dtype == torch.float64 else 2.0 ** -24  # bfloat16: a float32 norm
    return rounding + 2 * (n / 2 + 1) * 2.0 ** -53


def test_grad_norm_matches_float64_on_a_large_gradient():
    """An embedding-sized gradient (3 Mi entries here; SmolLM2's is 28 M): within
    `norm_bound` of the float64 norm (torch.linalg.vector_norm on CPU is off by ~1e-4 at this
    size), returned in the gradients' float32."""
    sizes = [3 * 2**20 + 7, 50, 1]
    params = _params_with_grads(5, sizes)
    norm = grad_norm(params, None)
    assert norm.dtype == torch.float32
    want = oracle_norm([p.grad for p in params])
    assert abs(float(norm) - want) <= norm_bound(sum(sizes)) * want


@pytest.mark.parametrize("seed", range(6))
def test_grad_norm_is_within_its_bound_over_sizes_and_scales(seed):
    """Sizes around the chunk edges and up to 2 Mi, scales from 1e-20 to 1e15: the bound
    holds whatever the dot product kernel (the suite runs under each ATEN_CPU_CAPABILITY)."""
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(4):
        k = int(torch.randint(1, 5, (), generator=gen))
        sizes = [int(torch.randint(1, 2**21, (), generator=gen)) for _ in range(k)]
        sizes[0] = [1, 2**16 - 1, 2**16, 2**16 + 1, 2**20, 3][seed]
        scale = 10.0 ** float(torch.randint(-20, 16, (), generator=gen))
        params = _params_with_grads(seed, sizes, scale=scale)
        want = oracle_norm([p.grad for p in params])
        assert abs(float(grad_norm(params, None)) - want) <= norm_bound(sum(sizes)) * want


def test_grad_norm_without_clipping_leaves_gradients_bit_identical():
    params = _params_with_grads(6, [50, 50, 50])
    copies = [p.grad.clone() for p in params]
    norm = grad_norm(params, None)
    assert all(torch.equal(p.grad, c) for p, c in zip(params, copies))
    assert abs(float(norm) - oracle_norm(copies)) <= norm_bound(150) * oracle_norm(copies)
    # a norm under max_norm: nothing is multiplied (clip_grad_norm_ multiplies by 1)
    assert torch.equal(grad_norm(params, 100.0), norm)
    assert all(torch.equal(p.grad, c) for p, c in zip(params, copies))


def test_grad_norm_clips_as_clip_grad_norm_does():
    """Clipped gradients are clip_grad_norm_'s formula, g max_norm / (norm + 1e-6), evaluated in
    float64 on the exact norm: within the float32 norm's bound plus the factor's division and
    the multiply (one 2^-24 rounding each). torch's own norm is a float32 sum, off the exact
    one by up to n 2^-24 of it, so its result is compared within that."""
    sizes = [300, 2**20 + 3]
    params = _params_with_grads(7, sizes, scale=0.01)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    originals = [p.grad.double() for p in params]
    for p, q in zip(params, theirs):
        q.grad = p.grad.clone()
    before = oracle_norm([p.grad for p in params])
    assert before > 1.0
    norm = grad_norm(params, 1.0)
    assert abs(float(norm) - before) <= norm_bound(sum(sizes)) * before
    factor = 1.0 / (before + 1e-6)
    allowed = norm_bound(sum(sizes)) + 2 * 2.0 ** -24
    for p, g in zip(params, originals):
        assert ((p.grad.double() - g * factor).abs() <= allowed * (g * factor).abs()).all()
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert abs(float(want) - before) <= sum(sizes) * 2.0 ** -24 * before


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_grad_norm_of_a_non_finite_gradient_is_non_finite(bad):
    params = _params_with_grads(8, [10, 10])
    params[1].grad[3] = bad
    assert not torch.isfinite(grad_norm(params, None))
    assert not torch.isfinite(grad_norm(params, 1.0))  # the step is skipped on it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_grad_norm_of_other_dtypes(dtype):
    """bfloat16 gradients are summed in float32 chunks, float64 ones in float64."""
    params = _params_with_grads(9, [1000, 33], dtype=dtype)
    norm = grad_norm(params, None)
    assert norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = oracle_norm([p.grad for p in params])
    assert abs(float(norm) - want) <= norm_bound(1033, dtype) * want


def test_frozen_lm_head_runs_one_matmul_not_a_batched_one():
    """A frozen model's sliced LM-head input is made contiguous (`contiguous_input`), so the head
    is one [B*T, H] matmul, not a bmm over a broadcast weight; the log-probs are unchanged."""
    from torch.profiler import profile

    from rlpipe.core.models.lm import contiguous_input, response_logprobs

    frozen = double_llama().float().requires_grad_(False)
    inputs = padded_inputs()

    def ops_and_logp():
        with torch.no_grad(), profile() as prof:
            logp, _ = response_logprobs(frozen, *inputs)
        return {e.key for e in prof.key_averages()}, logp

    plain_ops, plain = ops_and_logp()
    assert "aten::bmm" in plain_ops  # what torch does without the hook
    handle = frozen.get_output_embeddings().register_forward_pre_hook(contiguous_input)
    ops, hooked = ops_and_logp()
    handle.remove()
    assert "aten::bmm" not in ops and torch.allclose(hooked, plain, atol=1e-5)


def test_chunks_are_larger_off_the_cpu():
    """A GPU pass over 4 Mi logits is as short as its launch: off the CPU a chunk holds
    `GPU_CHUNK_ELEMENTS` (here 8x the positions), and every position is still covered once."""
    ids = torch.zeros(2, 1500, dtype=torch.long)
    for device, size in (("cpu", ops.CHUNK_ELEMENTS), ("meta", ops.GPU_CHUNK_ELEMENTS)):
        logits = torch.empty(1, 1, 49152, device=device).expand(2, 1501, 49152)  # no memory
        blocks = list(ops._chunks(logits, ids, start=1))
        assert max(b.stop - b.start for _, b, _ in blocks) == size // 49152
        covered = [(b, t) for b, block, _ in blocks for t in range(block.start, block.stop)]
        assert covered == [(b, t) for b in range(2) for t in range(1500)]
    assert ops.GPU_CHUNK_ELEMENTS >= 8 * ops.CHUNK_ELEMENTS
