"""Reward functions as reward modules: ``f(prompts, responses, **batch) -> Sequence[float]``
wrapped into an ``nn.Module`` class whose ``forward(td)`` returns a [B] float tensor.
"""

from __future__ import annotations

import inspect

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


def _columns(td) -> dict[str, list]:
    if schema.DATA not in td.keys():
        return {}
    return {k: batch_texts(td, (schema.DATA, k)) for k in td.get(schema.DATA).keys()}


def _trl_kwargs(td) -> dict:
    """TRL's keyword arguments: prompts and completions (message lists for a chat dataset),
    completion token ids, the dataset columns."""
    prompts, responses = batch_texts(td, schema.PROMPT_TEXT), batch_texts(td, schema.RESPONSE_TEXT)
    completions = responses
    if schema.PROMPT_MESSAGES in td.keys():
        prompts = batch_texts(td, schema.PROMPT_MESSAGES)
        completions = [[{"role": "assistant", "content": r}] for r in responses]
    ids = [row[m].tolist() for row, m in zip(td.get(schema.RESPONSE_IDS),
                                             td.get(schema.RESPONSE_MASK))]
    return {**_columns(td), "prompts": prompts, "completions": completions, "completion_ids": ids}


def _verl_scores(fn, td, kwargs: dict) -> list:
    """verl's ``compute_score`` per sample: ``ground_truth`` from the column of that name or
    from ``reward_model["ground_truth"]`` (verl's parquet layout); a dict result gives its
    ``"score"``."""
    columns, responses = _columns(td), batch_texts(td, schema.RESPONSE_TEXT)
    truth = columns.get("ground_truth")
    if truth is None and "reward_model" in columns:
        truth = [rm.get("ground_truth") if isinstance(rm, dict) else None
                 for rm in columns["reward_model"]]
    if truth is None:
        raise UserError(f"reward function {fn.__name__} (verl's compute_score) needs a dataset "
                        f"column ground_truth, or reward_model with a ground_truth key")
    none = [None] * len(responses)
    wanted = {p for p in inspect.signature(fn).parameters}
    out = []
    for i, response in enumerate(responses):
        args = {"data_source": columns.get("data_source", none)[i], "solution_str": response,
                "ground_truth": truth[i], "extra_info": columns.get("extra_info", none)[i]}
        score = fn(**{k: v for k, v in args.items() if k in wanted}, **kwargs)
        out.append(score["score"] if isinstance(score, dict) else score)
    return out


def _rlpipe_scores(fn, td, kwargs: dict, defaults: dict):
    """rlpipe's convention: ``fn(prompts, responses, **batch)`` with the batch's top-level
    entries and the dataset columns; a column named like one of ``fn``'s settings is refused."""
    skip = {schema.PROMPT_TEXT, schema.RESPONSE_TEXT, schema.DATA, *kwargs}
    batch = {k: td.get(k) for k in td.keys() if k not in skip}
    columns = _columns(td)
    shadowing = [c for c in columns if c in defaults]
    if shadowing:  # it would replace the setting's value silently
        c = shadowing[0]
        raise UserError(f"reward function {fn.__name__}: the data column {c!r} has the name of "
                        f"its setting {c} (default {defaults[c]!r}); rename the column or the "
                        f"parameter")
    batch.update(columns)
    return fn(batch_texts(td, schema.PROMPT_TEXT), batch_texts(td, schema.RESPONSE_TEXT),
              **batch, **kwargs)


def wrap_reward_function(fn) -> type[nn.Module]:
    """Turn a reward function into a reward module class. Three conventions, told apart by the
    signature (`reward_convention`) when the function is loaded:

    - rlpipe's ``fn(prompts, responses, **batch) -> Sequence[float]``: the batch's other
      top-level entries (``response_mask``, ...) and every dataset column as a list under its
      own name (``answer=[...]``), so ``fn`` must take ``**batch``. A column named like a batch
      entry shadows that entry here; reward modules read both (``td["data", name]``);
    - TRL's ``fn(completions, **kwargs)``: keywords ``prompts``, ``completions`` (for a chat
      dataset, message lists: ``[{"role": "assistant", "content": ...}]``), ``completion_ids``
      and the dataset columns, as TRL's ``GRPOTrainer`` passes them;
    - verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, called
      once per sample with the columns of those names (``ground_truth`` may sit in verl's
      ``reward_model`` column); a dict result gives its ``"score"``.

    Keyword parameters beyond the convention's own that have a default become config keys;
    those without one name the dataset columns it reads (declared as ``columns``, so a missing
    column is an error before the first step).

    >>> import torch
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
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    config_params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in named
                     if p.default is not p.empty]
    defaults = {p.name: p.default for p in config_params}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    wanted = set(inspect.signature(fn).parameters)

    class FunctionReward(nn.Module):
        columns = tuple(p.name for p in named if p.default is p.empty)
        convention = kind

        def __init__(self, **kwargs):
            super().__init__()
            self.kwargs = kwargs

        def forward(self, td):
            if kind == "verl":
                out = _verl_scores(fn, td, self.kwargs)
            elif kind == "trl":
                args = {k: v for k, v in _trl_kwargs(td).items()
                        if (takes_any or k in wanted) and k not in self.kwargs}
                out = fn(**args, **self.kwargs)
            else:
                out = _rlpipe_scores(fn, td, self.kwargs, defaults)
            try:
                return torch.as_tensor([float(x) for x in out], dtype=torch.float32)
            except (TypeError, ValueError) as exc:
                raise UserError(f"reward function {fn.__name__} must return numbers: {exc}") from exc

    FunctionReward.__signature__ = inspect.Signature(config_params)
    FunctionReward.__name__ = FunctionReward.__qualname__ = fn.__name__
    FunctionReward.__doc__ = fn.__doc__
    FunctionReward.__module__ = fn.__module__
    return FunctionReward
