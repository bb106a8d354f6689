"""``models.packed``: the rows of a forward run as one packed sequence without their padding,
attention within each row (`rlpipe.core.models.packing`). Checked here: the packing's layout, that
log-probs, entropies, values and every parameter's gradient equal each row run alone without
padding (an oracle that shares no code with either path) and the padded forward in float64
(Llama, Qwen2, GPT-2; on their own, after a common prefix and after distinct prompts that ran
apart through `rlpipe.core.models.prefix`), a LoRA actor and its reference, a shared-backbone critic,
gradient checkpointing, which forwards pack, that a model whose attention ignores the rows runs
padded, and that a run gives the metrics and weights of a run without packing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from rlpipe.core.models import packing, prefix
from rlpipe.core.config.settings import load_config
from rlpipe.core.models.lm import (ValueModel, enable_checkpointing, logprobs_and_values,
                                response_logprobs, response_values)
from rlpipe.core.run.pipeline import Pipeline
from tests import clip_edges
from tests.test_shared_prefix import TINY, assert_same_run, configs, padded_batch
from tests.test_shared_prompts import shared_runs  # noqa: F401 (a fixture)

PROMPTS, RESPONSES, R = (3, 9, 1, 6, 4), (5, 2, 7, 0, 3), 8  # a row with no response token


def ragged_batch(seed: int = 0, share: str = "nothing"):
    """Left-padded prompts and right-padded responses of the lengths above; with ``share``
    "a prefix", the prompts begin with the same 6 tokens; with "prompts", rows 2-4 repeat the
    prompts of rows 0, 0 and 1 (interleaved, as samples of a prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (k,), generator=g) for k in PROMPTS]
    if share == "a prefix":
        head = torch.randint(1, 64, (6,), generator=g)
        prompts = [torch.cat([head, p]) for p in prompts]
    elif share == "prompts":
        prompts = [prompts[i] for i in (0, 1, 0, 0, 1)]
    return padded_batch(prompts, g, R, dict(enumerate(RESPONSES)))


@pytest.fixture
def packed_runs(monkeypatch) -> list:
    """The token count of every packed forward, in order; packing from 1 saved token."""
    seen, real = [], packing.run
    monkeypatch.setattr(packing, "run", lambda forward, rows, *a, **k:
                        seen.append(rows.tokens) or real(forward, rows, *a, **k))
    monkeypatch.setattr(packing, "MIN_SAVED_TOKENS", 1)
    return seen


def test_rows_lay_out_the_real_tokens_and_give_them_back():
    ids, mask, response_ids, response_mask = ragged_batch()
    rows = packing.Rows.of(mask, response_mask)
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    assert rows.tokens == sum(lengths) and rows.width == max(lengths)
    real = [torch.cat([ids[i][mask[i]], response_ids[i][response_mask[i]]]) for i in range(5)]
    assert rows.ids(ids, response_ids)[0].tolist() == torch.cat(real).tolist()
    assert rows.position_ids[0].tolist() == [j for n in lengths for j in range(n)]
    # the token before each real response token: the last prompt token, then the response's own
    before = rows.ids(ids, response_ids)[0][rows.index].tolist()
    assert before == [t for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))
                      for t in real[i][p - 1:p - 1 + r].tolist()]
    # and each one back to its place in the padded responses, 0 after each response
    expected, k = torch.zeros(5, R), 1
    for i, r in enumerate(RESPONSES):
        expected[i, :r] = torch.arange(k, k + r)
        k += r
    assert torch.equal(rows.scatter(torch.arange(1, k, dtype=torch.float)[None]), expected)
    # to slots and back: each row's tokens first in its slot, zeros after, the same tokens back
    x = torch.randn(1, 2, rows.tokens, 3)
    slots = rows.unpack(x)
    assert slots.shape == (5, 2, rows.width, 3)
    for i, n in enumerate(lengths):
        start = sum(lengths[:i])
        assert torch.equal(slots[i, :, :n], x[0, :, start:start + n])
        assert not slots[i, :, n:].any()
    assert torch.equal(rows.pack(slots.transpose(1, 2)), x.transpose(1, 2))


def test_no_packing_for_holes_empty_prompts_or_too_little_padding():
    _, mask, _, response_mask = ragged_batch()
    assert packing.Rows.of(mask, response_mask, min_saved=1) is not None
    saved = mask.numel() + response_mask.numel() - sum(PROMPTS) - sum(RESPONSES)
    assert packing.Rows.of(mask, response_mask, min_saved=saved) is not None
    assert packing.Rows.of(mask, response_mask, min_saved=saved + 1) is None
    holed = response_mask.clone()
    holed[0, 1] = False  # a masked token inside a response
    assert packing.Rows.of(mask, holed, min_saved=1) is None
    right_padded = mask.flip(1)  # prompts padded on the right
    assert packing.Rows.of(right_padded, response_mask, min_saved=1) is None
    empty = mask.clone()
    empty[2] = False
    assert packing.Rows.of(empty, response_mask, min_saved=1) is None


