"""`hf` collector's ``eos_after_stop``: a row that ends on a stop string gets EOS after it, an
action token like any other, whose engine and trainer log-probs are those of the unforced
distributions at that state (oracle: an uncached float64 forward of the whole row)."""

from __future__ import annotations

import copy

import pytest
import torch

from rlpipe.core.base import schema
from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.plugins.collectors.hf import HFCollector
from tests.test_hf_collector import make_chain_model


def oracle_log_probs(model, batch) -> torch.Tensor:
    """log p(response token | row so far), float64 on the CPU, no cache: [B, R], 0 on padding."""
    model, batch = copy.deepcopy(model).double().cpu(), batch.cpu()
    out = torch.zeros(batch[schema.RESPONSE_IDS].shape, dtype=torch.float64)
    for i in range(len(out)):
        prompt = batch[schema.PROMPT_IDS][i][batch[schema.PROMPT_MASK][i]]
        response = batch[schema.RESPONSE_IDS][i][batch[schema.RESPONSE_MASK][i]]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].double(), -1)
        out[i, :len(response)] = logp.gather(-1, response[:, None]).squeeze(-1)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stop_string_is_followed_by_eos_with_its_own_log_prob(tiny_model, tiny_tokenizer,
                                                                  temperature):
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=make_chain_model(tiny_model, tiny_tokenizer))
    collector = HFCollector(ctx, max_new_tokens=6, temperature=temperature,
                            stop_strings=["blue red"], eos_after_stop=True)
    collector.record_actor_log_prob(1.0)
    torch.manual_seed(0)
    batch = collector.collect(["red", "blue", "one"])
    eos = tiny_tokenizer.eos_token_id
    assert batch[schema.RESPONSE_TEXT] == ["blue red", "red blue red", "two three"]
    assert batch[schema.RESPONSE_MASK].sum(1).tolist() == [3, 4, 3]   # EOS counted
    ids = batch[schema.RESPONSE_IDS]
    assert ids[0, 2] == eos and ids[1, 3] == eos and ids[2, 2] == eos   # "one": its own EOS
    assert batch[schema.FINISHED].all()
    oracle = oracle_log_probs(ctx.actor, batch).float()
    assert oracle[0, 2] < -20 and oracle[1, 3] < -20   # the forced EOS was unlikely, not 0
    # float32 round-off of log-probs whose logits are below 100 in size: well under 1e-4
    for key in (schema.ENGINE_LOG_PROB, schema.ACTOR_LOG_PROB):
        torch.testing.assert_close(batch[key].cpu(), oracle, atol=1e-4, rtol=0)


def test_a_stop_string_at_the_token_limit_ends_the_row_without_eos(tiny_model, tiny_tokenizer):
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=make_chain_model(tiny_model, tiny_tokenizer))
    batch = HFCollector(ctx, max_new_tokens=2, temperature=0, stop_strings=["blue red"],
                        eos_after_stop=True).collect(["red", "one"])
    assert batch[schema.RESPONSE_MASK].sum(1).tolist() == [2, 2]
    assert batch[schema.FINISHED].tolist() == [True, False]   # ended on its stop string; cut


def test_without_it_the_stop_string_ends_the_row(tiny_model, tiny_tokenizer):
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=make_chain_model(tiny_model, tiny_tokenizer))
    batch = HFCollector(ctx, max_new_tokens=6, temperature=0,
                        stop_strings=["blue red"]).collect(["red"])
    assert batch[schema.RESPONSE_MASK].sum(1).tolist() == [2]


@pytest.mark.parametrize("kwargs", [dict(top_k=5), dict(top_p=0.9), dict(min_new_tokens=1)])
def test_eos_after_stop_refuses_what_can_remove_eos(ctx, kwargs):
    with pytest.raises(UserError, match="hf collector: eos_after_stop"):
        HFCollector(ctx, stop_strings=["."], eos_after_stop=True, **kwargs)
