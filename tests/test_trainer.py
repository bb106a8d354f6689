"""The trainer's models and run: LoRA with an adapter-disabled reference, the exported policy,
checkpoint and exact resume, a shared-backbone critic. The PPO update itself (critic warm-up, NaN
guard, target KL, KL as a loss term, schedules, ptx, the loss contract) is in test_update.py."""

import copy
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlpipe.core.run import checkpoint
from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.models.lm import logprobs_and_values, response_logprobs, response_values
from rlpipe.core.run.pipeline import Pipeline

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
LORA = ["models.actor.lora={r: 4, alpha: 8}"]


def tiny(run_dir, *overrides):
    return load_config(TINY, [f"run.output_dir={run_dir}", "run.steps=2", *overrides])


def params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_lora_reference_is_the_initial_actor_with_adapters_disabled(tmp_path):
    pipe = Pipeline(tiny(tmp_path, *LORA, "train.lr=0.05"), progress=False)
    actor = pipe.models.actor
    assert pipe.models.frozen_reference is None  # no second copy of the weights
    assert all("lora_" in n for n, p in actor.named_parameters() if p.requires_grad)
    batch = pipe.plugins.collector.collect(["Hello there", "The sky is"])
    inputs = [batch[k] for k in (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)]
    with torch.no_grad():
        initial, _ = response_logprobs(actor, *inputs)
    pipe.train()
    with torch.no_grad(), pipe.models.reference() as reference:
        ref_now, _ = response_logprobs(reference, *inputs)
    with torch.no_grad():
        actor_now, _ = response_logprobs(actor, *inputs)
    assert torch.allclose(ref_now, initial, atol=1e-6)
    assert not torch.allclose(actor_now, initial, atol=1e-3)  # the adapters did learn
    assert any("lora_" in n for n, _ in actor.named_parameters())  # export did not unload LoRA


def test_final_folder_reloads_with_merged_lora(tmp_path):
    pipe = Pipeline(tiny(tmp_path, *LORA, "train.lr=0.05"), progress=False)
    run_dir = pipe.train()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    ids = torch.tensor([[1, 5, 9, 13, 20]])
    with torch.no_grad():
        actor = copy.deepcopy(pipe.models.actor).cpu()   # where the run's sits on a GPU
        assert torch.allclose(merged(input_ids=ids).logits, actor(input_ids=ids).logits, atol=1e-4)


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    common = ["checkpoint.every=1", "checkpoint.keep=2", "run.steps=4"]
    full = Pipeline(tiny(tmp_path / "full", *common), progress=False).train()
    Pipeline(tiny(tmp_path / "cut", *common[:2], "run.steps=2"), progress=False).train()
    # a half-written checkpoint from a kill is ignored
    (tmp_path / "cut" / "checkpoints" / ".tmp-step-000003").mkdir()
    (tmp_path / "cut" / "checkpoints" / "step-000009").mkdir()
    assert checkpoint.latest(tmp_path / "cut").name == "step-000002"
    Pipeline(tiny(tmp_path / "cut", *common), progress=False, resume=True).train()
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
                        for r in rs]
    assert strip(rows(tmp_path / "cut")) == strip(rows(full))
    assert [p.name for p in checkpoint.complete(tmp_path / "cut")] == ["step-000003", "step-000004"]


def test_shared_backbone_critic_trains_with_the_actor(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "models.critic.shared_backbone=true", "run.steps=1"),
                    progress=False)
    m = pipe.models
    backbone = {id(p) for p in m.actor.base_model.parameters()}
    assert all(id(p) in backbone for p in m.critic.backbone.parameters())  # no second copy
    assert {id(p) for p in pipe.updater.params["critic"]} == {id(p) for p in m.critic.head.parameters()}
    head0, actor0 = params(m.critic.head), params(m.actor)
    _, metrics = pipe.step()
    assert not same(head0, params(m.critic.head)) and not same(actor0, params(m.actor))
    assert metrics["value/loss"] > 0


def test_shared_backbone_values_come_from_the_actor_forward(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "models.critic.shared_backbone=true", *LORA), progress=False)
    m = pipe.models
    batch = pipe.plugins.collector.collect(["Hello there", "The sky is"])
    inputs = [batch[k] for k in (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)]
    passes = []
    hook = m.critic.backbone.register_forward_hook(lambda *_: passes.append(1))
    with torch.no_grad():
        logp, _, values = logprobs_and_values(m.actor, m.critic, inputs)
        assert len(passes) == 1  # one backbone pass for both heads
        torch.testing.assert_close(logp, response_logprobs(m.actor, *inputs)[0], rtol=0, atol=0)
        torch.testing.assert_close(values, response_values(m.critic, *inputs), rtol=0, atol=0)
    hook.remove()
    assert values.abs().sum() > 0 and (values[~inputs[3]] == 0).all()


def test_lora_actor_keeps_a_fully_trainable_critic(tmp_path):
    pipe = Pipeline(tiny(tmp_path, *LORA), progress=False)
    critic = pipe.models.critic
    assert not any("lora_" in n for n, _ in critic.named_parameters())
    assert all(p.requires_grad for p in critic.parameters())
