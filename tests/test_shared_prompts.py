"""``models.shared_prefix`` where rows repeat prompts (``collector.n`` > 1, GRPO's groups): each
distinct prompt runs once (its own common prefix once), its KV cache is selected for the rows of
that prompt, and each row runs its last prompt token and its response (`rlpipe.core.models.prefix`).
Checked here: which prompts count as the same and which sharing `run` picks, that the rows'
hidden states and every parameter's gradient equal the whole forward's in float64 (Llama, Qwen2,
GPT-2; with and without a common prefix among the prompts, rows of a prompt interleaved), that
log-probs and values agree within float32 round-off (a LoRA actor, its reference, a critic on
its backbone and one of its own), and that a run gives the metrics and weights of a run without
sharing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from rlpipe.core.models import prefix
from rlpipe.core.config.settings import load_config
from rlpipe.core.models.lm import ValueModel, logprobs_and_values, response_logprobs, response_values
from rlpipe.core.run.pipeline import Pipeline
from tests import clip_edges
from tests.test_shared_prefix import (TINY, assert_rows_and_gradients_equal, assert_same_run,
                                      cache_arg, configs, padded_batch)

R = 5
ORDER = [2, 0, 1, 0, 2, 1, 1, 0, 2]  # each row's prompt: 3 prompts x 3 samples, interleaved


def grouped_batch(seed: int = 0, head: int = 10, tails=(4, 9, 6)):
    """Rows that sample 3 prompts (a ``head``-token common prefix, then ``tails`` tokens of
    their own), left-padded, in `ORDER`; right-padded responses of their own."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(1, 64, (head,), generator=g)
    prompts = [torch.cat([common, torch.randint(1, 64, (k,), generator=g)]) for k in tails]
    return padded_batch([prompts[i] for i in ORDER], g, R, {1: 2, 4: 4})


@pytest.fixture
def shared_runs(monkeypatch) -> list:
    """What `prefix.run` ran apart, in order: ("prefix", shape) for a common prefix at batch 1,
    ("prompts", shape) for the distinct prompts."""
    seen, prefilled, prompts_cache = [], prefix._prefilled, prefix._prompts_cache
    monkeypatch.setattr(prefix, "_prefilled", lambda prefill, ids, *rest:
                        seen.append(("prefix", tuple(ids.shape))) or prefilled(prefill, ids, *rest))
    monkeypatch.setattr(prefix, "_prompts_cache", lambda prefill, ids, *rest:
                        seen.append(("prompts", tuple(ids.shape)))
                        or prompts_cache(prefill, ids, *rest))
    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 1)
    return seen


def test_distinct_prompts_ignore_padding_and_run_picks_the_larger_saving(shared_runs):
    ids, mask, _, _ = grouped_batch()
    first, inverse = prefix.distinct_prompts(ids, mask)
    assert len(first) == 3 and inverse.tolist() == [int(inverse[ORDER.index(i)]) for i in ORDER]
    assert all(int(inverse[f]) == u for u, f in enumerate(first.tolist()))
    padded = torch.cat([torch.zeros(len(ids), 2, dtype=torch.long), ids], 1)  # more padding
    padded_mask = torch.cat([torch.zeros(len(ids), 2, dtype=torch.bool), mask], 1)
    padded[:, 0] = torch.arange(len(ids))  # garbage under the padding changes nothing
    assert prefix.distinct_prompts(padded, padded_mask)[1].tolist() == inverse.tolist()

    lengths = mask.sum(1)
    by_prompt = int((lengths - 1).sum() - (lengths[first] - 1).sum())
    by_prefix = (len(ids) - 1) * 10
    assert by_prompt > by_prefix  # 6 repeated prompts of 14-19 tokens against 8 x 10
    model = transformers.LlamaModel(configs()["llama"]).eval()
    prefix.run(model, model, *grouped_batch(), cache_arg(model))
    assert shared_runs == [("prompts", (3, ids.shape[1] - 1)), ("prefix", (1, 10))]
    shared_runs.clear()
    distinct = grouped_batch()[:2]
    rows = [ORDER.index(i) for i in range(3)]  # one row per prompt: only the common prefix
    prefix.run(model, model, distinct[0][rows], distinct[1][rows],
               *(x[rows] for x in grouped_batch()[2:]), cache_arg(model))
    assert shared_runs == [("prefix", (1, 10))]


