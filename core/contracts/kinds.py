"""The contract of every plugin kind, in one place: what core knows about a plugin, declared by it.

A plugin declares its contract with ``contract(**args)`` (a classmethod, a staticmethod or a
function attribute), computed from its constructor arguments before anything is built: config
checks and the run read these dataclasses and nothing else of the plugin.

- collectors: `CollectorContract` (read by `rlpipe.core.contracts.collector.contract_of`);
- advantages: `AdvantageContract` (`advantage_contract`);
- rewards: `RewardContract` (`reward_contract`; a reward function's comes from its signature,
  `rlpipe.core.contracts.reward_fn`);
- losses: `LossContract`, a class attribute ``contract`` (`rlpipe.core.step.loss.contract_of`).

Deprecated, for one release: an advantage's loose class attributes ``needs_critic``,
``needs_groups``, ``kl_in``, ``group_normalised`` and a reward's ``columns`` and
``scores_prefixes`` are still read (with a ``DeprecationWarning``) where no ``contract`` is
declared; rlpipe 0.2 reads ``contract`` alone (docs/plugins.md, "Versioning").

>>> class Baseline:
...     @classmethod
...     def contract(cls, scale: bool = True):
...         return AdvantageContract(needs_critic=False, needs_groups=True, kl_in="loss",
...                                  group_normalised=scale)
>>> advantage_contract(Baseline, {"scale": False}).group_normalised
False
>>> advantage_contract(object)
AdvantageContract(needs_critic=True, needs_groups=False, kl_in='loss', group_normalised=True, declared=False, needs_turns=False)
>>> reward_contract(object)
RewardContract(columns=(), scores_prefixes=False, check_values=None)
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.truncation import Truncation
from rlpipe.core.contracts import registry, reward_fn

KL_PLACES = ("reward", "loss")
TOKEN, SEQ, EXPLAINED_VAR = "token", "seq", "explained_var"
REDUCTIONS = (TOKEN, SEQ, EXPLAINED_VAR)
ENTROPY_MODES = ("grad", "detached", "none")


@dataclass(frozen=True)
class CollectorContract:
    """How a collector samples, as far as core needs to know (defaults: a collector that says
    nothing)."""

    samples_per_prompt: int = 1     # responses per prompt (``group_id`` groups them)
    max_new_tokens: int = 0         # the response budget in tokens (0: unknown)
    max_prompt_tokens: int = 0      # the prompt budget in tokens (0: unknown)
    budget_args: tuple = ("", "")   # the arguments that hold the prompt and response budgets
    defaults: frozenset = frozenset()  # the arguments left at their defaults: a default prompt
                                    # budget is lowered to fit the context, and messages say so
    context_tokens: int = 0         # the engine's own limit on prompt + response (0: the model's)
    temperature: float = 1.0        # sampling temperature; the trainer divides logits by it (0:
                                    # greedy, scored at 1)
    top_k: int = 0                  # sampling filters (0 and 1.0: off)
    top_p: float = 1.0
    score_truncated: bool = False   # the trainer scores tokens under the same truncated
                                    # distribution (`rlpipe.core.base.truncation`)
    chat_template: bool = False     # the collector wraps text prompts in the chat template
    overlaps_update: bool = False   # ``collect`` may run in a thread while the actor trains: the
                                    # engine holds its own weights (``sync_weights`` alone
                                    # changes them) and computes apart (``rollout.staleness: 1``)
    streams: bool = False           # offers ``converse(requests, on_done)``: multi-turn rows
                                    # each at its own turn (`rlpipe.core.step.multiturn`)

    @property
    def truncation(self) -> Truncation | None:
        """The sampler's `Truncation` when the trainer must score under it: asked for
        (``score_truncated``), a filter on, and sampling (temperature > 0); else None."""
        kept = Truncation(self.top_k, self.top_p)
        return kept if self.score_truncated and kept.active and self.temperature > 0 else None

    def problem(self) -> str | None:
        """What is wrong with these values, or None."""
        counts = ("max_new_tokens", "max_prompt_tokens", "context_tokens", "top_k")
        for name in ("samples_per_prompt", *counts):
            value, low = getattr(self, name), int(name == "samples_per_prompt")
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                return f"{name} must be an integer >= {low}, got {value!r}"
        number = (int, float)
        if not isinstance(self.temperature, number) or not 0 <= self.temperature < math.inf:
            return f"temperature must be >= 0 and finite, got {self.temperature!r}"
        if not isinstance(self.top_p, number) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        return None


@dataclass(frozen=True)
class AdvantageContract:
    """What core needs to know about an advantage estimator (`advantage_contract`).

    The defaults are those of an estimator that declares a contract and changes nothing: a
    critic, no groups, the KL penalty in the reward. One that declares nothing at all gets
    `UNDECLARED` instead (see there why).
    """

    needs_critic: bool = True       # False: no critic is built, the rollout's value is 0
    needs_groups: bool = False      # True: compares a prompt's samples; collector.n < 2 refused
    kl_in: str = "reward"           # where the KL penalty goes unless kl.in says ("reward"|"loss")
    group_normalised: bool = False  # divides each group's scores by their spread: kl.in reward
                                    # refused (the KL noise would become unit-size advantages)
    declared: bool = True           # False: the plugin declared nothing, core chose safe defaults
    needs_turns: bool = False       # True: reads turn_reward; a run without an environment refused

    def problem(self) -> str | None:
        """What is wrong with these values, or None.

        >>> AdvantageContract(needs_critic="False").problem()
        "needs_critic must be True or False, got 'False'"
        """
        for name in ("needs_critic", "needs_groups", "group_normalised", "declared", "needs_turns"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be True or False, got {getattr(self, name)!r}"
        if self.kl_in not in KL_PLACES:
            return f"kl_in must be one of {', '.join(KL_PLACES)}, got {self.kl_in!r}"
        return None


# An advantage that declares nothing: core cannot tell whether it normalises each group's scores,
# so it takes the choice that is right either way. The KL penalty goes in the loss (correct
# whatever the estimator does to the scores; in the reward it is wrong once groups are divided
# by their spread), ``kl.in: reward`` is refused as for a group-normalised estimator, and a
# critic is built (reading no value wastes memory; lacking one it needs would be wrong). It is
# not assumed to compare groups: collector.n stays the user's choice.
UNDECLARED = AdvantageContract(needs_critic=True, needs_groups=False, kl_in="loss",
                               group_normalised=True, declared=False)


@dataclass(frozen=True)
class RewardContract:
    """What core needs to know about a reward (`reward_contract`)."""

    columns: tuple[str, ...] = ()   # dataset columns it reads, checked against the data before
                                    # the first step
    scores_prefixes: bool = False   # its score of a partial response estimates its score of the
                                    # finished one (train.critic_pretrain_rollouts regresses on it)
    check_values: Callable | None = None  # (values, column, where) -> None: refuses unusable
                                    # labels on one line, before any model loads

    def problem(self) -> str | None:
        """What is wrong with these values, or None.

        >>> RewardContract(columns="answer").problem()
        "columns must be a tuple of column names, got 'answer'"
        """
        if not isinstance(self.columns, tuple) or not all(isinstance(c, str) for c in self.columns):
            return f"columns must be a tuple of column names, got {self.columns!r}"
        if not isinstance(self.scores_prefixes, bool):
            return f"scores_prefixes must be True or False, got {self.scores_prefixes!r}"
        if self.check_values is not None and not callable(self.check_values):
            return f"check_values must be a function or None, got {self.check_values!r}"
        return None


@dataclass(frozen=True)
class LossContract:
    """What a loss declares to the trainer; each field's default is what an undeclared loss gets.

    - ``entropy``: what the trainer writes under ``entropy`` in each micro-batch: ``"grad"``
      (differentiable, the default), ``"detached"`` (a metric only: no graph, less memory) or
      ``"none"`` (not computed).
    - ``values``: the loss trains the critic from ``value_pred`` (the current critic's values,
      differentiable), which the trainer writes whenever the run has a critic (default True).
      False with a critic is an error: nothing would train it.
    - ``kl_term``: with ``kl.in: loss`` the loss adds ``loss_kl`` itself
      (`PipelineLoss.kl_penalty`); the trainer first hands it the run's penalty with
      ``set_kl(penalty)`` (a `rlpipe.core.step.kl.KLPenalty`: estimator, clamp, placement and
      this step's coefficient). Default False: the trainer adds the same term itself.
    - ``approx_kl_metric``: the metric (``"group/name"``) that ``train.target_kl`` compares with;
      default None, and ``train.target_kl`` is then an error.
    - ``metrics``: metric name -> reduction (`rlpipe.core.step.loss`); undeclared metrics are
      "token".
    - ``rollout_weights``: the loss multiplies each token's policy-gradient term by
      ``rollout_is_weight`` when the micro-batch carries it (``rollout_correction.mode`` tis or
      mis, `rlpipe.core.step.rollout_correction`). Default False: those modes are then an error.
    - ``critic_terms``: the ``loss_*`` entries that depend on ``value_pred`` and on no actor
      output (``log_prob``, ``entropy``), where no other entry depends on ``value_pred``. With a
      critic of its own (not a shared backbone) the trainer then runs the actor's forward and
      backward first (the rollout's ``value``, detached, standing in for ``value_pred``), and the
      critic's after it (``log_prob`` and ``entropy`` detached): the two models' activations
      are never held at once, and each gets the gradient of the joint backward. Default ():
      one forward of both, one backward.

    >>> LossContract(entropy="maybe")
    Traceback (most recent call last):
    ...
    ValueError: LossContract.entropy must be one of ('grad', 'detached', 'none'), got 'maybe'
    """

    entropy: str = "grad"
    values: bool = True
    kl_term: bool = False
    approx_kl_metric: str | None = None
    metrics: Mapping[str, str] = field(default_factory=dict)
    rollout_weights: bool = False
    critic_terms: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.critic_terms, str) or not all(
                isinstance(k, str) and k.startswith("loss_") for k in self.critic_terms):
            raise ValueError(f"LossContract.critic_terms must be a tuple of loss_* names, "
                             f"got {self.critic_terms!r}")
        if self.entropy not in ENTROPY_MODES:
            raise ValueError(f"LossContract.entropy must be one of {ENTROPY_MODES}, "
                             f"got {self.entropy!r}")
        bad = {k: v for k, v in self.metrics.items() if v not in REDUCTIONS}
        if bad:
            raise ValueError(f"LossContract.metrics: unknown reduction(s) {bad}; "
                             f"choose from {REDUCTIONS}")
        object.__setattr__(self, "metrics", types.MappingProxyType(dict(self.metrics)))

    def reduction(self, name: str) -> str:
        """How metric ``name`` reduces ("token" unless declared)."""
        return self.metrics.get(name, TOKEN)


def _declared(obj, kind: type, args: dict | None, label: str):
    """What ``obj``'s ``contract(**args)`` returns, checked to be a ``kind``; None where it has
    none. An instance given without ``args`` is asked with its attributes named like the
    parameters of ``contract`` (a plugin keeps its arguments as attributes)."""
    with registry.calling(label, "contract"):
        declare = getattr(obj, "contract", None)
        if declare is None:
            return None
        if not callable(declare):
            raise UserError(f"{label}: contract must be a classmethod contract(**args) returning "
                            f"a {kind.__name__}, got {type(declare).__name__}")
        if args is None and not (inspect.isclass(obj) or inspect.isroutine(obj)):
            named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            names = [n for n, p in inspect.signature(declare).parameters.items() if p.kind in named]
            args = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
        contract = declare(**(args or {}))
    if not isinstance(contract, kind):
        raise UserError(f"{label}: contract() must return a {kind.__name__}, got "
                        f"{type(contract).__name__}")
    return contract


def _legacy(obj, kind: type, label: str):
    """The contract from loose attributes named like ``kind``'s fields (deprecated), or None."""
    found = {f.name: getattr(obj, f.name) for f in fields(kind)
             if f.name != "declared" and hasattr(obj, f.name)}
    if not found:
        return None
    warnings.warn(f"{label}: loose attributes {', '.join(found)} are deprecated; declare "
                  f"contract(**args) -> {kind.__name__} (rlpipe.plugin)",
                  DeprecationWarning, stacklevel=3)
    return kind(**found)


def declared_contract(declare, args: dict, label: str, kind: type):
    """What a plugin's ``contract`` (``declare``; None: ``kind()``'s defaults) gives for its
    constructor arguments ``args``, checked: what it raises, a return that is not a ``kind``, or
    values out of range (``kind.problem()``) is one line naming ``label``. Collectors and
    environments declare this way."""
    if declare is None:
        return kind()
    with registry.calling(label, "contract"):
        contract = declare(**args)
    if not isinstance(contract, kind):
        raise UserError(f"{label}: contract() must return a {kind.__name__}, got "
                        f"{type(contract).__name__}")
    problem = contract.problem()
    if problem:
        raise UserError(f"{label}: contract(): {problem}")
    return contract


def _checked(contract, label: str):
    problem = contract.problem()
    if problem:
        raise UserError(f"{label}: {type(contract).__name__}: {problem}")
    return contract


def advantage_contract(obj, args: dict | None = None,
                       label: str | None = None) -> AdvantageContract:
    """The `AdvantageContract` that advantage ``obj`` (a class, a factory or an instance)
    declares for constructor arguments ``args``; `UNDECLARED` where it declares nothing. A
    contract that ``contract`` fails to give, or whose fields have the wrong type, is one line
    naming the plugin (``label``, else its registry label).

    >>> class Legacy:
    ...     needs_critic = "False"
    >>> advantage_contract(Legacy, label="advantage 'mine'")
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: advantage 'mine': AdvantageContract: needs_critic must be True or False, got 'False'
    """
    label = label or registry.label_of(obj)
    contract = (_declared(obj, AdvantageContract, args, label)
                or _legacy(obj, AdvantageContract, label) or UNDECLARED)
    return _checked(contract, label)


def reward_contract(obj, args: dict | None = None, label: str | None = None) -> RewardContract:
    """The `RewardContract` that reward ``obj`` (a class, a factory, an instance, or a wrapped
    reward function, whose ``columns`` come from its signature) declares for ``args``; the
    defaults where it declares nothing.

    >>> def exact(prompts, responses, answer, **batch): ...
    >>> reward_contract(reward_fn.wrap_reward_function(exact))
    RewardContract(columns=('answer',), scores_prefixes=False, check_values=None)
    """
    label = label or registry.label_of(obj)
    cls = obj if inspect.isclass(obj) else type(obj)
    if issubclass(cls, reward_fn.FunctionReward):  # columns from its signature and `columns:`
        columns = obj.columns if obj is not cls else cls.reads((args or {}).get("columns") or {})
        return _checked(RewardContract(columns=tuple(columns)), label)
    contract = (_declared(obj, RewardContract, args, label)
                or _legacy(obj, RewardContract, label) or RewardContract())
    return _checked(contract, label)


def undeclared_notice(label: str, contract: AdvantageContract) -> str | None:
    """The one line that says which defaults core chose for an advantage that declares nothing;
    None for one that declares its contract.

    >>> undeclared_notice("advantage my_adv", advantage_contract(object))
    'advantage my_adv declares no AdvantageContract: treated as kl in the loss, group-normalised, needs a critic; declare `contract` to choose'
    >>> undeclared_notice("advantage gae", AdvantageContract()) is None
    True
    """
    if contract.declared:
        return None
    return (f"{label} declares no AdvantageContract: treated as kl in the {contract.kl_in}, "
            f"{'group-normalised' if contract.group_normalised else 'not group-normalised'}, "
            f"{'needs a critic' if contract.needs_critic else 'no critic'}; "
            f"declare `contract` to choose")


__all__ = ["CollectorContract", "AdvantageContract", "RewardContract", "LossContract",
           "UNDECLARED", "advantage_contract", "reward_contract", "undeclared_notice"]
