"""Reward functions as reward modules: a function in one of three conventions (rlpipe's, TRL's,
verl's) wrapped into an ``nn.Module`` class whose ``forward(td)`` returns a [B] float tensor, or,
where the function said "not applicable" (``None``) or returned verl's dicts, a dict
``{"score": [B], "applies": [B] bool, KEY: [B]}`` (`rlpipe.core.step.rewards.RewardComposer`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings

import torch
from torch import nn

from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError


def batch_texts(td, key) -> list:
    """A non-tensor entry of the batch (``prompt_text``, ``response_text``, a data column) as a
    list; a tensor entry as a list of Python numbers."""
    value = td.get(key)
    return value.tolist() if hasattr(value, "tolist") else list(value)


TRL_ARGS = ("prompts", "completions", "completion_ids")  # TRL's keywords (GRPOTrainer)
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")  # verl's compute_score
VERL_TRUTH = "reward_model.ground_truth"  # verl's parquet layout: a key of the reward_model column
CONVENTIONS = {"rlpipe": "rlpipe's f(prompts, responses, **batch)",
               "trl": "TRL's f(completions, **kwargs)",
               "verl": "verl's compute_score(data_source, solution_str, ground_truth, extra_info)"}
ACCEPTED = ("f(prompts, responses, **batch) (rlpipe), f(completions, **kwargs) with prompts, "
            "completion_ids and dataset columns as keywords (TRL), or "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None) (verl)")


def reward_convention(fn) -> tuple[str, list[inspect.Parameter]]:
    """``(kind, params)``: which convention ``fn`` follows, from its signature -- ``"verl"`` (a
    ``solution_str`` parameter), ``"trl"`` (a ``completions`` parameter), ``"rlpipe"`` (two
    positional parameters first) -- and its parameters beyond that convention's own. Anything
    else is one line naming the accepted signatures.

    >>> reward_convention(lambda completions, **kwargs: [])[0]
    'trl'
    >>> reward_convention(lambda data_source, solution_str, ground_truth, extra_info=None: 0)[0]
    'verl'
    >>> reward_convention(lambda text: 0)
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: reward function <lambda>(text) fits no accepted signature: f(prompts, responses, **batch) (rlpipe), f(completions, **kwargs) with prompts, completion_ids and dataset columns as keywords (TRL), or compute_score(data_source, solution_str, ground_truth, extra_info=None) (verl)
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise UserError(f"reward function {name} has no readable signature; accepted: "
                        f"{ACCEPTED}") from None
    params = list(sig.parameters.values())
    names = {p.name for p in params}
    if "solution_str" in names:
        return "verl", [p for p in params if p.name not in VERL_ARGS]
    if "completions" in names:
        return "trl", [p for p in params if p.name not in TRL_ARGS]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 and positional[:2] == params[:2]:
        return "rlpipe", params[2:]
    raise UserError(f"reward function {name}{sig} fits no accepted signature: {ACCEPTED}")


def column_values(columns: dict[str, list], name: str) -> list | None:
    """The values of the column ``name``; for ``COLUMN.KEY`` (verl's ``reward_model.ground_truth``)
    the column ``KEY`` where there is one, else each row's ``KEY`` in the dicts of ``COLUMN``;
    None where the data has neither.

    >>> column_values({"reward_model": [{"ground_truth": "4"}]}, "reward_model.ground_truth")
    ['4']
    >>> column_values({"answer": ["4"]}, "answer"), column_values({}, "answer")
    (['4'], None)
    """
    outer, _, key = name.rpartition(".")
    if name in columns or not outer:
        return columns.get(name)
    if key in columns:
        return columns[key]
    if outer in columns:
        return [row.get(key) if isinstance(row, dict) else None for row in columns[outer]]
    return None


def _columns(td) -> dict[str, list]:
    if schema.DATA not in td.keys():
        return {}
    return {k: batch_texts(td, (schema.DATA, k)) for k in td.get(schema.DATA).keys()}


def _number(name: str, x, where: str):
    """``x`` as a float, or None (not applicable); anything else is one line."""
    if x is None:
        return None
    if isinstance(x, (str, bytes)) or not isinstance(x, (numbers.Real, torch.Tensor)) or (
            isinstance(x, torch.Tensor) and x.numel() != 1):
        raise UserError(f"reward function {name} returned {x!r:.40} {where}; expected a number "
                        f"(None: not applicable)")
    return float(x)


