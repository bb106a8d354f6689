"""``models.shared_prefix``: prompt tokens that every row of a forward begins with run once, at
batch size 1, and their KV cache is repeated to the rows (`rlpipe.core.models.prefix`). Checked here:
which prefix counts as shared, that the rows' hidden states and every parameter's gradient equal
the whole forward's in float64 (for Llama, Qwen2 and GPT-2), that log-probs and values agree
within float32 round-off (also for a LoRA actor, its reference and a critic on its backbone),
that no prefix is shared while blocks recompute in backward (gradient
checkpointing) or for a sliding-window cache, the error for a model that ignores the cache, and
that a run with it gives the metrics and weights of a run without it."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from rlpipe.core.models import prefix
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.models.lm import (ValueModel, checkpointing, enable_checkpointing,
                                logprobs_and_values, response_logprobs, response_values)
from rlpipe.core.run.pipeline import Pipeline
from tests import clip_edges
from tests.conftest import final_weights, logged_metrics

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
SHARED, REST, R = 12, (3, 5, 1, 4), 6  # a 12-token prefix, then 3, 5, 1, 4 tokens of each prompt


def configs():
    small = dict(vocab_size=64, num_attention_heads=4)
    return {
        "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_key_value_heads=2, **small),
        "qwen2": transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_key_value_heads=2, **small),
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                        bos_token_id=0, eos_token_id=0),
    }


def batch(seed: int = 0):
    """Left-padded prompts that begin with the same SHARED tokens, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, 64, (SHARED,), generator=g)
    prompts = [torch.cat([head, torch.randint(1, 64, (k,), generator=g)]) for k in REST]
    return padded_batch(prompts, g, R, {1: 3, 2: 5})


def padded_batch(prompts: list, g: torch.Generator, r: int, short: dict[int, int]):
    """``prompts`` left-padded into ids and mask, and random responses of ``r`` tokens, row i
    cut to ``short[i]`` tokens (right padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, True
    response_ids = torch.randint(1, 64, (len(prompts), r), generator=g)
    response_mask = torch.ones(len(prompts), r, dtype=torch.bool)
    for i, k in short.items():
        response_mask[i, k:] = False
    return ids, mask, response_ids, response_mask


@pytest.fixture
def prefills(monkeypatch) -> list:
    """The shapes of the prefixes `prefix.run` ran apart, in order (whether or not their cache
    was then used)."""
    shapes, real = [], prefix._prefilled
    monkeypatch.setattr(prefix, "_prefilled", lambda prefill, ids, *rest:
                        shapes.append(tuple(ids.shape)) or real(prefill, ids, *rest))
    return shapes


def cache_arg(model) -> str:
    """The forward's name for a KV cache (``cache`` from transformers 5.24 on)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def test_shared_length_counts_the_common_real_tokens():
    ids, mask, _, _ = batch()
    assert prefix.shared_length(ids, mask, min_saved=1) == SHARED
    assert prefix.shared_length(ids, mask) == 0  # 3 rows x 12 tokens saved < MIN_SAVED_TOKENS
    assert prefix.shared_length(ids, mask, min_saved=3 * SHARED) == SHARED
    assert prefix.shared_length(ids, mask, min_saved=3 * SHARED + 1) == 0
    other = ids.clone()
    other[3, other.shape[1] - REST[3] - SHARED + 5] += 1  # row 3 differs at its 6th token
    assert prefix.shared_length(other, mask, min_saved=1) == 5
    holes = mask.clone()
    holes[0, -1] = False  # padding after a real token: not left padding, nothing shared
    assert prefix.shared_length(ids, holes, min_saved=1) == 0
    assert prefix.shared_length(ids[:1], mask[:1], min_saved=1) == 0  # one row saves nothing
    # the shortest prompt keeps its last token (it scores the first response token)
    row = torch.tensor([5, 6, 7, 8])
    assert prefix.shared_length(torch.stack([row, row]), torch.ones(2, 4, dtype=torch.bool),
                                min_saved=1) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_rows_and_gradients_equal_the_whole_forward_in_float64(arch, monkeypatch, prefills):
    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 1)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(configs()[arch]).double().eval()
    assert_rows_and_gradients_equal(model, batch(), R, arch)
    assert prefills == [(1, SHARED)]  # the shared forward ran its prefix once, the whole one not


