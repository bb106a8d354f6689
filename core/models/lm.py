"""The models of a PPO run: actor, critic (backbone + scalar value head), frozen reference, held
together in `Models`.

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

import contextlib
import copy
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rlpipe.core.models import packing, prefix
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.model_files import (check_finite, check_model_dir, check_remote_code,
                                     check_weights, loading)
from rlpipe.core.base.ops import pad_positions, token_logprobs, trim_padding

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: Path, trust_remote_code: bool = False,
                   setting: str = "models.actor.trust_remote_code"):
    """The folder's tokenizer; a broken or remote-code folder is a one-line `UserError`."""
    from transformers import AutoTokenizer

    path = Path(path)
    check_remote_code(path, trust_remote_code, setting)
    with loading(path, "the tokenizer"):
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_causal_lm(path: Path, init: str = "pretrained", dtype: str = "float32",
                   trust_remote_code: bool = False,
                   setting: str = "models.actor.trust_remote_code"):
    """A causal LM from a local folder: pretrained weights, or fresh weights from its config.json.
    The folder is checked first (`rlpipe.core.base.model_files`); any load error is one line."""
    from transformers import AutoModelForCausalLM

    model = _from_folder(AutoModelForCausalLM, path, init, trust_remote_code, setting, "the model",
                         dtype=_DTYPES[dtype])
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(contiguous_input)
    return model.eval()  # eval always: no dropout, so the on-policy ratio is exactly 1