def scores(name: str, out, n: int) -> list:
    """A function's result for ``n`` samples as floats (None: not applicable): a sequence of ``n``
    numbers; a dict, a string or another length is one line.

    >>> scores("f", [1, None, True], 3)
    [1.0, None, 1.0]
    >>> scores("f", "101", 3)
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: reward function f returned a str; expected a list of 3 numbers, one per sample (None: not applicable)
    """
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise UserError(f"reward function {name} returned a {type(out).__name__}; expected a list "
                        f"of {n} numbers, one per sample (None: not applicable)")
    if len(out) != n:
        raise UserError(f"reward function {name} returned {len(out)} values for {n} samples; "
                        f"expected one number per sample")
    return [_number(name, x, f"for sample {i}") for i, x in enumerate(out)]


def _verl_result(name: str, results: list) -> tuple[list, dict[str, list]]:
    """verl's per-sample results: numbers, None, or dicts whose ``score`` is the reward and whose
    other numeric keys are kept (``{key: values}``), as verl's reward manager keeps them."""
    values, extras, keys = [], {}, None
    for i, result in enumerate(results):
        if not isinstance(result, dict):
            values.append(_number(name, result, f"for sample {i}"))
            continue
        if "score" not in result:
            raise UserError(f"reward function {name} returned a dict without 'score' for sample "
                            f"{i} (keys: {', '.join(map(str, result))}); verl's dicts hold the "
                            f"reward under 'score'")
        values.append(_number(name, result["score"], f"under 'score' for sample {i}"))
        mine = [k for k, v in result.items() if k != "score" and isinstance(v, numbers.Real)]
        if keys is not None and mine != keys:
            raise UserError(f"reward function {name} returned dicts with different numeric keys: "
                            f"{', '.join(keys)} before sample {i}, {', '.join(mine) or 'none'} "
                            f"there")
        keys = mine
        for k in mine:
            extras.setdefault(k, []).append(float(result[k]))
    if extras and len(next(iter(extras.values()))) != len(values):
        raise UserError(f"reward function {name} returned a dict for some samples and a number "
                        f"for others")
    return values, extras