def assert_rows_and_gradients_equal(model, inputs, r: int, arch: str) -> None:
    """`prefix.run` of the float64 ``model`` without and with a cache: the rows' last prompt
    token and ``r`` response positions equal (1e-12), and so is every parameter's gradient of a
    loss on every entry."""
    weight = torch.randn(1, r + 1, model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4))
    outputs, grads = [], []
    for name in (None, cache_arg(model)):
        model.zero_grad(set_to_none=True)
        rows = prefix.run(model, model, *inputs, name).last_hidden_state[:, -(r + 1):]
        (rows * weight).sum().backward()
        outputs.append(rows.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-12)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    # transformers' RMSNorm computes in float32 (GPT-2's LayerNorm in float64): the gradient
    # through it carries float32 rounding, so Llama and Qwen2 agree to float32 round-off there
    tol = 1e-10 if arch == "gpt2" else 1e-6
    for k in grads[0]:
        scale = float(grads[0][k].abs().max())
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=tol, atol=tol * scale, msg=k)


def test_log_probs_and_values_agree_within_float32_round_off(monkeypatch, prefills):
    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 1)
    torch.manual_seed(1)
    cfg = configs()["llama"]
    actor = transformers.LlamaForCausalLM(cfg).eval()
    critic = ValueModel(transformers.LlamaModel(cfg), cfg.hidden_size)
    inputs = batch(1)
    for share in (False, True):
        out = (response_logprobs(actor, *inputs, temperature=0.7, with_entropy=True,
                                 shared_prefix=share),
               response_values(critic, *inputs, shared_prefix=share))
        if not share:
            whole = out
    assert len(prefills) == 2
    for a, b in zip([*whole[0], whole[1]], [*out[0], out[1]]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert (out[0][0][~inputs[3]] == 0).all() and (out[1][~inputs[3]] == 0).all()


def test_a_lora_actor_and_a_shared_backbone_critic_share_the_prefix(monkeypatch, prefills):
    """The peft wrapper passes the cache through; the critic on the actor's backbone reads the
    rows' pass, not the prefix's; the LoRA gradients and the reference (adapters disabled)
    agree with the whole forward's."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 1)
    torch.manual_seed(5)
    base = transformers.LlamaForCausalLM(configs()["llama"]).eval()
    actor = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).eval()
    critic = ValueModel.from_actor(actor, shared=True)
    inputs = batch(5)
    runs = []
    for share in (False, True):
        actor.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
        logp, _, values = logprobs_and_values(actor, critic, list(inputs), shared_prefix=share)
        (logp.sum() + values.sum()).backward()
        with actor.disable_adapter():
            ref = response_logprobs(actor, *inputs, shared_prefix=share)[0]
        grads = {k: p.grad.clone() for k, p in actor.named_parameters() if p.grad is not None}
        runs.append((logp.detach(), values.detach(), ref, grads))
    assert len(prefills) == 2  # the shared pass: the actor with the critic's head, the reference
    (logp0, values0, ref0, grads0), (logp1, values1, ref1, grads1) = runs
    for a, b in ((logp0, logp1), (values0, values1), (ref0, ref1)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert grads0.keys() == grads1.keys() and any("lora_A" in k for k in grads0)
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], rtol=1e-4, atol=1e-5, msg=k)


def test_no_prefix_is_shared_while_blocks_recompute_in_backward(monkeypatch, prefills):
    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 1)
    torch.manual_seed(2)
    actor = transformers.LlamaForCausalLM(configs()["llama"]).eval()
    inputs = batch(2)
    whole = response_logprobs(actor, *inputs)[0]
    enable_checkpointing(actor)
    with checkpointing(actor):  # transformers would drop the cache: the whole forward runs
        logp = response_logprobs(actor, *inputs, shared_prefix=True)[0]
        logp.sum().backward()
    assert prefills == []
    torch.testing.assert_close(logp.detach(), whole, rtol=1e-5, atol=1e-6)
    response_logprobs(actor, *inputs, shared_prefix=True)  # outside the update: shared again
    assert prefills == [(1, SHARED)]


def test_sliding_window_caches_run_whole_and_an_ignored_cache_is_an_error(monkeypatch, prefills):
    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 1)
    torch.manual_seed(3)
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = transformers.Qwen2Model(cfg).eval()
    inputs = batch(3)
    whole = prefix.run(model, model, *inputs, None).last_hidden_state
    out = prefix.run(model, model, *inputs, cache_arg(model)).last_hidden_state
    assert prefills == [(1, SHARED)]  # the prefix ran, its sliding-window cache was not used
    torch.testing.assert_close(out, whole, rtol=0, atol=0)

    llama = transformers.LlamaModel(configs()["llama"]).eval()

    def ignores_cache(**kwargs):
        kwargs.pop(cache_arg(llama))
        return llama(**kwargs)
    with pytest.raises(UserError, match="models.shared_prefix: false"):
        prefix.run(ignores_cache, llama, *batch(), cache_arg(llama))


def instruction_run(tmp_path: Path, shared: bool) -> Path:
    """One step of the tiny example on prompts that begin with a 30-token instruction."""
    lines = (TINY.parent / "prompts.txt").read_text().splitlines()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Answer in one short sentence, kindly and plainly, without "
                               f"repeating yourself: {x}\n" for x in lines if x.strip()))
    out = tmp_path / f"run_{shared}"
    cfg = load_config(TINY, [f"run.output_dir={out}", "run.steps=1", f"data.prompts={prompts}",
                             f"models.shared_prefix={str(shared).lower()}",
                             "models.actor.init=random", "data.batch_size=8"])
    Pipeline(cfg, progress=False).train()
    return out


def test_a_run_with_a_shared_prefix_gives_the_same_metrics_and_weights(tmp_path, prefills,
                                                                      monkeypatch):
    counts = clip_edges.count_edges(monkeypatch)
    runs, edges = {}, {}
    for s in (False, True):
        runs[s], edges[s] = clip_edges.counted(counts, instruction_run, tmp_path, s)
    # scoring (16 rows: actor's old log-probs come from sampling; reference and critic) and the
    # update (8-row micro-batches, actor and critic, 2 epochs x 2 minibatches) shared their prefix
    assert len(prefills) >= 2 + 2 * 2 * 2, prefills
    assert all(shape[1] >= 20 for shape in prefills)
    assert_same_run(runs[False], runs[True], (edges[False], edges[True]))


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most AdamW (weight decay 0, torch's defaults) can move one weight at its step t, in
    units of lr, whatever the gradients: |m_t| <= sqrt(sum a_k^2 / b_k) sqrt(v_t) by
    Cauchy-Schwarz (a_k, b_k: the moments' weights), times the bias corrections.

    >>> round(adam_step_bound(1), 6), round(adam_step_bound(4), 4)
    (1.0, 1.0068)
    """
    s = sum((1 - beta1) ** 2 * beta1 ** (2 * j) / ((1 - beta2) * beta2 ** j) for j in range(t))
    return math.sqrt(s) * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)