def contiguous_input(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook for the LM head: its input made contiguous. transformers slices the
    hidden states (``logits_to_keep``, the last position in ``generate``); with a frozen head
    (the reference, a LoRA actor) torch then runs the [B, T, H] x [H, vocab] product as a batched
    matmul over a broadcast weight, 1.5x slower on CPU than one [B*T, H] matmul."""
    return (args[0].contiguous(), *args[1:])


def _from_folder(auto_class, path, init: str, trust_remote_code: bool, setting: str, what: str,
                 **kwargs):
    """``auto_class`` from a checked folder: its weights, or fresh ones (``init="random"``)."""
    from transformers import AutoConfig

    path = Path(path)
    check_model_dir(path, trust_remote_code, setting)
    remote = {"trust_remote_code": trust_remote_code}
    with loading(path, what):
        if init == "random":
            config = AutoConfig.from_pretrained(str(path), **remote)
            return auto_class.from_config(config, **kwargs, **remote)
        check_weights(path)
        model = auto_class.from_pretrained(str(path), **kwargs, **remote)
    check_finite(model, path)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (``model`` itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enable_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing of every transformer block (non-reentrant); it acts only inside
    `checkpointing`, so generation and the no-grad scoring passes keep their KV cache and speed."""
    base = unwrap(model.backbone if isinstance(model, ValueModel) else model)
    kwargs = {"use_reentrant": False}
    try:
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as exc:  # the architecture has no checkpointable blocks
        raise UserError(f"gradient_checkpointing: {exc}") from exc


@contextlib.contextmanager
def checkpointing(*models: nn.Module | None):
    """Let the checkpointed blocks of ``models`` recompute their activations in backward.

    transformers checkpoints a block only when its ``training`` flag is set; we set that flag on
    the checkpointed blocks alone, so dropout and every other module stay in eval mode and the
    first PPO ratio stays exactly 1 (``model.train()`` would turn dropout on)."""
    blocks = [m for model in models if model is not None for m in model.modules()
              if getattr(m, "gradient_checkpointing", False) is True and not m.training]
    for block in blocks:
        block.training = True
    try:
        yield
    finally:
        for block in blocks:
            block.training = False


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head: ``values[b, t] = head(hidden[b, t])``. A fresh
    head's weights have std 1/(hidden+1) and its bias is 0:

    >>> _ = torch.manual_seed(0)
    >>> head = ValueModel(nn.Identity(), 4095).head
    >>> round(head.weight.std().item() * 4096, 1), head.bias.item()
    (1.0, 0.0)
    """

    shared = False  # True: ``backbone`` is the actor's own, run once for both heads

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        # OpenRLHF's init (std 1/(hidden+1), not 1/sqrt(hidden+1)): a fresh head's values start
        # near 0, so its first updates fit the returns instead of undoing noise. With the sqrt the
        # tiny example's critic had explained variance -15 at step 1 and below 0 for 10 steps.
        nn.init.normal_(self.head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_actor(cls, actor, shared: bool = False) -> "ValueModel":
        """A critic on the actor's backbone: a copy (the common RLHF choice), or with ``shared``
        the very same modules (LoRA adapters included), trained by the combined loss."""
        base = unwrap(actor)
        backbone = base.base_model if shared else copy.deepcopy(base.base_model)
        critic = cls(backbone, base.config.hidden_size).to(next(actor.parameters()).dtype)
        critic.shared = shared
        return critic

    @classmethod
    def from_pretrained(cls, path: Path, init: str = "pretrained", trust_remote_code: bool = False,
                        setting: str = "models.critic.trust_remote_code") -> "ValueModel":
        """A fresh value head on the folder's backbone (checked as in `load_causal_lm`)."""
        from transformers import AutoModel

        backbone = _from_folder(AutoModel, path, init, trust_remote_code, setting,
                                "the critic backbone")
        return cls(backbone, backbone.config.hidden_size)

    def forward(self, input_ids, attention_mask, position_ids, use_cache: bool = False, **cache):
        """Values at every position; ``use_cache`` and a KV cache keyword (``cache`` or
        ``past_key_values``) go to the backbone (a shared prompt prefix: `rlpipe.core.models.prefix`)."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=use_cache, **cache)
        return self.values(out.last_hidden_state)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        # A new tensor, not a view (squeeze): FSDP2 warns that an in-place op on a view output
        # would skip its pre-backward hook. Summing one element is exact. Under autocast the
        # head still computes in its weights' dtype: a bf16 value would keep 3 digits.
        with torch.autocast(hidden.device.type, enabled=False):
            return self.head(hidden.to(self.head.weight.dtype)).sum(-1).float()


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX-BF16); without it torch
    emulates bf16 matmuls at a few GFLOP/s (Linux: read from /proc/cpuinfo; elsewhere False)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def frozen_copy(model: nn.Module) -> nn.Module:
    """A detached, eval-mode, grad-free copy (the reference policy)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


@dataclass
class Models:
    """The models of a run, as `rlpipe.core.run.build.build_models` makes them."""

    actor: torch.nn.Module
    frozen_reference: torch.nn.Module | None   # None with a LoRA actor: adapters disabled instead
    critic: ValueModel | None
    tokenizer: object
    offload_to: torch.device | None = None  # set: the frozen reference lives on CPU, visits this
    autocast: torch.dtype | None = None     # set: forwards run under torch.autocast (models.autocast)
    shared_prefix: bool = False             # run a shared prompt prefix once (models.shared_prefix)
    packed: bool = False                    # rows without their padding (models.packed)
    compile_logprobs: bool = False          # token log-probs as compiled kernels (models.compile_logprobs)

    def compute(self):
        """The context every forward of actor, critic and reference runs in: ``torch.autocast``
        to ``autocast`` on the actor's device (a fresh one per ``with``: autocast caches its
        casts of the weights until the block ends, so a block must not span an optimizer step),
        or a no-op."""
        device = next(self.actor.parameters()).device.type
        return torch.autocast(device, dtype=self.autocast or torch.bfloat16,
                              enabled=self.autocast is not None)

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: a frozen copy, or the LoRA actor with its adapters disabled.
        An offloaded copy moves to the device for the ``with`` block and back to CPU after it."""
        ref = self.frozen_reference
        if ref is None:
            with self.actor.disable_adapter():
                yield self.actor
            return
        if self.offload_to is not None:
            ref.to(self.offload_to)
        try:
            yield ref
        finally:
            if self.offload_to is not None:
                ref.to("cpu")


def _cache_arg(model: nn.Module, shared_prefix: bool) -> str | None:
    """The name ``model``'s forward takes a KV cache by, for `rlpipe.core.models.prefix`; None
    without ``shared_prefix`` or while its blocks recompute in backward (`checkpointing`:
    transformers then drops a cache)."""
    if not shared_prefix or any(getattr(m, "gradient_checkpointing", False) is True and m.training
                                for m in model.modules()):
        return None
    base = unwrap(model.backbone if isinstance(model, ValueModel) else model)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM (under a peft wrapper, its base model) takes ``logits_to_keep``."""
    return "logits_to_keep" in inspect.signature(unwrap(model).forward).parameters


def generation_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """For ``generate`` on the causal LM ``model``: the prompt tokens that rows share run once
    (`rlpipe.core.models.prefix.shared_cache`, one logit row per call), as ``(ids, mask, kwargs)``:
    the prompt with the cached columns as placeholders (``generate`` runs only the tokens past
    its cache), its attention mask, and ``{name: cache}`` to pass on; the prompt unchanged and
    ``{}`` where nothing is shared. Call it under the weights and mode ``generate`` runs in."""
    name = _cache_arg(model, True)
    keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    got = prefix.shared_cache(functools.partial(model, **keep), prompt_ids, prompt_mask, name)
    if got is None:
        return prompt_ids, prompt_mask, {}
    cache, cached_mask, rest_ids, rest_mask = got
    ids = torch.cat([rest_ids.new_zeros(cached_mask.shape), rest_ids], 1)
    return ids, torch.cat([cached_mask, rest_mask], 1), {name: cache}


def _forward(model, prefill, inputs: list, cache_arg: str | None, packed: bool,
             keep: int | None):
    """``(output, rows)``: ``model``'s forward over trimmed ``inputs``. Shared prompt tokens
    run apart first through ``prefill`` where they save enough (with ``cache_arg``,
    `rlpipe.core.models.prefix`); with ``packed`` the rows (after those tokens) then run without their
    padding where a model on ``sdpa`` attention saves enough, ``rows`` being their
    `packing.Rows` (None: padded). ``keep``: pass ``logits_to_keep`` (the last ``keep``
    positions padded; the tokens before the real response tokens packed)."""
    prompt_ids, prompt_mask, response_ids, response_mask = inputs
    got = prefix.shared_cache(prefill, prompt_ids, prompt_mask, cache_arg) if cache_arg else None
    base = unwrap(model.backbone if isinstance(model, ValueModel) else model)
    if packed and packing.packs(base):
        ids, mask = (prompt_ids, prompt_mask) if got is None else got[2:]
        rows = packing.Rows.of(mask, response_mask, past=None if got is None else got[:2])
        if rows is not None:
            head = {} if keep is None else {"logits_to_keep": rows.index}
            out = packing.run(model, rows, ids, response_ids, base, **head)
            if out is not None:
                return out, rows
    forward = model if keep is None else functools.partial(model, logits_to_keep=keep)
    return prefix.finish(forward, got, *inputs, cache_arg), None


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0, with_entropy: bool = False,
                      entropy_grad: bool = True, truncation=None, shared_prefix: bool = False,
                      packed: bool = False, compiled: bool = False):
    """log pi(a_t|s_t) for each response token, [B, R] float32 (0 on padding), and optionally
    the per-token entropy (without a graph when ``entropy_grad`` is False: a metric only, which
    spares autograd a saved [B, R, vocab] tensor). Temperature 0 (greedy) scores with
    temperature 1. ``truncation`` (a `rlpipe.core.base.truncation.Truncation`): score under the
    sampler's top-k / top-p distribution, renormalised (the entropy stays the full one's).
    Columns that are padding in every row are not run (`trim_padding`); with ``shared_prefix``,
    prompt tokens every row begins with run once (`rlpipe.core.models.prefix`); with ``packed``, rows
    run without their padding (`rlpipe.core.models.packing`); ``compiled``: `token_logprobs`' kernels
    under ``torch.compile``."""
    logp, entropy, _ = _response_logprobs(model, [prompt_ids, prompt_mask, response_ids,
                                                  response_mask], temperature, with_entropy,
                                          entropy_grad, truncation, shared_prefix, packed, compiled)
    return logp, entropy


