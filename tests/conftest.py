"""Shared test fixtures: a tiny in-memory tokenizer, a tiny Llama and a `RunContext`.

Fixtures (all function-scoped, built in milliseconds, no downloads):

- ``tiny_tokenizer``: word-level `PreTrainedTokenizerFast` over `WORDS`, specials ``<pad>``=0,
  ``<s>``=1 (prepended to every encoding), ``</s>``=2 (EOS), ``<unk>``=3; pad != eos; padding side
  right; a chat template ``"user : ... assistant : "``. Decoding joins words with spaces.
- ``tiny_tokenizer_pad_eos``: the same vocabulary with pad == eos (``</s>``), like Llama checkpoints.
- ``tiny_tokenizer_no_pad``: the same vocabulary with no pad token at all.
- ``tiny_model``: seeded random `LlamaForCausalLM` (hidden 32, 2 layers, 4 heads, 2 kv heads,
  intermediate 64, untied head), vocab = ``len(tiny_tokenizer)``, in eval mode.
- ``ctx``: `RunContext(tokenizer=tiny_tokenizer, actor=tiny_model, max_new_tokens=8)` on CPU.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlpipe.core.context import RunContext

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ("the a cat dog sat ran on under mat rug and big small red blue green one two three four "
         "is was hello world stop user assistant : .").split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def build_tokenizer(pad_token: str | None = "<pad>") -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `WORDS`; ``pad_token=None`` gives one without a pad token.

    >>> build_tokenizer()("the cat").input_ids
    [1, 4, 6]
    """
    vocab = {word: i for i, word in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token=pad_token)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture
def tiny_tokenizer_pad_eos() -> PreTrainedTokenizerFast:
    return build_tokenizer(pad_token="</s>")


@pytest.fixture
def tiny_tokenizer_no_pad() -> PreTrainedTokenizerFast:
    return build_tokenizer(pad_token=None)


@pytest.fixture
def tiny_model(tiny_tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def ctx(tiny_tokenizer, tiny_model) -> RunContext:
    return RunContext(tokenizer=tiny_tokenizer, actor=tiny_model, device=torch.device("cpu"),
                      max_new_tokens=8)