class FunctionReward(nn.Module):
    """A reward function as a reward module. `wrap_reward_function` makes one subclass per
    function: its settings (keyword parameters with a default) are the constructor's keywords,
    and ``columns`` maps a parameter to a data column of another name (``{ground_truth: answer}``).
    An instance's ``columns`` are the data columns it reads (``COLUMN.KEY``: a key of a dict column,
    or a column named ``KEY``: `column_values`)."""

    fn = None              # the function (a staticmethod of the subclass)
    convention = "rlpipe"  # rlpipe, trl or verl (`reward_convention`)
    own = ()               # the convention's inputs that are not columns (prompts, solution_str)
    named = ()             # its other named parameters: columns, or settings (with a default)
    required = ()          # those without a default: columns it reads
    takes_any = False      # it takes ``**kwargs`` (rlpipe, TRL: every column reaches it)
    columns = ()           # the columns it reads without a mapping

    def __init__(self, columns: dict | None = None, **kwargs):
        super().__init__()
        if "columns" in self.named:  # the function's own setting named columns: no mapping
            if columns is not None:
                kwargs = {**kwargs, "columns": columns}
            columns = None
        self.kwargs, self.warned = kwargs, set()
        self.columns = type(self).reads(columns or {})
        self.mapping = self._mapping(columns or {})

    @classmethod
    def reads(cls, mapping: dict) -> tuple[str, ...]:
        """The columns read under ``mapping``: required parameters', verl's ``ground_truth``
        (`VERL_TRUTH` unless mapped), the mapped ones."""
        if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in mapping.items()):
            raise UserError(f"reward function {cls.fn.__name__}: columns maps parameters to "
                            f"column names ({{ground_truth: answer}}); got {mapping!r}")
        names = [mapping.get(p, p) for p in cls.required]
        if cls.convention == "verl":
            names.append(mapping.get("ground_truth", VERL_TRUTH))
        return tuple(dict.fromkeys(names + list(mapping.values())))

    def _mapping(self, mapping) -> dict[str, str]:
        name = self.fn.__name__
        verl = ("data_source", "ground_truth", "extra_info") if self.convention == "verl" else ()
        for param, column in mapping.items():
            if param in self.kwargs:
                raise UserError(f"reward function {name}: the config sets {param} and columns "
                                f"maps it to the column {column!r}; keep one")
            if param in self.own or not (param in self.named or param in verl or (
                    self.takes_any and self.convention != "verl")):
                accepted = ", ".join([*self.named, *verl]) or "none"
                raise UserError(f"reward function {name}: columns maps {param}, which is not a "
                                f"parameter it reads a column into; parameters: {accepted}")
        return dict(mapping)

    def _inputs(self, columns: dict[str, list]) -> dict[str, list]:
        """``{parameter: values}``: the columns that reach the function (every column where it
        takes ``**kwargs``, else those named like a parameter), the mapped ones under their
        parameter; a setting the config sets keeps its value (one warning line)."""
        name, verl = self.fn.__name__, self.convention == "verl"
        wanted = set(self.named) | ({"data_source", "ground_truth", "extra_info"} if verl
                                    else set())
        got = {c: v for c, v in columns.items()
               if c not in self.own and (c in wanted or (self.takes_any and not verl))}
        for param, column in self.mapping.items():
            got[param] = column_values(columns, column)
            if got[param] is None:
                raise UserError(f"reward function {name}: columns maps {param} to the column "
                                f"{column!r}, which the data does not have; columns: "
                                f"{', '.join(columns) or 'none'}")
        if verl and "ground_truth" not in got:
            got["ground_truth"] = column_values(columns, VERL_TRUTH)
            if got["ground_truth"] is None:
                raise UserError(f"reward function {name} (verl's compute_score) needs a dataset "
                                f"column ground_truth, or reward_model with a ground_truth key "
                                f"(or columns: {{ground_truth: COLUMN}})")
        for param in [p for p in got if p in self.kwargs]:
            if param not in self.warned:
                self.warned.add(param)
                warnings.warn(f"reward function {name}: the config sets {param}="
                              f"{self.kwargs[param]!r}, so the data column {param!r} does not "
                              f"reach it (the config wins)", stacklevel=2)
            del got[param]
        return got

    def _call(self, td, inputs: dict[str, list]):
        """The function's result for the batch (verl's: a list of per-sample results)."""
        fn, wanted = self.fn, set(inspect.signature(self.fn).parameters)
        responses = batch_texts(td, schema.RESPONSE_TEXT)
        if self.convention == "verl":
            inputs.setdefault("data_source", [None] * len(responses))
            return [fn(solution_str=r, **{k: v[i] for k, v in inputs.items() if k in wanted},
                       **self.kwargs) for i, r in enumerate(responses)]
        if self.convention == "trl":
            prompts, completions = batch_texts(td, schema.PROMPT_TEXT), responses
            if schema.PROMPT_MESSAGES in td.keys():  # a chat dataset: message lists, as TRL
                prompts = batch_texts(td, schema.PROMPT_MESSAGES)
                completions = [[{"role": "assistant", "content": r}] for r in responses]
            ids = [row[m].tolist() for row, m in zip(td.get(schema.RESPONSE_IDS),
                                                     td.get(schema.RESPONSE_MASK))]
            args = {**inputs, "prompts": prompts, "completions": completions, "completion_ids": ids}
            return fn(**{k: v for k, v in args.items() if self.takes_any or k in wanted},
                      **self.kwargs)
        skip = {schema.PROMPT_TEXT, schema.RESPONSE_TEXT, schema.DATA, *self.kwargs, *self.own}
        args = {**{k: td.get(k) for k in td.keys() if k not in skip}, **inputs}
        return fn(batch_texts(td, schema.PROMPT_TEXT), responses,
                  **{k: v for k, v in args.items() if self.takes_any or k in wanted}, **self.kwargs)

    def forward(self, td):
        name, n = self.fn.__name__, td.batch_size[0]
        out = self._call(td, self._inputs(_columns(td)))
        values, extras = (_verl_result(name, out) if self.convention == "verl"
                          else (scores(name, out, n), {}))
        score = torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float32)
        if None not in values and not extras:
            return score
        result = {"score": score, **{k: torch.tensor(v, dtype=torch.float32)
                                     for k, v in extras.items()}}
        if None in values:
            result["applies"] = torch.tensor([v is not None for v in values])
        return result

    def describe(self, label: str) -> str:
        """One line: the function, its convention, the columns it reads."""
        mapped = {c: p for p, c in self.mapping.items()}
        reads = [f"{c} (as {mapped[c]})" if mapped.get(c, c) != c else c for c in self.columns]
        return (f"reward {label!r}: {self.fn.__name__}, {CONVENTIONS[self.convention]}; reads "
                f"{'columns ' + ', '.join(reads) if reads else 'no column'}")