def _response_logprobs(model, inputs, temperature, with_entropy, entropy_grad, truncation,
                       shared_prefix, packed, compiled):
    """`response_logprobs`, and the `packing.Rows` it ran (None: the padded rows)."""
    width = inputs[2].shape[1]
    prompt_ids, prompt_mask, response_ids, response_mask = inputs = trim_padding(*inputs)
    R, keep = response_ids.shape[1], _accepts_logits_to_keep(model)
    out, rows = _forward(model, functools.partial(model, **({"logits_to_keep": 1} if keep else {})),
                         inputs, _cache_arg(model, shared_prefix), packed, R + 1 if keep else None)
    if rows is not None:  # the logits before each real response token only, [1, N, vocab]
        logits = out.logits if keep else rows.select(out.logits)
        ids, start = response_ids[rows.response][None], 0
    else:
        logits, ids = out.logits, response_ids
        start = logits.shape[1] - (R + 1)
    scale = temperature if temperature > 0 else 1.0
    logp, entropy = token_logprobs(logits, ids, start, scale, with_entropy, entropy_grad, compiled)
    if truncation is not None:  # the kept set needs the whole [B, R, vocab] slice
        logp = truncation.log_prob(logits[:, start:start + ids.shape[1]].float() / scale, ids)
    if rows is not None:
        logp, entropy = rows.scatter(logp), None if entropy is None else rows.scatter(entropy)
    entropy = None if entropy is None else entropy * response_mask
    return pad_positions(logp * response_mask, width), pad_positions(entropy, width), rows


