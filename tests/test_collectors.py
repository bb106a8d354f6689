"""Tests for core's collector adapter (core/contracts/collector.py): declared values, documented defaults
for a collector that does not subclass the base, and errors that name the plugin."""

from __future__ import annotations

import pytest

from rlpipe.core.contracts import registry
from rlpipe.core.contracts.collector import (close_collector, collector_max_new_tokens,
                                    collector_temperature, collector_truncation, request_actor_log_prob,
                                    request_hidden, sampling_view)
from rlpipe.core.base.errors import UserError
from rlpipe.plugins.collectors.hf import HFCollector

LABEL = "collector (rlpipe.collectors:toy (toy 1.0))"


class Bare:
    def collect(self, prompts):
        return None

    def sync_weights(self, model):
        pass


def tagged(collector):
    registry.tag(collector, LABEL)
    return collector


def test_declared_values_are_read(ctx):
    collector = HFCollector(ctx, temperature=0.7, max_new_tokens=12)
    assert collector_temperature(collector) == 0.7 and collector_max_new_tokens(collector) == 12
    assert close_collector(collector) is None


def test_a_bare_collector_gets_the_documented_defaults():
    from rlpipe.core.contracts.registry import DECLARED

    assert DECLARED["collectors"] == {"temperature": 1.0, "max_new_tokens": 0, "close": None,
                                      "score_truncated": False, "top_k": 0, "top_p": 1.0,
                                      "record_hidden": None, "record_actor_log_prob": None,
                                      "sampling_view": None}
    bare = Bare()
    assert collector_temperature(bare) == 1.0 and collector_max_new_tokens(bare) == 0
    assert collector_truncation(bare) is None
    assert request_hidden(bare) is False   # no record_hidden(): no engine_hidden asked for
    assert request_actor_log_prob(bare, 1.0, None) is False   # nor actor_log_prob
    assert sampling_view(bare, 0.0, 1) is None   # evaluation builds its own collector
    close_collector(bare)  # no close(): nothing to do


def test_values_are_converted_and_close_is_called():
    bare, closed = Bare(), []
    bare.temperature, bare.max_new_tokens, bare.close = 1, 8.0, lambda: closed.append(1)
    assert collector_temperature(bare) == 1.0 and isinstance(collector_temperature(bare), float)
    assert collector_max_new_tokens(bare) == 8
    close_collector(bare)
    assert closed == [1]


@pytest.mark.parametrize("name, value, fragment", [
    ("temperature", -1.0, "temperature must be >= 0 and finite, got -1.0"),
    ("temperature", float("nan"), "temperature must be >= 0 and finite, got nan"),
    ("max_new_tokens", -2, "max_new_tokens must be >= 0, got -2"),
])
def test_bad_values_name_the_plugin(name, value, fragment):
    bare = tagged(Bare())
    setattr(bare, name, value)
    reader = collector_temperature if name == "temperature" else collector_max_new_tokens
    with pytest.raises(UserError, match="^" + LABEL.replace("(", r"\(").replace(")", r"\)")) as info:
        reader(bare)
    assert str(info.value) == f"{LABEL}: {fragment}"


def test_what_a_property_or_close_raises_names_the_plugin():
    class Broken(Bare):
        @property
        def temperature(self):
            raise RuntimeError("no engine")

        def close(self):
            raise RuntimeError("already gone")

    broken = tagged(Broken())
    with pytest.raises(registry.PluginError, match="failed in temperature: RuntimeError: no engine"):
        collector_temperature(broken)
    with pytest.raises(registry.PluginError, match="failed in close: RuntimeError: already gone"):
        close_collector(broken)
    bare = tagged(Bare())
    bare.max_new_tokens = "many"
    with pytest.raises(registry.PluginError, match=r"toy 1.0\)\) failed in max_new_tokens: Value"):
        collector_max_new_tokens(bare)


def test_truncation_is_declared_only_when_asked_and_sampling_truncates(ctx):
    from rlpipe.core.base.truncation import Truncation

    asked = HFCollector(ctx, top_k=4, top_p=0.9, score_truncated=True)
    assert collector_truncation(asked) == Truncation(4, 0.9)
    assert collector_truncation(HFCollector(ctx, top_p=0.9)) is None              # not asked
    assert collector_truncation(HFCollector(ctx, score_truncated=True)) is None   # no filter
    assert collector_truncation(HFCollector(ctx, temperature=0, top_k=4, score_truncated=True)) is None
