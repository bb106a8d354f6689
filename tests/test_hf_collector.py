"""Tests for the Hugging Face `generate` collector (plugins/collectors/hf.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlpipe.core.base import schema
from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.plugins.collectors.hf import HFCollector

PROMPTS = ["the cat sat on the mat", "hello", "big red dog", "a small blue rug and the big mat", "one"]
# A bigram chain: after the first token the chain model always emits the second.
CHAIN = [("one", "two"), ("two", "three"), ("three", "</s>"), ("red", "blue"), ("blue", "red")]


def make_chain_model(model, tokenizer, pairs=CHAIN):
    """Turn a tiny Llama into an exact bigram machine: after token ``a`` it emits ``b`` for every
    ``(a, b)`` in ``pairs``, by a margin of >100 nats (so sampling at temperature 1 agrees too)."""
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for layer in model.model.layers:          # blocks add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(F.normalize(torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)), dim=1))
        model.lm_head.weight.zero_()
        for a, b in pairs:
            model.lm_head.weight[ids(b)] = 50.0 * emb[ids(a)]
    return model


def greedy_reference(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[list[int], bool]:
    """Unbatched, uncached greedy decoding of one prompt: (response ids incl. EOS, finished)."""
    ids = tokenizer(prompt).input_ids
    response = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids + response], device=model.device)).logits[0, -1]
            response.append(int(logits.argmax()))
            if response[-1] == tokenizer.eos_token_id:
                return response, True
    return response, False


def rows(batch, key=schema.RESPONSE_IDS, mask_key=schema.RESPONSE_MASK) -> list[list[int]]:
    return [ids[mask].tolist() for ids, mask in zip(batch[key], batch[mask_key])]


def test_keys_shapes_dtypes_and_padding_sides(ctx, tiny_tokenizer):
    batch = HFCollector(ctx, max_new_tokens=5, n=2, micro_batch_size=2).collect(PROMPTS)
    B = 2 * len(PROMPTS)
    assert batch.batch_size == torch.Size([B])
    schema.validate(batch, [schema.PROMPT_IDS, schema.PROMPT_MASK, schema.RESPONSE_IDS,
                            schema.RESPONSE_MASK, schema.GROUP_ID, schema.FINISHED], where="hf")
    for key, dtype in [(schema.PROMPT_IDS, torch.long), (schema.PROMPT_MASK, torch.bool),
                       (schema.RESPONSE_IDS, torch.long), (schema.RESPONSE_MASK, torch.bool),
                       (schema.GROUP_ID, torch.long), (schema.FINISHED, torch.bool)]:
        assert batch[key].dtype == dtype and batch[key].shape[0] == B, key
    p_mask, r_mask = batch[schema.PROMPT_MASK], batch[schema.RESPONSE_MASK]
    assert batch[schema.PROMPT_IDS].shape == p_mask.shape
    assert batch[schema.RESPONSE_IDS].shape == r_mask.shape
    assert (p_mask[:, :-1] <= p_mask[:, 1:]).all(), "prompts must be left-padded"
    assert (r_mask[:, 1:] <= r_mask[:, :-1]).all(), "responses must be right-padded"
    assert (batch[schema.PROMPT_IDS][~p_mask] == tiny_tokenizer.pad_token_id).all()
    assert (batch[schema.RESPONSE_IDS][~r_mask] == tiny_tokenizer.pad_token_id).all()
    assert r_mask.shape[1] == r_mask.sum(1).max() <= 5, "R is the longest response"
    assert rows(batch, schema.PROMPT_IDS, schema.PROMPT_MASK) == [
        tiny_tokenizer(p).input_ids for p in PROMPTS for _ in range(2)]
    assert tiny_tokenizer.padding_side == "right" and not ctx.actor.training


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_response_mask_ends_at_first_eos(tiny_model, tiny_tokenizer, tiny_tokenizer_pad_eos,
                                         pad_is_eos, temperature):
    tokenizer = tiny_tokenizer_pad_eos if pad_is_eos else tiny_tokenizer
    ctx = RunContext(tokenizer=tokenizer, actor=make_chain_model(tiny_model, tokenizer))
    collector = HFCollector(ctx, max_new_tokens=6, temperature=temperature)
    batch = collector.collect(["the one", "two", "red", "three"])
    eos = tokenizer.eos_token_id
    expected = [tokenizer.convert_tokens_to_ids(words.split()) for words in
                ["two three </s>", "three </s>", "blue red blue red blue red", "</s>"]]
    assert rows(batch) == expected
    assert batch[schema.FINISHED].tolist() == [True, True, False, True]
    assert batch[schema.RESPONSE_MASK].shape == (4, 6)
    assert batch[schema.RESPONSE_MASK][2].all(), "a truncated row has a full-length mask"
    ids, mask = batch[schema.RESPONSE_IDS], batch[schema.RESPONSE_MASK]
    for i in (0, 1, 3):                            # first EOS, found independently of the mask
        first_eos = int((ids[i] == eos).nonzero()[0])
        assert mask[i].sum() == first_eos + 1 and ids[i, first_eos] == eos
    assert batch[schema.RESPONSE_TEXT] == ["two three", "three", "blue red blue red blue red", ""]


def test_min_new_tokens_suppresses_eos_until_then(tiny_model, tiny_tokenizer):
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=make_chain_model(tiny_model, tiny_tokenizer))
    prompts = ["two", "three"]  # the chain emits </s> after 1 and 0 tokens
    plain = HFCollector(ctx, max_new_tokens=6, temperature=0).collect(prompts)
    assert plain[schema.RESPONSE_MASK].sum(1).tolist() == [2, 1]
    batch = HFCollector(ctx, max_new_tokens=6, temperature=0, min_new_tokens=4).collect(prompts)
    ids, lengths = batch[schema.RESPONSE_IDS], batch[schema.RESPONSE_MASK].sum(1)
    assert (lengths >= 4).all() and not (ids[:, :4] == tiny_tokenizer.eos_token_id).any()
    full = HFCollector(ctx, max_new_tokens=6, temperature=1.0, min_new_tokens=6).collect(prompts)
    assert full[schema.RESPONSE_MASK].all()  # every response exactly its budget


def test_stop_strings_end_rows_and_stay_in_response(tiny_model, tiny_tokenizer):
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=make_chain_model(tiny_model, tiny_tokenizer))
    collector = HFCollector(ctx, max_new_tokens=6, temperature=0, stop_strings=["blue red"])
    batch = collector.collect(["red", "blue", "the one"])
    assert batch[schema.RESPONSE_TEXT] == ["blue red", "red blue red", "two three"]
    assert batch[schema.RESPONSE_MASK].sum(1).tolist() == [2, 3, 3]
    assert batch[schema.FINISHED].all()
    assert batch[schema.RESPONSE_IDS][0, 2] == tiny_tokenizer.pad_token_id


def test_n_samples_share_consecutive_group_ids(ctx):
    batch = HFCollector(ctx, max_new_tokens=4, n=3).collect(["the cat", "hello world"])
    assert batch[schema.GROUP_ID].tolist() == [0, 0, 0, 1, 1, 1]
    assert batch[schema.PROMPT_TEXT] == ["the cat"] * 3 + ["hello world"] * 3
    prompt_ids = batch[schema.PROMPT_IDS]
    assert (prompt_ids[:3] == prompt_ids[0]).all() and (prompt_ids[3:] == prompt_ids[3]).all()


def test_greedy_matches_unbatched_loop_and_ignores_model_defaults(ctx, tiny_tokenizer):
    model = ctx.actor
    hostile = dict(do_sample=True, top_k=2, temperature=0.3, repetition_penalty=5.0,
                   no_repeat_ngram_size=1, max_length=3)
    for key, value in hostile.items():            # a checkpoint's defaults must not leak in
        setattr(model.generation_config, key, value)
    batch = HFCollector(ctx, max_new_tokens=8, temperature=0, micro_batch_size=2).collect(PROMPTS)
    for key, value in hostile.items():
        setattr(model.generation_config, key, None)
    reference = [greedy_reference(model, tiny_tokenizer, p, 8) for p in PROMPTS]
    assert rows(batch) == [ids for ids, _ in reference]
    assert batch[schema.FINISHED].tolist() == [done for _, done in reference]


def test_micro_batches_match_one_batch_under_greedy(ctx):
    one = HFCollector(ctx, max_new_tokens=6, temperature=0, micro_batch_size=16).collect(PROMPTS)
    split = HFCollector(ctx, max_new_tokens=6, temperature=0, micro_batch_size=2).collect(PROMPTS)
    for key in (schema.PROMPT_IDS, schema.PROMPT_MASK, schema.RESPONSE_IDS, schema.RESPONSE_MASK,
                schema.GROUP_ID, schema.FINISHED):
        assert torch.equal(one[key], split[key]), key
    assert one[schema.RESPONSE_TEXT] == split[schema.RESPONSE_TEXT]


def test_texts_decode_and_stay_aligned_under_indexing(ctx, tiny_tokenizer):
    batch = HFCollector(ctx, max_new_tokens=5, n=2).collect(PROMPTS)
    texts = batch[schema.RESPONSE_TEXT]
    assert texts == tiny_tokenizer.batch_decode(rows(batch), skip_special_tokens=True)
    idx = torch.tensor([7, 0, 4])
    sub = batch[idx]
    assert sub[schema.RESPONSE_TEXT] == [texts[i] for i in idx]
    assert sub[schema.PROMPT_TEXT] == [PROMPTS[i // 2] for i in idx]
    assert sub[schema.GROUP_ID].tolist() == [i // 2 for i in idx]
    assert torch.equal(sub[schema.RESPONSE_IDS], batch[schema.RESPONSE_IDS][idx])
    joined = torch.cat([batch[:2], batch[5:6]])
    assert joined[schema.RESPONSE_TEXT] == texts[:2] + texts[5:6]


def test_chat_template_wraps_prompt_as_user_message(ctx, tiny_tokenizer):
    batch = HFCollector(ctx, max_new_tokens=3, chat_template=True).collect(["the cat"])
    expected = tiny_tokenizer("user : the cat assistant :", add_special_tokens=False).input_ids
    assert rows(batch, schema.PROMPT_IDS, schema.PROMPT_MASK) == [expected]
    assert batch[schema.PROMPT_TEXT] == ["the cat"]


def test_long_prompts_keep_their_last_tokens(ctx, tiny_tokenizer):
    batch = HFCollector(ctx, max_new_tokens=2, max_prompt_tokens=3).collect([PROMPTS[0], "hello"])
    assert batch[schema.PROMPT_IDS].shape[1] == 3
    assert rows(batch, schema.PROMPT_IDS, schema.PROMPT_MASK)[0] == tiny_tokenizer(PROMPTS[0]).input_ids[-3:]


def test_tokenizer_without_pad_pads_with_eos_and_is_not_mutated(tiny_model, tiny_tokenizer_no_pad):
    tokenizer = tiny_tokenizer_no_pad
    batch = HFCollector(RunContext(tokenizer=tokenizer, actor=tiny_model), max_new_tokens=3).collect(
        ["hello", "the big cat"])
    assert (batch[schema.PROMPT_IDS][~batch[schema.PROMPT_MASK]] == tokenizer.eos_token_id).all()
    assert tokenizer.pad_token is None


def test_outputs_are_usable_by_autograd_and_train_mode_is_restored(ctx):
    model, seen = ctx.actor, []
    model.train()
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    collector = HFCollector(ctx, max_new_tokens=3)
    batch = collector.collect(["the cat", "hello"])
    handle.remove()
    assert seen and not any(seen), "generation runs in eval mode"
    assert model.training, "the caller's mode is restored"
    collector.sync_weights(model)
    response, mask = batch[schema.RESPONSE_IDS], batch[schema.RESPONSE_MASK]
    logits = model(input_ids=torch.cat([batch[schema.PROMPT_IDS], response], dim=1)).logits
    log_prob = logits[:, -response.shape[1] - 1:-1].log_softmax(-1).gather(-1, response[..., None])
    (log_prob.squeeze(-1) * mask).sum().backward()  # fails on tensors made in inference mode


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=0), dict(max_new_tokens=2.5), dict(temperature=-0.1),
    dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
    dict(top_k=True), dict(n=0), dict(micro_batch_size=0), dict(max_prompt_tokens=0),
    dict(stop_strings="stop"), dict(stop_strings=[""]), dict(min_new_tokens=-1),
    dict(min_new_tokens=5, max_new_tokens=4), dict(min_new_tokens=1.0), dict(cache="paged"),
])
def test_bad_args_raise_user_error(ctx, kwargs):
    with pytest.raises(UserError, match="hf collector: " + next(iter(kwargs))):
        HFCollector(ctx, **kwargs)


def test_bad_context_and_prompts_raise_user_error(ctx, tiny_model, tiny_tokenizer_pad_eos):
    bare = tiny_tokenizer_pad_eos
    bare.chat_template = None
    with pytest.raises(UserError, match="chat template"):
        HFCollector(RunContext(tokenizer=bare, actor=tiny_model), chat_template=True)
    with pytest.raises(UserError, match="no actor"):
        HFCollector(RunContext(tokenizer=bare))
    collector = HFCollector(ctx)
    for prompts in ([], ["ok", 3]):
        with pytest.raises(UserError, match="prompt strings"):
            collector.collect(prompts)


def test_peft_wrapped_actor_generates_like_its_base(ctx):
    peft = pytest.importorskip("peft")
    reference = HFCollector(ctx, max_new_tokens=6, temperature=0).collect(PROMPTS)
    wrapped = peft.get_peft_model(ctx.actor, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                             task_type="CAUSAL_LM"))
    wrapped.generation_config.repetition_penalty = 5.0       # must not leak in either
    ctx_peft = RunContext(tokenizer=ctx.tokenizer, actor=wrapped, device=ctx.device)
    batch = HFCollector(ctx_peft, max_new_tokens=6, temperature=0).collect(PROMPTS)
    assert torch.equal(batch[schema.RESPONSE_IDS], reference[schema.RESPONSE_IDS])  # LoRA B starts at 0
    assert wrapped.get_base_model().generation_config.repetition_penalty == 5.0


def _within_five_sigma(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Every category's count within 5 binomial standard deviations of N p (seeded: no flake)."""
    n = counts.sum().double()
    expected, sd = n * probs, (n * probs * (1 - probs)).sqrt()
    return bool(((counts.double() - expected).abs() <= 5 * sd + 1e-9).all())


