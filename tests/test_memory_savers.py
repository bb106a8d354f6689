"""Memory savers: activation checkpointing of actor and critic, an offloaded frozen reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.models.lm import (Models, checkpointing, enable_checkpointing, response_logprobs,
                                unwrap)
from rlpipe.core.run.pipeline import Pipeline
from tests.conftest import TEST_DEVICE

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
GC = ["models.actor.gradient_checkpointing=true", "models.critic.gradient_checkpointing=true"]


def tiny(run_dir, *overrides):
    return load_config(TINY, [f"run.output_dir={run_dir}", "run.steps=1", *overrides])


def llama(attention_dropout: float = 0.0) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2,
                      attention_dropout=attention_dropout)
    return LlamaForCausalLM(cfg).eval()


def inputs(batch: int = 3, prompt: int = 5, response: int = 16):
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, 64, (batch, prompt), generator=g)
    response_ids = torch.randint(0, 64, (batch, response), generator=g)
    prompt_mask = torch.ones(batch, prompt, dtype=torch.bool)
    prompt_mask[0, :2] = False  # left padding
    response_mask = torch.ones(batch, response, dtype=torch.bool)
    response_mask[1, 10:] = False  # right padding
    return prompt_ids, prompt_mask, response_ids, response_mask


def saved_bytes_and_grads(model, grad_ckpt: bool):
    """Bytes autograd keeps for backward during one forward, and the gradients after backward."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    model.zero_grad(set_to_none=True)
    with checkpointing(model) if grad_ckpt else torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = response_logprobs(model, *inputs())
    logp.sum().backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_keeps_the_gradients_and_saves_fewer_activations():
    plain = llama()
    bytes_plain, grads_plain = saved_bytes_and_grads(plain, grad_ckpt=False)
    ckpt = llama()
    enable_checkpointing(ckpt)
    bytes_ckpt, grads_ckpt = saved_bytes_and_grads(ckpt, grad_ckpt=True)
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert bytes_ckpt < 0.6 * bytes_plain  # the blocks' activations are recomputed, not kept
    # outside `checkpointing` (generation, no-grad scoring) the model runs as usual
    bytes_outside, _ = saved_bytes_and_grads(ckpt, grad_ckpt=False)
    assert bytes_outside == bytes_plain


def test_checkpointing_does_not_turn_dropout_on():
    model = llama(attention_dropout=0.5)
    enable_checkpointing(model)
    with torch.no_grad():
        expected, _ = response_logprobs(model, *inputs())
    with checkpointing(model):
        assert not model.model.layers[0].self_attn.training  # only the blocks' own flag is set
        got, _ = response_logprobs(model, *inputs())
    torch.testing.assert_close(got.detach(), expected)  # ratio exactly 1 on the first minibatch
    assert not any(m.training for m in model.modules())  # flags restored


@pytest.mark.parametrize("extra", [[], ["models.actor.lora={r: 4, alpha: 8}"]],
                         ids=["full", "lora"])
def test_pipeline_with_checkpointing_matches_the_plain_step(tmp_path, extra):
    a = Pipeline(tiny(tmp_path / "plain", *extra), progress=False)
    _, ma = a.step()
    b = Pipeline(tiny(tmp_path / "ckpt", *GC, *extra), progress=False)  # re-seeds: same samples
    block, calls = unwrap(b.models.actor).model.layers[0], []
    recompute = block._gradient_checkpointing_func
    block._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or recompute(*a, **k)
    _, mb = b.step()
    assert len(calls) == b.cfg.train.epochs * b.cfg.train.minibatches  # update passes only
    for key in ("loss/objective", "loss/critic", "policy/approx_kl", "value/loss"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    for (name, pa), (_, pb) in zip(a.models.actor.named_parameters(),
                                   b.models.actor.named_parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=name)
    layers = b.models.critic.backbone.layers
    assert all(layer.gradient_checkpointing for layer in layers)


def test_offloaded_reference_visits_the_device_only_while_used():
    """Movement logic with a recorded ``.to`` (this machine has no GPU to move to)."""
    ref, calls = torch.nn.Linear(2, 2), []
    ref.to = lambda device: calls.append(str(device))
    models = Models(actor=None, frozen_reference=ref, critic=None, tokenizer=None,
                    offload_to=torch.device("cuda"))
    with models.reference() as r:
        assert r is ref and calls == ["cuda"]
    assert calls == ["cuda", "cpu"]
    with pytest.raises(RuntimeError), models.reference():
        raise RuntimeError("a failing forward")
    assert calls[-1] == "cpu"  # back on CPU even when the forward raised


def test_offloaded_reference_in_a_run(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "models.reference.offload=true"), progress=False)
    assert pipe.models.offload_to == torch.device(TEST_DEVICE)  # where it visits for a forward
    _, metrics = pipe.step()
    assert metrics["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # reference == the sampling policy
    assert next(pipe.models.frozen_reference.parameters()).device.type == "cpu"


@pytest.mark.parametrize("overrides, message", [
    (["models.reference.offload=true", "models.actor.lora={r: 4}"], "no copy to offload"),
    (["models.reference.offload=true", "distributed.nproc=2"], "shard_frozen"),
])
def test_offload_misconfigurations_are_named(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        Pipeline(tiny(tmp_path, *overrides), progress=False)