@pytest.mark.parametrize("head", [10, 0], ids=["common-prefix", "no-common-prefix"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_rows_and_gradients_equal_the_whole_forward_in_float64(arch, head, shared_runs):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(configs()[arch]).double().eval()
    inputs = grouped_batch(1, head=head, tails=(4, 9, 6) if head else (8, 13, 10))
    assert_rows_and_gradients_equal(model, inputs, R, arch)
    assert [kind for kind, _ in shared_runs] == (["prompts", "prefix"] if head else ["prompts"])


def test_log_probs_and_values_agree_for_lora_reference_and_critics(shared_runs):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    cfg = configs()["llama"]
    actor = get_peft_model(transformers.LlamaForCausalLM(cfg).eval(), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    on_backbone = ValueModel.from_actor(actor, shared=True)
    own = ValueModel(transformers.LlamaModel(cfg), cfg.hidden_size)
    inputs = grouped_batch(5)
    runs = []
    for share in (False, True):
        actor.zero_grad(set_to_none=True)
        logp, entropy, values = logprobs_and_values(actor, on_backbone, list(inputs), 0.7,
                                                    with_entropy=True, shared_prefix=share)
        (logp.sum() + values.sum()).backward()
        with actor.disable_adapter():
            ref = response_logprobs(actor, *inputs, shared_prefix=share)[0]
        grads = {k: p.grad.clone() for k, p in actor.named_parameters() if p.grad is not None}
        runs.append(([logp.detach(), entropy, values.detach(), ref,
                      response_values(own, *inputs, shared_prefix=share)], grads))
    assert [kind for kind, _ in shared_runs] == ["prompts", "prefix"] * 3
    (whole, grads0), (shared, grads1) = runs
    for a, b in zip(whole, shared):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert (shared[0][~inputs[3]] == 0).all() and (shared[4][~inputs[3]] == 0).all()
    assert grads0.keys() == grads1.keys() and any("lora_A" in k for k in grads0)
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], rtol=1e-4, atol=1e-5, msg=k)


def grouped_run(tmp_path: Path, shared: bool) -> Path:
    """One step of the tiny example, 4 samples of each prompt, prompts that begin with an
    instruction (the distinct prompts and their common prefix are both shared)."""
    lines = (TINY.parent / "prompts.txt").read_text().splitlines()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Answer plainly: {x}\n" for x in lines if x.strip()))
    out = tmp_path / f"run_{shared}"
    cfg = load_config(TINY, [f"run.output_dir={out}", "run.steps=1", f"data.prompts={prompts}",
                             "collector.n=4", f"models.shared_prefix={str(shared).lower()}"])
    Pipeline(cfg, progress=False).train()
    return out


def test_a_run_with_repeated_prompts_gives_the_same_metrics_and_weights(tmp_path, shared_runs,
                                                                        monkeypatch):
    runs, edges, counts = {}, {}, clip_edges.count_edges(monkeypatch)
    for s in (False, True):
        runs[s], edges[s] = clip_edges.counted(counts, grouped_run, tmp_path, s)
    kinds = [kind for kind, _ in shared_runs]
    assert "prompts" in kinds and len(kinds) >= 2 + 2 * 2 * 2, kinds  # scoring and update
    assert_same_run(runs[False], runs[True], (edges[False], edges[True]))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_hf_collector_prefills_shared_prompt_tokens_once(tiny_model, tiny_tokenizer, n,
                                                            temperature, shared_runs):
    """``generate`` given the shared tokens' KV cache (`generation_cache`) draws the same tokens
    with the same log-probs and hidden states: each distinct prompt prefilled once with n > 1,
    the common prefix alone with n = 1."""
    from rlpipe.core.base.context import RunContext
    from rlpipe.plugins.collectors.hf import HFCollector

    model = tiny_model.double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # weights large enough that every token's output depends on its prompt
        for weight in (p for p in model.parameters() if p.ndim == 2):
            weight.copy_(torch.randn(weight.shape, generator=gen, dtype=weight.dtype) * 0.5)
    head = "one two three red blue " * 3
    tails = ["one one two two three three red red", "two three blue red blue one",
             "red blue red blue red blue one two three one"]  # n > 1: shared whole, left-padded
    prompts = [head + tail for tail in tails]
    batches = []
    for share in (False, True):
        torch.manual_seed(7)
        ctx = RunContext(tokenizer=tiny_tokenizer, actor=model, shared_prefix=share,
                         device=model.device)
        collector = HFCollector(ctx, max_new_tokens=6, temperature=temperature, n=n,
                                min_new_tokens=2)
        collector.record_actor_log_prob(0.7)
        collector.record_hidden(True)
        batches.append(collector.collect(prompts))
    assert [kind for kind, _ in shared_runs] == (["prompts", "prefix"] if n > 1 else ["prefix"])
    whole, shared = batches
    for key in ("response_ids", "response_mask", "finished"):
        assert torch.equal(shared[key], whole[key]), key
    for key in ("engine_log_prob", "actor_log_prob", "engine_hidden"):
        torch.testing.assert_close(shared[key], whole[key], rtol=0, atol=1e-6, msg=key)


def test_update_micro_batches_keep_a_prompts_samples_together(tmp_path, shared_runs):
    """With ``train.grad_accum`` > 1 each minibatch is ordered by prompt before it is split, so
    a prompt's samples meet in one micro-batch and share its tokens; the micro-batches still
    cover the minibatch's rows once."""
    from rlpipe.core.step.update import Updater

    seen, real = [], Updater._micro_step

    def recording(self, micro):
        seen.append(micro["group_id"].tolist())
        return real(self, micro)
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "data.batch_size=8",
                             "collector.n=4", "train.grad_accum=2", "train.epochs=1"])
    pipe = Pipeline(cfg, progress=False)
    pipe.updater._micro_step = recording.__get__(pipe.updater)
    pipe.train()
    assert len(seen) == 2 * 2  # 2 minibatches x 2 micro-batches
    for first, second in zip(seen[::2], seen[1::2]):
        assert first + second == sorted(first + second) and len(first) == len(second) == 8
    assert "prompts" in [kind for kind, _ in shared_runs]
