"""The collector contract: what core knows about sampling, declared by the collector itself.

A collector (group ``rlpipe.collectors``) is a class with ``collect(prompts) -> TensorDict`` (the
prompt and response keys of `rlpipe.core.base.schema`, ``engine_log_prob`` among them) and
``sync_weights(model)``, which the registry checks. What else core needs to know about sampling
is a `CollectorContract`, which the class computes from its constructor arguments with a
classmethod ``contract(**args)``, before any model or engine exists: config checks, the pipeline
and the update read it and nothing else. `rlpipe.plugins.collectors.base.Collector` implements
``contract`` for the arguments it shares (``n``, ``max_new_tokens``, ...); a collector with
arguments of its own names writes its own. A class without one gets ``CollectorContract()``.

The built collector may also offer methods, each optional (default: not offered), which core
calls here and only here:

- ``close()``: release the engine at the end of a run;
- ``record_hidden(on)``: write ``engine_hidden``, the actor's LM-head input for each response
  token (`request_hidden`), so that a shared-backbone critic reads its rollout values from it;
- ``record_actor_log_prob(temperature, truncation)``: write ``actor_log_prob``, each drawn token's
  log-prob under the trainer's scoring distribution, from the sampling pass's own logits
  (`request_actor_log_prob`); only for an engine that is the actor's own module;
- ``sampling_view(temperature, n)``: a collector on this one's engine with other settings, whose
  ``close()`` leaves the engine running (`sampling_view`; evaluation uses it).

>>> class Toy:
...     def __init__(self, ctx, num_samples: int = 1, budget: int = 32): ...
...     def collect(self, prompts): ...
...     def sync_weights(self, model): ...
...     @classmethod
...     def contract(cls, num_samples=1, budget=32):
...         return CollectorContract(samples_per_prompt=num_samples, max_new_tokens=budget)
>>> contract_of(Toy, {"num_samples": 4}, "toy").samples_per_prompt
4
>>> contract_of(object, {}, "bare")
CollectorContract(samples_per_prompt=1, max_new_tokens=0, max_prompt_tokens=0, budget_args=('', ''), defaults=frozenset(), context_tokens=0, temperature=1.0, top_k=0, top_p=1.0, score_truncated=False, chat_template=False, overlaps_update=False, streams=False)
"""

from __future__ import annotations

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.truncation import Truncation
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.kinds import CollectorContract, declared_contract

__all__ = ["CollectorContract", "contract_of", "close_collector", "request_actor_log_prob",
           "sampling_view", "request_hidden"]


def contract_of(collector, args: dict, label: str) -> CollectorContract:
    """The contract that ``collector`` (its class, a factory of it, or an instance) declares for
    constructor arguments ``args``; what ``contract`` raises, returns of the wrong type or with
    values out of range is one line naming ``label``."""
    declare = registry.declared("collectors", collector, "contract")
    return declared_contract(declare, args, label, CollectorContract)


def _method(collector, name: str):
    """The collector's optional method ``name``, or None; what reading it raises names the plugin."""
    with registry.calling(registry.label_of(collector), name):
        return registry.declared("collectors", collector, name)


def close_collector(collector) -> None:
    """Call the collector's ``close()`` if it has one (e.g. stop a vLLM engine)."""
    close = _method(collector, "close")
    if callable(close):
        registry.call(close)


def request_actor_log_prob(collector, temperature: float, truncation: Truncation | None) -> bool:
    """Ask the collector to write ``actor_log_prob`` from now on, under the trainer's scoring
    distribution; False where it offers no ``record_actor_log_prob``."""
    record = _method(collector, "record_actor_log_prob")
    if record is None:
        return False
    registry.call(record, temperature, truncation)
    return True


def sampling_view(collector, temperature: float, n: int):
    """The collector's ``sampling_view(temperature, n)``, or None where it offers none."""
    view = _method(collector, "sampling_view")
    return None if view is None else registry.call(view, temperature, n)


def request_hidden(collector) -> bool:
    """Ask the collector to write ``engine_hidden`` from now on; False where it offers no
    ``record_hidden``."""
    record = _method(collector, "record_hidden")
    if record is None:
        return False
    registry.call(record, True)
    return True