def response_values(critic: ValueModel, prompt_ids, prompt_mask, response_ids, response_mask,
                    shared_prefix: bool = False, packed: bool = False):
    """V(s_t) for each response token (the state before token t is produced), [B, R], 0 on
    padding. Columns that are padding in every row are not run (`trim_padding`); with
    ``shared_prefix``, prompt tokens every row begins with run once (`rlpipe.core.models.prefix`);
    with ``packed``, rows run without their padding (`rlpipe.core.models.packing`)."""
    width = response_ids.shape[1]
    inputs = trim_padding(prompt_ids, prompt_mask, response_ids, response_mask)
    R = inputs[2].shape[1]
    values, rows = _forward(critic, critic.backbone, inputs, _cache_arg(critic, shared_prefix),
                            packed, None)
    values = values[:, -(R + 1):-1] if rows is None else rows.scatter(rows.select(values))
    return pad_positions(values * inputs[3], width)


def logprobs_and_values(actor, critic: ValueModel | None, inputs: list, temperature: float = 1.0,
                        with_entropy: bool = False, entropy_grad: bool = True, truncation=None,
                        shared_prefix: bool = False, packed: bool = False, compiled: bool = False):
    """``(log_prob, entropy, value)`` of `response_logprobs` and `response_values` (value None
    without a critic). A critic on the actor's own backbone costs no second pass: its values are
    read from the backbone output of the actor's forward (a forward hook)."""
    kwargs = dict(temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                  truncation=truncation, shared_prefix=shared_prefix, packed=packed,
                  compiled=compiled)
    if critic is None or not critic.shared:
        logp, entropy = response_logprobs(actor, *inputs, **kwargs)
        return logp, entropy, (None if critic is None else response_values(
            critic, *inputs, shared_prefix=shared_prefix, packed=packed))
    width, inputs = inputs[2].shape[1], trim_padding(*inputs)
    seen = []
    hook = critic.backbone.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        logp, entropy, rows = _response_logprobs(actor, inputs, **kwargs)
    finally:
        hook.remove()
    R, response_mask, hidden = inputs[2].shape[1], inputs[3], seen[-1].last_hidden_state
    values = (critic.values(hidden[:, -(R + 1):-1]) if rows is None
              else rows.scatter(critic.values(rows.select(hidden))))
    return (pad_positions(logp, width), pad_positions(entropy, width),
            pad_positions(values * response_mask, width))