def assert_same_run(whole: Path, shared: Path, edges: tuple[dict, dict]) -> None:
    """A run with shared prompt tokens logged the metrics and saved the weights of one without.
    What is exact is compared exactly: the sampled text, and the metrics that count tokens or
    score text (rule-based rewards). Other metrics are float32 sums, compared within 1e-4; clip
    fractions within the tokens either run found within round-off of a clip edge (``edges``,
    `tests.clip_edges`: only those can cross it).
    Weights: AdamW normalises each gradient entry, so an entry whose gradient is round-off
    (about 1e-8 of the largest) may step either way: two runs that start from the same weights
    differ by at most twice the sum of `adam_step_bound` x lr over the optimizer steps, the
    only bound that holds on every CPU. Where the gradient is not round-off the steps agree:
    all but 1% of entries within 1% of one step (a statistical check, not a bound: at most
    2.4e-4 of an LM head's entries over 4 seeds x the default, AVX2 and AVX-512 kernels)."""
    [off], [on] = logged_metrics(whole), logged_metrics(shared)
    assert off.keys() == on.keys()
    cfg = yaml.safe_load((whole / "config.yaml").read_text())
    tokens = (cfg["data"]["batch_size"] * cfg["collector"]["n"] * cfg["train"]["epochs"]
              * off["response/length"])
    for k, v in off.items():
        if k.startswith(("reward/", "response/")) or not isinstance(v, float):
            assert on[k] == v, k
        elif k in clip_edges.FRACTIONS:
            tol = clip_edges.tolerance(k, *edges, tokens)
            assert on[k] == pytest.approx(v, rel=1e-5, abs=tol), (k, edges)
        else:
            assert on[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    texts = [[{k: v for k, v in json.loads(line).items() if k != "kl"}  # kl: a float32 sum
              for p in sorted((run / "samples").glob("step-*.jsonl"))
              for line in p.read_text().splitlines()] for run in (whole, shared)]
    assert texts[0] and texts[0] == texts[1]
    steps = cfg["run"]["steps"] * cfg["train"]["epochs"] * cfg["train"]["minibatches"]
    lr = float(cfg["train"]["lr"])
    bound = 2 * lr * sum(adam_step_bound(t) for t in range(1, steps + 1))
    weights = final_weights(whole), final_weights(shared)
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        diff = (weights[1][k] - weights[0][k]).abs()
        assert float(diff.max()) <= bound, k
        assert float((diff > 1e-2 * lr).float().mean()) <= 1e-2, k