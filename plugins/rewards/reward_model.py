"""Neural reward: a frozen Hugging Face sequence classifier with one output scores prompt+response.

The reward model brings its own tokenizer, which may differ from the policy's. Each sample is
written with the tokenizer's chat template when it has one (user = prompt, assistant = response),
else as the plain concatenation ``prompt + response``; ``rlpipe train-rm`` trains with exactly this
formatting (`rm_inputs`). Sequences are right-padded, so a causal classifier (which reads the last
non-pad token) sees the same positions in any batch, and cut to ``max_length`` tokens on the
tokenizer's ``truncation_side``.

Config keys: ``path`` (a model folder, e.g. the output of ``rlpipe train-rm``), ``batch_size``
(16 sequences per forward), ``max_length`` (512), ``dtype`` (``float32`` or ``bfloat16``),
``offload`` (false; true: the model waits on CPU and moves to the run's device only to score),
``trust_remote_code`` (false: a folder that brings its own code, ``auto_map``, is refused)::

    rewards:
      - {name: reward_model, path: runs/reward_model, weight: 1.0}
      - {name: length, max_tokens: 200}
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from rlpipe.core.base.hub import find_model
from rlpipe.core.base.model_files import check_finite, check_model_dir, check_weights, loading
from rlpipe.core.models.lm import load_tokenizer
from rlpipe.plugin import (PROMPT_TEXT, RESPONSE_TEXT, ModelPath, RewardContract, RunContext,
                           UserError, batch_texts)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_rm_tokenizer(path: Path, trust_remote_code: bool = False,
                      setting: str = "the reward_model argument trust_remote_code"):
    """The reward model's tokenizer, right-padded; with no pad token it pads with EOS (or UNK)."""
    tokenizer = load_tokenizer(path, trust_remote_code, setting)
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise UserError(f"{path}: the tokenizer has no pad, eos or unk token to pad with")
        tokenizer.pad_token = fallback
    tokenizer.padding_side = "right"
    return tokenizer


def rm_inputs(tokenizer, prompts: list[str], responses: list[str], max_length: int):
    """Tokenized prompt+response pairs (``input_ids``, ``attention_mask``), right-padded.

    With a chat template the text is ``[user: prompt, assistant: response]`` and special tokens
    are added only when the template does not already start with BOS; without one it is
    ``prompt + response`` with the tokenizer's usual special tokens.
    """
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p},
                                                {"role": "assistant", "content": r}], tokenize=False)
                 for p, r in zip(prompts, responses)]
        bos = tokenizer.bos_token
        special = not (bos and texts and texts[0].startswith(bos))
    else:
        texts, special = [p + r for p, r in zip(prompts, responses)], True
    return tokenizer(texts, add_special_tokens=special, padding=True, truncation=True,
                     max_length=max_length, return_tensors="pt", return_token_type_ids=False)


@torch.no_grad()
def score_texts(model, tokenizer, prompts: list[str], responses: list[str], batch_size: int = 16,
                max_length: int = 512) -> torch.Tensor:
    """[N] float32 scores of a one-output classifier, on the model's device, in micro-batches."""
    device = next(model.parameters()).device
    scores = [torch.zeros(0, device=device)]
    for i in range(0, len(prompts), batch_size):
        enc = rm_inputs(tokenizer, prompts[i:i + batch_size], responses[i:i + batch_size], max_length)
        scores.append(model(**enc.to(device)).logits[:, 0].float())
    return torch.cat(scores)


def load_classifier(path: Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                    setting: str = "the reward_model argument trust_remote_code"):
    """A frozen, eval-mode ``AutoModelForSequenceClassification`` with exactly one output; the
    folder is checked first (`rlpipe.core.base.model_files`) and any load error is one line."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"reward_model: {path}: not a Hugging Face model folder (no config.json)")
    check_model_dir(path, trust_remote_code, setting)
    check_weights(path)
    remote = {"trust_remote_code": trust_remote_code}
    with loading(path, "the reward model"):
        config = AutoConfig.from_pretrained(str(path), **remote)
        kinds = config.architectures or []
        if kinds and not any("SequenceClassification" in k for k in kinds):
            raise UserError(f"reward_model: {path} is a {', '.join(kinds)}, not a sequence "
                            f"classifier with one output (train one with `rlpipe train-rm`)")
        if config.num_labels != 1:
            raise UserError(f"reward_model: {path}: the classifier has num_labels="
                            f"{config.num_labels}; a reward model needs exactly one output (train "
                            f"one with `rlpipe train-rm`)")
        model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=dtype, **remote)
    check_finite(model, path)
    return model.requires_grad_(False).eval()


class RewardModel(nn.Module):
    """Reward component: reads ``prompt_text`` and ``response_text``, returns [B] float32 scores.

    The classifier is deliberately not a registered submodule: it stays out of ``state_dict()``
    (checkpoints hold no frozen copy of it) and out of ``.to()`` (``offload`` decides where it
    lives). Scores come back on the batch's device.

    Args:
        path: a save_pretrained one-output sequence-classification folder (rlpipe train-rm writes one), pkg:NAME or Hub ID
        batch_size: texts per forward
        max_length: tokens per prompt + response (longer ones are cut)
        dtype: float32 or bfloat16
        offload: keep on CPU between uses on a GPU
        trust_remote_code: allow the folder's own Python code (auto_map)
    """

    in_keys = [PROMPT_TEXT, RESPONSE_TEXT]

    @classmethod
    def contract(cls, **args) -> RewardContract:
        """Its score of a partial response says how the response is going (scores_prefixes)."""
        return RewardContract(scores_prefixes=True)

    def __init__(self, path: ModelPath, *, batch_size: int = 16, max_length: int = 512,
                 dtype: Literal["float32", "bfloat16"] = "float32", offload: bool = False,
                 trust_remote_code: bool = False, ctx: RunContext | None = None):
        super().__init__()
        if batch_size < 1 or max_length < 1:
            raise UserError(f"reward_model: batch_size and max_length must be >= 1, "
                            f"got {batch_size} and {max_length}")
        if dtype not in _DTYPES:
            raise UserError(f"reward_model: dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        path = find_model(path, "reward_model: path")  # a folder, or a Hub ID from Python
        if not path.is_dir():
            raise UserError(f"reward_model: model folder not found: {path}")
        self.batch_size, self.max_length = batch_size, max_length
        self.device = ctx.device if ctx is not None else torch.device("cpu")
        self.home = torch.device("cpu") if offload else self.device
        model = load_classifier(path, _DTYPES[dtype], trust_remote_code)
        self.tokenizer = load_rm_tokenizer(path, trust_remote_code)
        model.config.pad_token_id = self.tokenizer.pad_token_id
        object.__setattr__(self, "classifier", model.to(self.home))  # unregistered, see above

    def forward(self, td) -> torch.Tensor:
        prompts, responses = batch_texts(td, PROMPT_TEXT), batch_texts(td, RESPONSE_TEXT)
        model = self.classifier.to(self.device)  # a no-op unless offloaded
        try:
            scores = score_texts(model, self.tokenizer, prompts, responses, self.batch_size,
                                 self.max_length)
        finally:
            model.to(self.home)
        return scores.to(td.device or "cpu")
