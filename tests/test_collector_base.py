"""Tests for the collector base (plugins/collectors/base.py): declared argument checks, padding,
pad/EOS ids, prompt encoding and packing, on a toy engine; hf and vllm declare the shared
arguments as the base does."""

from __future__ import annotations

import inspect
import typing
from types import SimpleNamespace
from typing import Annotated, Literal

import pytest
import torch

from rlpipe.core.base import schema
from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.plugins.collectors.base import (Bound, Collector, Count, Temperature, check_args,
                                            eos_ids, pad_rows)
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.collectors.vllm import VLLMCollector


class Fixed(Collector):
    """Answers every prompt with ``answer`` (token ids), cut to ``max_new_tokens``."""

    name = "fixed"

    def __init__(self, ctx, *, answer: list[int], width: Annotated[int, Bound("in [1, 4]")] = 2,
                 **kwargs):
        self.check_own_args(width=width)
        super().__init__(ctx, **kwargs)
        self.answer, self.calls = answer[:self.max_new_tokens], []

    def generate(self, rows, prompt_ids, prompt_mask):
        self.calls.append((rows, prompt_ids, prompt_mask))
        ids, mask = pad_rows([self.answer] * (len(rows) * self.n), self.pad_id)
        return {schema.RESPONSE_IDS: ids, schema.RESPONSE_MASK: mask,
                schema.FINISHED: torch.tensor([self.answer[-1] in self.eos_ids] * len(ids)),
                "extra": torch.ones(len(ids))}

    def sync_weights(self, model):
        pass


@pytest.mark.parametrize("hint, good, bad, wanted", [
    (Count, [1, 7], [0, 2.5, True, "3"], "an integer >= 1"),
    (Temperature, [0, 0.5, 2], [-0.1, float("nan"), float("inf"), False], ">= 0 (0 = greedy)"),
    (Annotated[float, Bound("in (0, 1]")], [1, 0.5], [0, 1.5], "in (0, 1]"),
    (float, [3, -1.5], [float("nan"), "x"], "a finite number"),
    (bool, [True, False], [0, "yes"], "true or false"),
    (str, ["a"], [1], "a string"),
    (Literal["auto", "float32"], ["auto"], ["fp8", None], "one of 'auto', 'float32'"),
    (list[str] | None, [None, ["a"], ("b", "c")], ["stop", [""], [1]],
     "a list of non-empty strings or null"),
    (Count | None, [None, 3], [0], "an integer >= 1 or null"),
    (int | None, [None, -4], [1.5], "an integer or null"),
])
def test_check_args_follows_the_declared_hint(hint, good, bad, wanted):
    for value in good:
        check_args("toy collector", {"x": value}, {"x": hint})
    for value in bad:
        with pytest.raises(UserError, match="^toy collector: x must be ") as info:
            check_args("toy collector", {"x": value}, {"x": hint})
        assert str(info.value) == f"toy collector: x must be {wanted}, got {value!r}"


def test_check_args_leaves_unknown_hints_alone():
    check_args("toy collector", {"x": object(), "y": 3}, {"x": typing.Sequence[int]})


def test_pad_rows_both_sides_and_dtypes():
    ids, mask = pad_rows([[1, 2, 3], [4]], fill=9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9]] and ids.dtype == torch.long
    assert mask.tolist() == [[True] * 3, [True, False, False]]
    ids, mask = pad_rows([[1], [2, 3]], fill=0, left=True)
    assert ids.tolist() == [[0, 1], [2, 3]] and mask.tolist() == [[False, True], [True, True]]
    values, _ = pad_rows([[0.5], [-1.25, 2.0]], 0.0, dtype=torch.float32)
    assert values.dtype == torch.float32 and values.tolist() == [[0.5, 0.0], [-1.25, 2.0]]
    assert pad_rows([[], []], 7)[0].shape == (2, 0)


def test_eos_ids_from_tokenizer_config_and_generation_config():
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=[5, 2]),
                            generation_config=SimpleNamespace(eos_token_id=7))
    assert eos_ids(SimpleNamespace(eos_token_id=2), model) == [2, 5, 7]
    assert eos_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(config=SimpleNamespace())) == []