def describe_reward(label: str, module, columns=()) -> str:
    """The line a run prints and records for each reward: a function's convention and the
    columns it reads; a reward module's class and its declared ``columns``.

    >>> def exact(prompts, responses, answer, **batch):
    ...     return [float(r == a) for r, a in zip(responses, answer)]
    >>> describe_reward("exact", wrap_reward_function(exact)())
    "reward 'exact': exact, rlpipe's f(prompts, responses, **batch); reads columns answer"
    >>> def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ...     return float(ground_truth in solution_str)
    >>> describe_reward("math", wrap_reward_function(compute_score)(columns={"ground_truth": "answer"}))
    "reward 'math': compute_score, verl's compute_score(data_source, solution_str, ground_truth, extra_info); reads columns answer (as ground_truth)"
    """
    if isinstance(module, FunctionReward):
        return module.describe(label)
    reads = f"columns {', '.join(columns)}" if columns else "no column"
    return f"reward {label!r}: {type(module).__name__}, a reward module; reads {reads}"


def wrap_reward_function(fn) -> type[FunctionReward]:
    """Turn a reward function into a reward module class (a `FunctionReward`). Three
    conventions, told apart by the signature (`reward_convention`) when the function is loaded:

    - rlpipe's ``fn(prompts, responses, **batch)``: the batch's other top-level entries
      (``response_mask``, ...) and every dataset column as a list under its own name
      (``answer=[...]``). A column named like a batch entry shadows that entry here;
    - TRL's ``fn(completions, **kwargs)``: keywords ``prompts``, ``completions`` (for a chat
      dataset, message lists: ``[{"role": "assistant", "content": ...}]``), ``completion_ids``
      and the dataset columns, as TRL's ``GRPOTrainer`` passes them;
    - verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, called
      once per sample with the columns of those names (``ground_truth`` may sit in verl's
      ``reward_model`` column); a dict result's ``"score"`` is the reward, its other numeric keys
      are logged (``reward/<label>/<key>``).

    A parameter without a default names a column it reads; one with a default is a config key,
    and receives the column of its name where the config does not set it. ``None`` for a sample
    means "not applicable" (TRL's meaning: it adds nothing to that sample's score).

    >>> from tensordict import TensorDict, NonTensorStack
    >>> def exact(prompts, responses, answer, **batch):
    ...     return [float(r == a) for r, a in zip(responses, answer)]
    >>> Reward = wrap_reward_function(exact)
    >>> Reward.columns
    ('answer',)
    >>> td = TensorDict({"prompt_text": NonTensorStack("q", "q"),
    ...                  "response_text": NonTensorStack("4", "5"),
    ...                  ("data", "answer"): NonTensorStack("4", "4")}, batch_size=[2])
    >>> Reward()(td)
    tensor([1., 0.])
    """
    kind, params = reward_convention(fn)
    sig = inspect.signature(fn)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    config_params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in named
                     if p.default is not p.empty]
    own = {"verl": ("solution_str",), "trl": TRL_ARGS}.get(kind, tuple(sig.parameters)[:2])
    attrs = {"fn": staticmethod(fn), "convention": kind, "own": own,
             "named": tuple(p.name for p in named),
             "required": tuple(p.name for p in named if p.default is p.empty),
             "takes_any": any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()),
             "__doc__": fn.__doc__, "__module__": fn.__module__,
             "__qualname__": fn.__name__}
    cls = type(fn.__name__, (FunctionReward,), attrs)
    cls.columns = cls.reads({})
    mapping = [] if "columns" in attrs["named"] else [inspect.Parameter(
        "columns", inspect.Parameter.KEYWORD_ONLY, default=None)]
    cls.__signature__ = inspect.Signature(config_params + mapping)
    return cls