def alone(model, critic, inputs):
    """The oracle: each row run by itself at batch size 1, without padding or a mask;
    ``(log-probs, entropies, values)`` [B, R], 0 past each response."""
    ids, mask, response_ids, response_mask = inputs
    out = [torch.zeros(len(ids), R, dtype=torch.float64) for _ in range(3)]
    for i in range(len(ids)):
        p, r = int(mask[i].sum()), int(response_mask[i].sum())
        row = torch.cat([ids[i][mask[i]], response_ids[i][:r]])[None]
        logits = model(input_ids=row).logits[0, p - 1:p - 1 + r].double()
        logp = logits.log_softmax(-1)
        out[0][i, :r] = logp.gather(-1, response_ids[i, :r, None])[:, 0]
        out[1][i, :r] = -(logp.exp() * logp).sum(-1)
        out[2][i, :r] = critic(row, torch.ones_like(row), torch.arange(row.shape[1])[None])[
            0, p - 1:p - 1 + r]
    return out


def forward_and_grads(model, critic, inputs, packed: bool, shared_prefix: bool = False):
    """Log-probs, entropies and values, and each parameter's gradient of a loss on all three."""
    for m in (model, critic):
        m.zero_grad(set_to_none=True)
    logp, entropy = response_logprobs(model, *inputs, with_entropy=True, packed=packed,
                                      shared_prefix=shared_prefix)
    values = response_values(critic, *inputs, packed=packed, shared_prefix=shared_prefix)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(3, *logp.shape, dtype=logp.dtype, generator=g)
    (weight[0] * logp + weight[1] * entropy + weight[2] * values).sum().backward()
    grads = {f"{i}.{k}": p.grad.clone() for i, m in enumerate((model, critic))
             for k, p in m.named_parameters() if p.grad is not None}
    return [logp.detach(), entropy.detach(), values.detach()], grads


@pytest.mark.parametrize("share,shared,tokens", [
    ("nothing", [], sum(PROMPTS) + sum(RESPONSES)),
    # the 6-token prefix runs apart, then the rest of each prompt and its response
    ("a prefix", [("prefix", (1, 6))], sum(PROMPTS) + sum(RESPONSES)),
    # prompts 0 and 1 run apart but their last token, then one token and the response a row
    ("prompts", [("prompts", (2, 9 - 1))], 5 + sum(RESPONSES))])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_packed_rows_equal_each_row_alone_and_the_padded_forward_in_float64(
        arch, share, shared, tokens, packed_runs, shared_runs):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs()[arch]).double().eval()
    critic = ValueModel.from_actor(model).double().eval()
    inputs = ragged_batch(share=share)
    packed, packed_grads = forward_and_grads(model, critic, inputs, packed=True,
                                             shared_prefix=True)
    assert packed_runs == [tokens] * 2 and shared_runs == shared * 2  # actor and critic
    if arch != "gpt2" or int(transformers.__version__.split(".")[0]) >= 5:
        # packed, not fallen back to padding (GPT-2 passes its attention the rows from 5.0)
        assert packing.packs(model) and packing.packs(critic.backbone)
    padded, padded_grads = forward_and_grads(model, critic, inputs, packed=False)
    assert len(packed_runs) == 2 and len(shared_runs) == 2 * len(shared)
    with torch.no_grad():
        oracle = alone(model, critic, inputs)
    # log-probs and entropies come out in float32 (`response_logprobs`), values in float64
    for name, got, want, base, tol in zip(("log-prob", "entropy", "value"), packed, oracle,
                                          padded, (1e-6, 1e-6, 1e-12)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(got, base, rtol=0, atol=1e-12, msg=name)
    assert packed_grads.keys() == padded_grads.keys()
    assert len(packed_grads) == len(list(model.parameters())) + len(list(critic.parameters()))
    # transformers' RMSNorm computes in float32 (GPT-2's LayerNorm in float64)
    tol = 1e-10 if arch == "gpt2" else 1e-6
    for k, want in padded_grads.items():
        torch.testing.assert_close(packed_grads[k], want, rtol=tol,
                                   atol=tol * float(want.abs().max()), msg=k)


def test_a_lora_actor_its_reference_and_a_shared_critic_agree_in_float32(packed_runs):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_config(configs()["llama"])
    actor = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    for name, p in actor.named_parameters():  # LoRA B starts at zero: give the adapters a say
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    critic = ValueModel.from_actor(actor, shared=True)
    inputs = ragged_batch(1)
    outs, grads = [], []
    for packed in (False, True):
        actor.zero_grad(set_to_none=True)
        critic.head.zero_grad(set_to_none=True)
        logp, entropy, values = logprobs_and_values(actor, critic, inputs, with_entropy=True,
                                                    packed=packed)
        (logp.sum() + entropy.sum() + values.sum()).backward()
        with actor.disable_adapter():
            reference = response_logprobs(actor, *inputs, packed=packed)[0]
        outs.append([logp, entropy, values, reference])
        grads.append({k: p.grad for k, p in actor.named_parameters() if p.grad is not None})
        grads[-1]["head"] = critic.head.weight.grad
    assert len(packed_runs) == 2  # the actor with its critic's head, then the reference
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in k for k in grads[0])
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4,
                                   atol=1e-5 * float(grads[0][k].abs().max()), msg=k)


