"""``models.autocast: bfloat16``: actor, critic and reference compute under ``torch.autocast`` in
the rollout (HF collector), scoring and update, while weights, gradients and optimizer state stay
float32 and the value head computes in float32. Checked here: what runs in bf16 and what does
not, the log-probs against a float64 oracle within bf16 round-off, that old log-probs are then
recomputed (the sampling pass is not the update's forward within float32 round-off) so that the
first step's KL is exactly 0, the refusal next to ``distributed.bf16``, the HF collector's merged
LoRA weights kept in bf16, and whole runs with the fast path, the preflight and evaluation."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.models.lora import allow_merging, merged_weights
from rlpipe.core.models.lm import response_logprobs
from rlpipe.core.run.pipeline import Pipeline, train

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "run.steps=2", *overrides])


def record_dtypes(modules: dict) -> tuple[dict, list]:
    """Forward hooks that collect the output dtypes of each named module."""
    seen = {name: set() for name in modules}

    def hook(name):
        return lambda module, args, out: seen[name].add(out.dtype)
    return seen, [m.register_forward_hook(hook(name)) for name, m in modules.items()]


def first_linear(module: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_autocast_runs_the_models_in_bf16_and_keeps_float32_state(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "models.autocast=bfloat16"), progress=False)
    m = pipe.models
    probes = {"actor": first_linear(m.actor), "critic": first_linear(m.critic.backbone),
              "reference": first_linear(m.frozen_reference), "value head": m.critic.head}
    seen, hooks = record_dtypes(probes)
    grads = set()   # the dtype of every gradient accumulated into a trained weight
    hooks += [probes[name].weight.register_post_accumulate_grad_hook(
        lambda p: grads.add(p.grad.dtype)) for name in ("actor", "critic", "value head")]
    try:
        _, metrics = pipe.step()
    finally:
        for h in hooks:
            h.remove()
    assert seen["actor"] == {torch.bfloat16}        # rollout and update (scoring recomputes)
    assert seen["critic"] == {torch.bfloat16}
    assert seen["reference"] == {torch.bfloat16}
    assert seen["value head"] == {torch.float32}    # a bf16 value would keep 3 digits
    assert grads == {torch.float32}
    assert all(p.dtype == torch.float32 for model in (m.actor, m.critic) for p in model.parameters())
    states = [s for opt in pipe.updater.opts.values() for s in opt.state.values()]
    assert states and all(v.dtype == torch.float32 for s in states for k, v in s.items()
                          if k in ("exp_avg", "exp_avg_sq"))
    losses = [v for k, v in metrics.items() if k.startswith(("loss", "policy/", "value/"))]
    assert len(losses) > 3 and all(torch.isfinite(torch.tensor(float(v))) for v in losses)
    # the collector, scoring and update ran in bf16 only inside the step: nothing leaks out
    layer = first_linear(m.actor)
    assert layer(torch.ones(1, layer.in_features, device=layer.weight.device)).dtype == torch.float32


def test_autocast_log_probs_match_a_float64_oracle_within_bf16_round_off(tmp_path):
    # random weights: near-uniform logits, whose bf16 round-off the bounds below are set for
    pipe = Pipeline(tiny(tmp_path, "models.autocast=bfloat16", "models.actor.init=random"),
                    progress=False)
    with pipe.models.compute():
        batch = pipe.plugins.collector.collect(["Hi", "The weather today is very", "Once"])
    inputs = [batch[k] for k in INPUTS]
    mask = batch[S.RESPONSE_MASK]
    oracle = copy.deepcopy(pipe.models.actor).double()
    with torch.no_grad():
        exact, _ = response_logprobs(oracle, *inputs, pipe.temperature)
        with pipe.models.compute():
            mixed, _ = response_logprobs(pipe.models.actor, *inputs, pipe.temperature)
        full, _ = response_logprobs(pipe.models.actor, *inputs, pipe.temperature)
    assert mixed.dtype == torch.float32 and mask.sum() > 5
    err = (mixed.double() - exact)[mask].abs()
    assert err.max() < 0.01                    # bf16 keeps 8 bits: about 1e-3 nats here
    assert err.max() > 1e-5                    # and it did run in bf16: float32 is at 1e-6
    assert ((full.double() - exact)[mask].abs().max()) < 1e-5


def test_autocast_recomputes_old_log_probs_and_starts_at_zero_kl(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "models.autocast=bfloat16"), progress=False)
    assert not pipe.old_from_sampling        # auto: the sampling pass is not exact in bf16
    _, metrics = pipe.step()
    assert metrics["kl/ref"] == 0.0          # actor and reference: the same bf16 computation
    float32 = Pipeline(tiny(tmp_path / "f32"), progress=False)
    assert float32.old_from_sampling         # the default run takes them from the sampling pass


def test_autocast_next_to_fsdp_bf16_is_refused(tmp_path):
    with pytest.raises(UserError, match="models.autocast: distributed.bf16 already"):
        tiny(tmp_path, "models.autocast=bfloat16", "distributed.bf16=true")
    with pytest.raises(UserError, match="models.autocast"):
        tiny(tmp_path, "models.autocast=float16")


def test_merged_lora_weights_are_kept_in_the_autocast_dtype(tiny_model):
    """The HF collector's merged LoRA weights (`merged_weights`) under autocast: kept in bf16, as
    autocast would cast them (a float32 copy is not a trainable leaf, so autocast would cast it
    again at every decoding step); the logits stay within bf16 round-off of a float64 oracle,
    and the float32 base weights come back untouched."""
    torch.manual_seed(1)
    model = allow_merging(get_peft_model(
        copy.deepcopy(tiny_model).float(),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval())
    oracle = copy.deepcopy(model).double()
    ids = torch.randint(model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    ids = ids.to(model.device)
    bases = {n: p.clone() for n, p in model.named_parameters() if "base_layer" in n}
    with torch.no_grad():
        exact = oracle(input_ids=ids).logits
        with torch.autocast(model.device.type, dtype=torch.bfloat16):
            with merged_weights(model) as merged:
                dtypes = {m.base_layer.weight.dtype for m in model.modules()
                          if hasattr(m, "lora_A")}
                fused = model(input_ids=ids).logits
            adapters = model(input_ids=ids).logits   # the adapters' own path, autocast
    assert merged == 14 and dtypes == {torch.bfloat16}
    scale = exact.abs().max()
    for logits in (fused, adapters):
        err = (logits.double() - exact).abs().max() / scale
        assert 1e-4 < err < 6e-2    # bf16 (8 bits) ran: 1e-2 here, float32 5e-7
    assert all(p.dtype == torch.float32 and torch.equal(p, bases[n])
               for n, p in model.named_parameters() if n in bases)


@pytest.mark.parametrize("setup", [
    # the fast path: merged LoRA rollout, values from the rollout's hidden states
    ["models.actor.lora.r=4", "models.critic.shared_backbone=true", "rollout_correction.mode=bypass"],
    ["run.preflight=true", "eval.prompts={prompts}", "eval.max_prompts=4", "eval.every=1"],
])
def test_autocast_trains_the_fast_path_and_with_preflight_and_evaluation(tmp_path, setup):
    prompts = TINY.parent / "prompts.txt"
    cfg = tiny(tmp_path, "models.autocast=bfloat16", *[s.format(prompts=prompts) for s in setup])
    run_dir = train(cfg, progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2] and (run_dir / "final").is_dir()
    for row in steps:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
        assert "value/explained_var" in row            # a critic trained
    if "run.preflight=true" in setup:                  # evaluation at step 0 and after each step
        assert [r["step"] for r in rows if any(k.startswith("eval/") for k in r)] == [0, 1, 2]
