"""LoRA passes without the adapters' extra matmuls.

A peft LoRA linear layer computes ``W x + s B (A x)``: one large matmul and two small ones, plus
the Python of three modules, for every layer and every token. In a pass without gradients (the
rollout's ``generate``, the scoring forwards) `merged_weights` computes ``(W + s B A) x`` in one
matmul instead. The frozen base is swapped for a merged copy and put back on exit, bit for bit:
peft's own ``merge_adapter`` / ``unmerge_adapter`` add and subtract in place, so the frozen base
weights (and with them the reference policy, the adapter-disabled actor) would drift by round-off
every step. The outputs equal the unmerged ones within float round-off. Only the layers of models
passed to `allow_merging` are merged (``models.*.lora.merged_passes``, on by default). rlpipe
merges in the HF collector's ``generate`` only: the trainer's old log-probs stay those of the
update's own forward, so the first PPO ratio stays exactly 1.

>>> import torch, transformers
>>> from peft import LoraConfig, get_peft_model
>>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
>>> _ = torch.manual_seed(0)
>>> model = allow_merging(get_peft_model(transformers.LlamaForCausalLM(cfg),
...                        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)))
>>> ids, base = torch.tensor([[1, 2, 3]]), model.base_model.model.model.layers[0].mlp.up_proj
>>> before = base.base_layer.weight.clone()
>>> with torch.no_grad():
...     plain = model(input_ids=ids).logits
...     with merged_weights(model) as n:
...         merged = model(input_ids=ids).logits
>>> n, torch.allclose(plain, merged, atol=1e-5), torch.equal(base.base_layer.weight, before)
(7, True, True)
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

# layer -> its merged weight, kept between blocks: a fresh [out, in] buffer per layer and step
# costs more in page faults (hundreds of MB) than the matmuls it saves.
_BUFFERS: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()
_ALLOWED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()   # layers `merged_weights` may merge


def allow_merging(model: nn.Module) -> nn.Module:
    """Let `merged_weights` merge the LoRA linear layers of ``model`` (returned)."""
    _ALLOWED.update(m for m in model.modules() if _vanilla_adapters(m))
    return model


def _vanilla_adapters(module: nn.Module) -> list[str]:
    """The active vanilla-LoRA adapters of a peft LoRA ``Linear`` that is not merged or disabled
    (DoRA and other variants, embeddings and convolutions are left as they are)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # pragma: no cover - peft is a dependency
        return []
    if not isinstance(module, Linear) or module.merged or module.disable_adapters \
            or getattr(module, "fan_in_fan_out", False):
        return []
    variants = getattr(module, "lora_variant", {})
    return [a for a in module.active_adapters if a in module.lora_A and a not in variants]


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextlib.contextmanager
def merged_weights(model: nn.Module):
    """Inside the block, each LoRA linear layer of ``model`` runs on ``W + s B A`` as one plain
    linear layer; yields how many layers were merged. A no-op (0) where gradients are enabled
    (the adapters must train), for a model without LoRA, and for an FSDP-sharded model (its
    parameters belong to FSDP). Keeps a copy of the adapted weights between blocks (a cache)."""
    layers = [] if torch.is_grad_enabled() or _sharded(model) else \
        [(m, names) for m in model.modules() if m in _ALLOWED for names in [_vanilla_adapters(m)]
         if names]
    swapped = []
    try:
        for layer, names in layers:
            weight = layer.base_layer.weight
            merged = _buffer(layer, weight, _autocast_dtype(weight))
            total = merged if merged.dtype == weight.dtype else torch.empty_like(weight)
            torch.addmm(weight, *_factors(layer, names[0]), out=total, alpha=layer.scaling[names[0]])
            for name in names[1:]:
                total.addmm_(*_factors(layer, name), alpha=layer.scaling[name])
            if total is not merged:  # kept in autocast's dtype: no cast of it at every token
                merged.copy_(total)
            swapped.append((layer, weight, list(layer.merged_adapters)))
            layer.base_layer.weight = nn.Parameter(merged, requires_grad=False)
            layer.merged_adapters = names  # peft's forward now runs the base layer alone
        yield len(swapped)
    finally:
        for layer, weight, merged_adapters in swapped:
            layer.base_layer.weight = weight
            layer.merged_adapters = merged_adapters


def _factors(layer: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` of adapter ``name``, in the base weight's dtype (``W + s B A`` is one addmm)."""
    dtype = layer.base_layer.weight.dtype
    return layer.lora_B[name].weight.to(dtype), layer.lora_A[name].weight.to(dtype)


def _autocast_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes a linear layer with this float32 ``weight`` in, here (its
    own dtype where autocast is off). Autocast keeps its cast of a weight only for a trainable
    leaf; a merged copy in float32 would be cast again at every decoding step."""
    device = weight.device.type
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _buffer(layer: nn.Module, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The layer's cached merged-weight buffer in ``dtype``, made anew when the weight's shape
    or device, or ``dtype``, changed."""
    buf = _BUFFERS.get(layer)
    if buf is None or buf.shape != weight.shape or buf.dtype != dtype \
            or buf.device != weight.device:
        buf = _BUFFERS[layer] = torch.empty_like(weight, dtype=dtype, requires_grad=False)
    return buf