def test_blocks_that_recompute_in_backward_attend_within_rows(packed_runs):
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(configs()["llama"]).double()
    critic = ValueModel.from_actor(model).double()
    inputs = ragged_batch(2)
    model.train(), critic.train()
    _, plain = forward_and_grads(model, critic, inputs, packed=False)
    enable_checkpointing(model)
    enable_checkpointing(critic)
    assert model.model.gradient_checkpointing and critic.backbone.gradient_checkpointing
    _, recomputed = forward_and_grads(model, critic, inputs, packed=True)
    assert len(packed_runs) == 2
    for k, want in plain.items():
        torch.testing.assert_close(recomputed[k], want, rtol=1e-6,
                                   atol=1e-6 * float(want.abs().max()), msg=k)


def test_which_forwards_pack(packed_runs, monkeypatch):
    torch.manual_seed(3)
    llama = transformers.AutoModelForCausalLM.from_config(configs()["llama"])
    inputs = ragged_batch()
    response_logprobs(llama, *inputs)  # packed defaults to off in the functions
    monkeypatch.setattr(packing, "MIN_SAVED_TOKENS", 1000)
    response_logprobs(llama, *inputs, packed=True)  # too little padding to drop
    assert packed_runs == []
    monkeypatch.setattr(packing, "MIN_SAVED_TOKENS", 1)
    eager = transformers.AutoModelForCausalLM.from_config(configs()["llama"],
                                                          attn_implementation="eager")
    response_logprobs(eager, *inputs, packed=True)  # only transformers' sdpa attention packs
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2,
        vocab_size=64, num_attention_heads=4, sliding_window=4))
    response_logprobs(windowed, *inputs, packed=True)  # a sliding window needs its mask
    assert packed_runs == []
    # shared prompt tokens that save enough run apart first; otherwise the rows pack
    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 1)
    response_logprobs(llama, *inputs, packed=True, shared_prefix=True)  # no prompt in common
    assert packed_runs == [sum(PROMPTS) + sum(RESPONSES)]
    grouped = [x[[0, 0, 0, 1]] for x in inputs]  # one prompt three times: its tokens run apart
    response_logprobs(llama, *grouped, packed=True, shared_prefix=True)  # then the rest packs
    assert packed_runs[1] == 4 + 3 * RESPONSES[0] + RESPONSES[1]


def test_a_model_whose_attention_ignores_the_rows_runs_padded(monkeypatch, packed_runs):
    """A model that passes no keyword arguments to its attention (GPT-2 before transformers 5):
    its first packed forward is discarded with a warning, and its forwards run padded."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def ignores_rows(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop(packing.KWARG, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    real = packing.attention
    monkeypatch.setattr(packing, "attention", ignores_rows)
    llama = transformers.AutoModelForCausalLM.from_config(configs()["llama"])
    inputs = ragged_batch()
    try:
        with pytest.warns(RuntimeWarning, match="0 of the 2 attention layers.*run padded"):
            got = response_logprobs(llama, *inputs, packed=True)[0]
        again = response_logprobs(llama, *inputs, packed=True)[0]
    finally:
        AttentionInterface.register("sdpa", real)
    assert len(packed_runs) == 1 and not packing.packs(llama)  # tried once, then padded
    want = response_logprobs(llama, *inputs)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_a_model_whose_attention_is_not_causal_runs_padded(packed_runs):
    llama = transformers.AutoModelForCausalLM.from_config(configs()["llama"])
    for layer in llama.model.layers:
        layer.self_attn.is_causal = False  # as an encoder's attention declares itself
    assert not packing.packs(llama)
    response_logprobs(llama, *ragged_batch(), packed=True)
    assert packed_runs == []


def test_a_run_with_packed_rows_gives_the_same_metrics_and_weights(tmp_path, packed_runs,
                                                                   monkeypatch):
    runs, edges, counts = {}, {}, clip_edges.count_edges(monkeypatch)
    for packed in (False, True):
        out = tmp_path / f"run_{packed}"
        cfg = load_config(TINY, [f"run.output_dir={out}", "run.steps=1",
                                 f"models.packed={str(packed).lower()}"])
        _, edges[packed] = clip_edges.counted(counts, Pipeline(cfg, progress=False).train)
        runs[packed] = out
    # scoring (reference and critic) and the update (2 epochs x 2 minibatches, actor and critic)
    assert len(packed_runs) >= 2 + 2 * 2 * 2, packed_runs
    assert_same_run(runs[False], runs[True], (edges[False], edges[True]))