@pytest.mark.parametrize("block", [128, 2, 3])  # one block; blocks, one fully masked; padding
def test_sample_from_scores_draws_softmax_and_never_a_masked_token(block):
    """The inverse-CDF draw against float64 softmax probabilities; -inf entries never drawn;
    an off-by-one in the search would move every category's mass to its neighbour."""
    from rlpipe.plugins.collectors.hf import sample_from_scores

    scores = torch.tensor([[2.0, -float("inf"), 0.5, 1.0, -float("inf"), -1.0, 0.0]] * 20000)
    if block == 2:
        scores[:, 0], scores[:, 1] = -float("inf"), -float("inf")  # block 0 has no mass
    torch.manual_seed(0)
    tokens, logp = sample_from_scores(scores, block=block)
    probs = torch.softmax(scores[0].double(), -1)
    counts = torch.bincount(tokens, minlength=7)
    assert counts[torch.isinf(scores[0])].eq(0).all() and _within_five_sigma(counts, probs)
    assert torch.allclose(logp.double(), probs.log()[tokens], atol=1e-6)
    shifted = torch.roll(probs, 1)  # what an off-by-one would draw: clearly rejected
    assert not _within_five_sigma(counts, shifted)


def test_collector_draws_from_the_processed_distribution(ctx, tiny_model, tiny_tokenizer):
    """First tokens of 3000 samples of one prompt at temperature 0.8 and top-k 4: their
    frequencies match softmax(logits / 0.8) over the top 4, computed here in float64."""
    ids = tiny_tokenizer("the cat sat on the mat", return_tensors="pt").input_ids.to(ctx.device)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids).logits[0, -1].double() / 0.8
    top = logits.topk(4).indices
    probs = torch.zeros_like(logits)
    probs[top] = torch.softmax(logits[top], -1)
    torch.manual_seed(1)
    batch = HFCollector(ctx, max_new_tokens=1, temperature=0.8, top_k=4, n=3000,
                        micro_batch_size=1).collect(["the cat sat on the mat"])
    first = batch[schema.RESPONSE_IDS][:, 0]
    counts = torch.bincount(first, minlength=len(probs))
    assert set(first.unique().tolist()) <= set(top.tolist())
    assert _within_five_sigma(counts[top], probs[top])
    assert torch.allclose(batch[schema.ENGINE_LOG_PROB][:, 0].double(), probs[first].log(), atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_static_cache_draws_what_the_dynamic_cache_draws(ctx, tiny_model, monkeypatch,
                                                           temperature):
    """Same tokens, engine and trainer log-probs within float32 round-off, prompts widened to a
    multiple of STATIC_WIDTH (here past one: a prompt of about 90 tokens)."""
    from rlpipe.core.models.lm import response_logprobs
    from rlpipe.plugins.collectors.hf import STATIC_WIDTH

    prompts = ["the cat sat on the mat", "hello", "big red dog " * 30, "one"]
    widths, generate = [], tiny_model.generate
    monkeypatch.setattr(tiny_model, "generate",
                        lambda **kw: widths.append(kw["input_ids"].shape[1]) or generate(**kw))
    out = {}
    for cache in ("dynamic", "static"):
        collector = HFCollector(ctx, max_new_tokens=12, temperature=temperature, cache=cache)
        collector.record_actor_log_prob(temperature)
        torch.manual_seed(5)
        out[cache] = collector.collect(prompts)
    dynamic, static = out["dynamic"], out["static"]
    longest = widths[0]    # the dynamic cache gets the longest prompt's width
    assert longest > STATIC_WIDTH and widths == [longest, -(-longest // STATIC_WIDTH) * STATIC_WIDTH]
    assert torch.equal(dynamic[schema.RESPONSE_IDS], static[schema.RESPONSE_IDS])
    for key in (schema.ENGINE_LOG_PROB, schema.ACTOR_LOG_PROB):
        torch.testing.assert_close(static[key], dynamic[key], atol=1e-5, rtol=0)
    trainer, _ = response_logprobs(tiny_model, *(static[k] for k in (
        schema.PROMPT_IDS, schema.PROMPT_MASK, schema.RESPONSE_IDS, schema.RESPONSE_MASK)),
        temperature)
    mask = static[schema.RESPONSE_MASK]
    assert (static[schema.ACTOR_LOG_PROB] - trainer)[mask].abs().max() < 1e-5


def test_a_static_cache_runs_every_prompt_token_and_records_no_hidden_state(tiny_model,
                                                                           tiny_tokenizer):
    shared = RunContext(tokenizer=tiny_tokenizer, actor=tiny_model, shared_prefix=True)
    assert HFCollector(shared).shared_prefix and not HFCollector(shared, cache="static").shared_prefix
    plain = RunContext(tokenizer=tiny_tokenizer, actor=tiny_model)
    with pytest.raises(UserError, match="cache: static does not record hidden states"):
        HFCollector(plain, cache="static").record_hidden(True)


def test_a_static_cache_is_for_one_process(tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=tiny_model)
    with pytest.raises(UserError, match="cache: static is for one process"):
        HFCollector(ctx, cache="static")
    assert HFCollector(ctx).cache == "dynamic"
