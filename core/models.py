"""The models of a PPO run: actor, critic (backbone + scalar value head), frozen reference.

And the one forward used for every log-prob and value over a batch: prompt (left-padded) and
response (right-padded) concatenated, ``position_ids = cumsum(mask) - 1``, arguments by keyword,
logits divided by the sampling temperature, the first response token scored from the last prompt
position.

>>> import torch, transformers
>>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
>>> actor = transformers.LlamaForCausalLM(cfg).eval()
>>> ids, mask = torch.tensor([[0, 5, 6]]), torch.tensor([[False, True, True]])
>>> logp, ent = response_logprobs(actor, ids, mask, torch.tensor([[7, 8]]), torch.ones(1, 2, dtype=torch.bool))
>>> logp.shape, ent is None
(torch.Size([1, 2]), True)
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import torch
from torch import nn

from rlpipe.core.errors import UserError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_model_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face model folder (no config.json)")
    try:
        json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path / 'config.json'}: invalid JSON: {exc}") from exc


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot load the tokenizer: {exc}") from exc


def load_causal_lm(path: Path, init: str = "pretrained", dtype: str = "float32"):
    """A causal LM from a local folder: pretrained weights, or fresh weights from its config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_model_dir(path)
    try:
        if init == "random":
            config = AutoConfig.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_DTYPES[dtype])
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot load the model: {exc}") from exc
    return model.eval()  # eval always: no dropout, so the on-policy ratio is exactly 1


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head: ``values[b, t] = head(hidden[b, t])``."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_actor(cls, actor, shared: bool = False) -> "ValueModel":
        """A critic on the actor's backbone: a copy (the common RLHF choice), or with ``shared``
        the very same modules (LoRA adapters included), trained by the combined loss."""
        base = actor.get_base_model() if hasattr(actor, "get_base_model") else actor
        backbone = base.base_model if shared else copy.deepcopy(base.base_model)
        return cls(backbone, base.config.hidden_size).to(next(actor.parameters()).dtype)

    @classmethod
    def from_pretrained(cls, path: Path, init: str = "pretrained") -> "ValueModel":
        from transformers import AutoConfig, AutoModel

        _check_model_dir(path)
        try:
            if init == "random":
                backbone = AutoModel.from_config(AutoConfig.from_pretrained(str(path)))
            else:
                backbone = AutoModel.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: cannot load the critic backbone: {exc}") from exc
        return cls(backbone, backbone.config.hidden_size)

    def forward(self, input_ids, attention_mask, position_ids):
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state).squeeze(-1).float()


def frozen_copy(model: nn.Module) -> nn.Module:
    """A detached, eval-mode, grad-free copy (the reference policy)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def _joined(prompt_ids, prompt_mask, response_ids, response_mask):
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


def _accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM (under a peft wrapper, its base model) takes ``logits_to_keep``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, without a second full-vocab softmax copy."""
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - logz)
    return (logz.squeeze(-1) - (probs * logits).sum(-1))


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0, with_entropy: bool = False):
    """log pi(a_t|s_t) for each response token, [B, R] float32 (0 on padding), and optionally
    the per-token entropy. Temperature 0 (greedy sampling) scores with temperature 1."""
    ids, mask, pos = _joined(prompt_ids, prompt_mask, response_ids, response_mask)
    R = response_ids.shape[1]
    kwargs = {"logits_to_keep": R + 1} if _accepts_logits_to_keep(model) else {}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                   **kwargs).logits
    logits = logits[:, -(R + 1):-1].float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    logp = logp * response_mask
    entropy = entropy_from_logits(logits) * response_mask if with_entropy else None
    return logp, entropy


def response_values(critic: ValueModel, prompt_ids, prompt_mask, response_ids, response_mask):
    """V(s_t) for each response token (the state before token t is produced), [B, R], 0 on padding."""
    ids, mask, pos = _joined(prompt_ids, prompt_mask, response_ids, response_mask)
    R = response_ids.shape[1]
    values = critic(input_ids=ids, attention_mask=mask, position_ids=pos)
    return values[:, -(R + 1):-1] * response_mask