def test_packs_prompts_responses_groups_texts_and_extra_keys(ctx, tiny_tokenizer):
    answer = tiny_tokenizer.convert_tokens_to_ids(["red", "blue", "</s>"])
    collector = Fixed(ctx, answer=answer, n=2, max_new_tokens=3)
    batch = collector.collect(["the cat", "hello"])
    assert batch.batch_size == torch.Size([4]) and batch.device.type == ctx.device.type
    cat, hello = tiny_tokenizer("the cat").input_ids, tiny_tokenizer("hello").input_ids
    assert len(cat) == 3 and len(hello) == 2
    assert batch[schema.PROMPT_IDS].tolist() == [cat, cat, [0] + hello, [0] + hello]
    assert batch[schema.PROMPT_MASK][2].tolist() == [False, True, True]
    assert batch[schema.GROUP_ID].tolist() == [0, 0, 1, 1]
    assert batch[schema.FINISHED].all() and batch["extra"].tolist() == [1.0] * 4
    assert list(batch[schema.PROMPT_TEXT]) == ["the cat", "the cat", "hello", "hello"]
    assert list(batch[schema.RESPONSE_TEXT]) == ["red blue"] * 4
    rows, prompt_ids, prompt_mask = collector.calls[0]
    assert rows == [cat, hello] and prompt_ids.shape == prompt_mask.shape == (2, 3)
    assert list(batch.keys())[:6] == [schema.PROMPT_IDS, schema.PROMPT_MASK, schema.RESPONSE_IDS,
                                      schema.RESPONSE_MASK, schema.GROUP_ID, schema.FINISHED]


def test_encoding_chat_template_budget_and_pad_fallback(tiny_model, tiny_tokenizer,
                                                        tiny_tokenizer_no_pad):
    ctx = RunContext(tokenizer=tiny_tokenizer, actor=tiny_model)
    chat = Fixed(ctx, answer=[2], chat_template=True)
    assert chat.encode(["the cat"]) == [tiny_tokenizer("user : the cat assistant :",
                                                       add_special_tokens=False).input_ids]
    short = Fixed(ctx, answer=[2], max_prompt_tokens=2)
    ids = tiny_tokenizer("the big cat").input_ids
    assert short.prompt_budget == 2 and short.encode(["the big cat"]) == [ids[-2:]]
    short.prompt_budget = 1                              # an engine may lower it after start
    assert short.encode(["the big cat"]) == [ids[-1:]]
    no_pad = Fixed(RunContext(tokenizer=tiny_tokenizer_no_pad, actor=tiny_model), answer=[2])
    assert no_pad.pad_id == tiny_tokenizer_no_pad.eos_token_id


def test_a_prompt_cut_to_the_budget_says_so_once(tiny_model, tiny_tokenizer, capsys):
    """It was cut silently: the model then answered a prompt the user never wrote."""
    short = Fixed(RunContext(tokenizer=tiny_tokenizer, actor=tiny_model), answer=[2],
                  max_prompt_tokens=2)
    short.encode(["the cat", "the big cat", "a"])
    err = capsys.readouterr().err.splitlines()
    n = len(tiny_tokenizer("the big cat").input_ids)
    assert err == [f"warning: fixed collector: 2 of 3 prompts are longer than the prompt budget "
                   f"(2 tokens: max_prompt_tokens and the model's context) and keep only their "
                   f"last 2 tokens (the first has {len(tiny_tokenizer('the cat').input_ids)}); "
                   f"shorten them or raise max_prompt_tokens"] and n > 2
    short.encode(["the big cat"])
    assert capsys.readouterr().err == ""  # once per run


def test_declared_attributes_and_defaults(ctx):
    collector = Fixed(ctx, answer=[2], temperature=0.7, max_new_tokens=5, stop_strings=["x"])
    assert (collector.temperature, collector.max_new_tokens, collector.n) == (0.7, 5, 1)
    assert collector.stop_strings == ("x",) and collector.close() is None
    assert collector.label == "fixed collector"


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "fixed collector: n must be an integer >= 1, got 0"),
    (dict(width=5), "fixed collector: width must be an integer in [1, 4], got 5"),
    (dict(min_new_tokens=9, max_new_tokens=8),
     "fixed collector: min_new_tokens must be an integer in [0, max_new_tokens=8], got 9"),
    (dict(stop_strings=[""]), "fixed collector: stop_strings must be a list of non-empty strings"),
    (dict(chat_template="yes"), "fixed collector: chat_template must be true or false"),
])
def test_bad_arguments_name_the_collector(ctx, kwargs, message):
    with pytest.raises(UserError) as info:
        Fixed(ctx, answer=[2], **kwargs)
    assert str(info.value).startswith(message)


def test_base_without_engine_raises_not_implemented(ctx):
    with pytest.raises(NotImplementedError, match="Collector.generate"):
        Collector(ctx).collect(["the cat"])
    with pytest.raises(NotImplementedError, match="Collector.sync_weights"):
        Collector(ctx).sync_weights(ctx.actor)


@pytest.mark.parametrize("cls", [HFCollector, VLLMCollector])
def test_engines_declare_the_shared_arguments_as_the_base(cls):
    base = inspect.signature(Collector).parameters
    own = inspect.signature(cls).parameters
    base_hints = typing.get_type_hints(Collector.__init__, include_extras=True)
    own_hints = typing.get_type_hints(cls.__init__, include_extras=True)
    for name, param in base.items():
        assert own[name].default == param.default and own[name].kind == param.kind, name
        if name != "ctx":
            assert own_hints[name] == base_hints[name], name
    assert all(name in own_hints for name in own if name != "ctx"), "every argument typed"
