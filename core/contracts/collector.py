"""The collector contract as core reads it: one adapter, with a documented default for each
attribute a collector may leave out.

A collector (group ``rlpipe.collectors``) is a class with ``collect(prompts) -> TensorDict`` and
``sync_weights(model)``, which the registry checks. Core also reads, here and only here:

- ``temperature``: the sampling temperature; the trainer's log-probs divide the logits by it
  (0, greedy, scores at temperature 1). A real number >= 0; default 1.0.
- ``max_new_tokens``: the response budget, handed to the other plugins as
  ``ctx.max_new_tokens``. An integer >= 0; default 0 (unknown).
- ``close()``: release the engine at the end of a run; default: nothing to release.
- ``score_truncated``, ``top_k``, ``top_p``: with ``score_truncated`` true (default false) and
  sampling truncated (``top_k > 0`` or ``top_p < 1``, temperature > 0), the trainer scores
  tokens under the same renormalised distribution (`rlpipe.core.base.truncation`). Defaults 0, 1.0.
- ``record_hidden(on)``: a collector that runs the actor's own module can write
  ``engine_hidden``, the input of the actor's LM head for each response token; core calls it
  (`request_hidden`) when a shared-backbone critic can read its rollout values from that instead
  of a forward. Default None: not offered.
- ``record_actor_log_prob(temperature, truncation)``: a collector whose engine is the actor's own
  module, in the trainer's precision, can write ``actor_log_prob``: the log-prob of each drawn
  token under ``softmax(logits / temperature)`` (restricted to ``truncation``'s kept set when it
  is not None), computed from the sampling pass's own logits, before any processor (EOS
  suppression, top-k, top-p) changes them. It is the number the trainer's scoring forward
  computes, up to float round-off, so core (`request_actor_log_prob`, under
  ``rollout_correction.old_log_prob``) takes it as ``old_log_prob`` instead of running that
  forward. Default None: not offered.
- ``sampling_view(temperature, n)``: a collector that samples at ``temperature``, ``n`` per
  prompt, from this one's engine and weights, leaves this one's settings as they are, and whose
  ``close()`` leaves the engine running. Evaluation uses it
  (`sampling_view`) so that an engine that holds GPU memory (``vllm``) is not started twice.
  Default None: evaluation builds a second collector from the config.

`rlpipe.plugins.collectors.base.Collector` declares the attributes; a collector that does not
subclass it gets the defaults listed in `rlpipe.core.contracts.registry.DECLARED`. A value of the wrong kind,
or an error raised while reading it (a property), is one line naming the plugin.

>>> class Bare:
...     def collect(self, prompts): ...
...     def sync_weights(self, model): ...
>>> collector_temperature(Bare()), collector_max_new_tokens(Bare()), close_collector(Bare())
(1.0, 0, None)
>>> collector_truncation(Bare()) is None
True
"""

from __future__ import annotations

import math

from rlpipe.core.contracts import registry
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.truncation import Truncation

def _attribute(collector, name: str, convert=lambda value: value):
    """``convert(collector.name)``, or of its default; what a property or the conversion raises is
    one line naming the plugin."""
    with registry.calling(registry.label_of(collector), name):
        return convert(registry.declared("collectors", collector, name))


def collector_temperature(collector) -> float:
    """The collector's sampling temperature (default 1.0)."""
    value = _attribute(collector, "temperature", float)
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{registry.label_of(collector)}: temperature must be >= 0 and finite, "
                        f"got {value!r}")
    return value


def collector_max_new_tokens(collector) -> int:
    """The collector's response budget (default 0: unknown)."""
    value = _attribute(collector, "max_new_tokens", int)
    if value < 0:
        raise UserError(f"{registry.label_of(collector)}: max_new_tokens must be >= 0, got {value}")
    return value


def close_collector(collector) -> None:
    """Call the collector's ``close()`` if it has one (e.g. stop a vLLM engine)."""
    close = _attribute(collector, "close")
    if callable(close):
        registry.call(close)


def collector_truncation(collector) -> Truncation | None:
    """The sampler's `Truncation` when the collector asks the trainer to score under it
    (``score_truncated``) and sampling is truncated; else None (plain log-softmax)."""
    if not _attribute(collector, "score_truncated", bool):
        return None
    top_k, top_p = _attribute(collector, "top_k", int), _attribute(collector, "top_p", float)
    if top_k < 0 or not 0 < top_p <= 1:
        raise UserError(f"{registry.label_of(collector)}: top_k must be >= 0 and top_p in (0, 1], "
                        f"got {top_k!r}, {top_p!r}")
    truncation = Truncation(top_k, top_p)
    return truncation if truncation.active and collector_temperature(collector) > 0 else None


def request_actor_log_prob(collector, temperature: float, truncation: Truncation | None) -> bool:
    """Ask the collector to write ``actor_log_prob`` from now on, under the trainer's scoring
    distribution (its ``record_actor_log_prob(temperature, truncation)``); False where it declares
    no ``record_actor_log_prob``."""
    record = _attribute(collector, "record_actor_log_prob")
    if record is None:
        return False
    registry.call(record, temperature, truncation)
    return True


def sampling_view(collector, temperature: float, n: int):
    """The collector's ``sampling_view(temperature, n)``, or None where it declares none."""
    view = _attribute(collector, "sampling_view")
    return None if view is None else registry.call(view, temperature, n)


def request_hidden(collector) -> bool:
    """Ask the collector to write ``engine_hidden`` from now on (its ``record_hidden(True)``);
    False where it declares no ``record_hidden``."""
    record = _attribute(collector, "record_hidden")
    if record is None:
        return False
    registry.call(record, True)
    return True
