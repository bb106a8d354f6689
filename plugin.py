"""``rlpipe.plugin``: everything a plugin author imports, in one module.

A plugin (a collector, reward, advantage, loss or health rule; docs/plugins.md) imports from
``rlpipe.plugin`` and ``rlpipe`` alone; the rest of the package is rlpipe's own and may change
in any release. Here:

- the batch keys (``PROMPT_IDS``, ``REWARD``, ``ADVANTAGE``, ...; `schema`, the module, also
  holds ``validate``);
- the contracts, one per plugin kind, each computed by the plugin's ``contract(**args)`` from its
  constructor arguments: `CollectorContract`, `AdvantageContract`, `RewardContract`,
  `LossContract` (a loss's class attribute ``contract``);
- base classes: `Collector` (with `Bound`, the argument types of sampling settings, `pad_rows`),
  `PipelineLoss`, `Rule` (with `num` for a rule's checked parameters), `Callback`;
- what a plugin receives or raises: `RunContext`, `UserError`, `PluginError`;
- helpers the built-in plugins share: masked means (`masked_mean`, `masked_whiten`),
  `batch_texts`, the KL estimators (`kl`), the loss metric reductions (`TOKEN`, `SEQ`,
  `EXPLAINED_VAR`, `explained_var`, `explained_var_sums`, `global_count`), `ModelPath`.

Versioning: `__all__` is the public surface, pinned by tests/test_plugin_surface.py. Adding a
name is a minor change; removing or moving a name out of this module is a breaking change, and
the name keeps working for one more minor release (0.x: the next minor) through the module's
``__getattr__``, with a ``DeprecationWarning`` that says what to import instead (`_MOVED`).

>>> from rlpipe.plugin import AdvantageContract, REWARD, advantage_contract
>>> class Baseline:
...     @classmethod
...     def contract(cls):
...         return AdvantageContract(needs_critic=False, needs_groups=True, kl_in="loss")
>>> advantage_contract(Baseline).needs_groups, REWARD
(True, 'reward')
"""

from __future__ import annotations

import importlib
import warnings

from rlpipe.core.base import schema
from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.hub import ModelPath
from rlpipe.core.base.ops import masked_mean, masked_whiten
from rlpipe.core.base.schema import (ACTION_MASK, ACTOR_LOG_PROB, ADVANTAGE, CONVERSATION, DATA,
                                     ENGINE_HIDDEN, ENGINE_LOG_PROB, ENTROPY, ENV, FINISHED,
                                     GROUP_ID, LOG_PROB, NUM_SEQS, NUM_TOKENS, NUM_TURNS,
                                     OLD_LOG_PROB, PROMPT_IDS, PROMPT_MASK, PROMPT_MESSAGES,
                                     PROMPT_TEXT,
                                     REF_LOG_PROB, RESPONSE_IDS, RESPONSE_MASK, RESPONSE_TEXT,
                                     REWARD, ROLLOUT_IS_WEIGHT, SCORE, SCORE_PARTS, STOP_REASON,
                                     TURN_ID, TURN_REWARD, VALUE, VALUE_PRED, VALUE_TARGET)
from rlpipe.core.base.yamlconf import Range, num
from rlpipe.core.contracts.kinds import (EXPLAINED_VAR, SEQ, TOKEN, AdvantageContract,
                                         CollectorContract, LossContract, RewardContract,
                                         advantage_contract, reward_contract)
from rlpipe.core.base.schema import STOP_REASONS, action_mask
from rlpipe.core.base.toolcalls import ToolCall, parse_tool_calls
from rlpipe.core.contracts.environment import EnvironmentContract, call_env
from rlpipe.core.contracts.registry import PluginError
from rlpipe.core.contracts.reward_fn import batch_texts
from rlpipe.core.contracts.rule import Rule
from rlpipe.core.step import kl
from rlpipe.core.step.loss import PipelineLoss, explained_var, explained_var_sums, global_count
from rlpipe.plugins.collectors.base import (Bound, Collector, Count, Fraction, Temperature,
                                            Tokens, TopK, pad_rows)

__all__ = [
    # batch keys (rlpipe.core.base.schema)
    "schema", "PROMPT_IDS", "PROMPT_MASK", "RESPONSE_IDS", "RESPONSE_MASK", "PROMPT_TEXT",
    "RESPONSE_TEXT", "PROMPT_MESSAGES", "GROUP_ID", "FINISHED", "ENGINE_LOG_PROB",
    "ENGINE_HIDDEN", "ACTOR_LOG_PROB", "OLD_LOG_PROB", "REF_LOG_PROB", "VALUE", "SCORE",
    "SCORE_PARTS", "DATA", "REWARD", "ADVANTAGE", "VALUE_TARGET", "ROLLOUT_IS_WEIGHT",
    "LOG_PROB", "ENTROPY", "VALUE_PRED", "NUM_TOKENS", "NUM_SEQS", "ACTION_MASK", "TURN_ID",
    "TURN_REWARD", "NUM_TURNS", "STOP_REASON", "CONVERSATION", "ENV", "STOP_REASONS", "action_mask",
    # contracts
    "CollectorContract", "AdvantageContract", "RewardContract", "LossContract",
    "advantage_contract", "reward_contract", "EnvironmentContract",
    # environments (multi-turn): calling one, tool calls
    "call_env", "ToolCall", "parse_tool_calls",
    # base classes and argument types
    "Collector", "Bound", "Count", "Fraction", "Temperature", "Tokens", "TopK", "pad_rows", "Range",
    "ModelPath", "PipelineLoss", "Rule", "num", "Callback",
    # what a plugin receives or raises
    "RunContext", "UserError", "PluginError",
    # shared helpers
    "masked_mean", "masked_whiten", "batch_texts", "kl", "TOKEN", "SEQ", "EXPLAINED_VAR",
    "explained_var", "explained_var_sums", "global_count",
]

# A name moved out of this module: old name -> ("module:attribute" where it lives now, the
# release that removes it here). Read by `__getattr__` for one minor release, then deleted.
_MOVED: dict[str, tuple[str, str]] = {}


def __getattr__(name: str):
    """`Callback` on first use (it lives with the run, which plugins never import), and the
    names in `_MOVED`, with a ``DeprecationWarning``."""
    if name == "Callback":  # not imported above: importing rlpipe.plugin loads no run code
        from rlpipe.core.run.callbacks import Callback

        return Callback
    if name in _MOVED:
        where, removed_in = _MOVED[name]
        module, attr = where.split(":")
        warnings.warn(f"rlpipe.plugin.{name} moved to {module}.{attr}; the old name goes in "
                      f"rlpipe {removed_in}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'rlpipe.plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
