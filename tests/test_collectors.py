"""Tests for the collector contract (core/contracts/collector.py): what a collector declares before
any engine starts, the documented defaults for one that declares nothing, a third-party
collector's own argument names checked at load, and errors that name the plugin."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.truncation import Truncation
from rlpipe.core.config.settings import load_config
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.collector import (CollectorContract, close_collector, contract_of,
                                             request_actor_log_prob, request_hidden, sampling_view)
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.collectors.vllm import VLLMCollector

LABEL = "collector (rlpipe.collectors:toy (toy 1.0))"
TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"


class Bare:
    def collect(self, prompts):
        return None

    def sync_weights(self, model):
        pass


def tagged(collector):
    registry.tag(collector, LABEL)
    return collector


def test_the_shared_arguments_make_the_contract():
    c = HFCollector.contract(temperature=0.7, max_new_tokens=12, n=4)
    assert (c.samples_per_prompt, c.max_new_tokens, c.temperature) == (4, 12, 0.7)
    assert (c.max_prompt_tokens, c.top_k, c.top_p, c.chat_template) == (256, 0, 1.0, False)
    assert c.budget_args == ("max_prompt_tokens", "max_new_tokens")
    assert "max_prompt_tokens" in c.defaults and "max_new_tokens" not in c.defaults
    assert VLLMCollector.contract(max_model_len=512).context_tokens == 512
    assert VLLMCollector.contract().context_tokens == 0   # the model's own context


def test_the_contract_checks_arguments_as_the_constructor_does():
    with pytest.raises(UserError, match="^hf collector: n must be an integer >= 1, got 0$"):
        HFCollector.contract(n=0)


def test_a_bare_collector_gets_the_documented_defaults():
    assert registry.DECLARED["collectors"] == {"contract": None, "close": None,
                                               "record_hidden": None,
                                               "record_actor_log_prob": None,
                                               "sampling_view": None}
    assert contract_of(Bare, {}, LABEL) == CollectorContract()
    assert CollectorContract().truncation is None
    bare = Bare()
    assert request_hidden(bare) is False   # no record_hidden(): no engine_hidden asked for
    assert request_actor_log_prob(bare, 1.0, None) is False   # nor actor_log_prob
    assert sampling_view(bare, 0.0, 1) is None   # evaluation builds its own collector
    close_collector(bare)  # no close(): nothing to do


def test_close_is_called():
    bare, closed = Bare(), []
    bare.close = lambda: closed.append(1)
    close_collector(bare)
    assert closed == [1]


@pytest.mark.parametrize("values, fragment", [
    ({"temperature": -1.0}, "temperature must be >= 0 and finite, got -1.0"),
    ({"temperature": float("nan")}, "temperature must be >= 0 and finite, got nan"),
    ({"max_new_tokens": -2}, "max_new_tokens must be an integer >= 0, got -2"),
    ({"samples_per_prompt": 0}, "samples_per_prompt must be an integer >= 1, got 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
])
def test_bad_values_name_the_plugin(values, fragment):
    class Toy(Bare):
        @classmethod
        def contract(cls):
            return CollectorContract(**values)

    with pytest.raises(UserError) as info:
        contract_of(Toy, {}, LABEL)
    assert str(info.value) == f"{LABEL}: contract(): {fragment}"


def test_what_contract_or_close_raises_names_the_plugin():
    class Broken(Bare):
        @classmethod
        def contract(cls, **args):
            raise RuntimeError("no engine")

        def close(self):
            raise RuntimeError("already gone")

    with pytest.raises(registry.PluginError, match="failed in contract: RuntimeError: no engine"):
        contract_of(Broken, {}, LABEL)
    with pytest.raises(registry.PluginError, match="failed in close: RuntimeError: already gone"):
        close_collector(tagged(Broken()))

    class Wrong(Bare):
        @classmethod
        def contract(cls):
            return {"samples_per_prompt": 2}

    with pytest.raises(UserError, match=r"contract\(\) must return a CollectorContract, got dict"):
        contract_of(Wrong, {}, LABEL)


def test_truncation_is_declared_only_when_asked_and_sampling_truncates():
    asked = HFCollector.contract(top_k=4, top_p=0.9, score_truncated=True)
    assert asked.truncation == Truncation(4, 0.9)
    assert HFCollector.contract(top_p=0.9).truncation is None              # not asked
    assert HFCollector.contract(score_truncated=True).truncation is None   # no filter
    assert HFCollector.contract(temperature=0, top_k=4, score_truncated=True).truncation is None


OWN_NAMES = '''
    from rlpipe.core.contracts.collector import CollectorContract

    class Sampler:
        """A third party's collector whose arguments have names of its own."""
        def __init__(self, ctx, num_samples: int = 1, budget: int = 16):
            self.num_samples, self.budget = num_samples, budget
        def collect(self, prompts): ...
        def sync_weights(self, model): ...
        @classmethod
        def contract(cls, num_samples=1, budget=16):
            return CollectorContract(samples_per_prompt=num_samples, max_new_tokens=budget)
'''


def test_a_collector_with_its_own_argument_names_is_checked_at_load(tmp_path, monkeypatch):
    (tmp_path / "own_sampler.py").write_text(textwrap.dedent(OWN_NAMES))
    monkeypatch.syspath_prepend(str(tmp_path))
    collector = "collector={name: 'own_sampler:Sampler', num_samples: 3}"
    base = [f"run.output_dir={tmp_path / 'run'}", collector, "data.batch_size=2"]
    with pytest.raises(UserError, match=r"^train.minibatches: 4 does not divide the 6 samples "
                                        r"per step \(data.batch_size=2 x collector n=3\)"):
        load_config(TINY, [*base, "train.minibatches=4"])
    cfg = load_config(TINY, [*base, "train.minibatches=3"])   # 6 samples: 3 minibatches of 2
    assert cfg.collector.args == {"num_samples": 3}
