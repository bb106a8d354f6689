"""Rows without their padding: one packed sequence per forward (``models.packed``).

A forward's rows are left-padded prompts followed by right-padded responses, as wide as the
longest row: every padding column costs each layer's matmuls, forward and backward, like a
real token. `Rows` packs the real tokens of all rows one after the other into a single
``[1, T]`` sequence whose position ids restart at 0 for each row (transformers' packed
format). Every layer but attention treats tokens one by one, so it runs on the ``T`` real tokens
alone. Attention (`attention`) moves each row's queries, keys and values into its own slot of a
``[B, W]`` batch, ``W`` the longest row, with padding after its last token; causal attention
inside each slot sees exactly the row's earlier tokens, and the result is packed again. The LM
head and the value heads then read only the token before each real response token. Where prompt
tokens that rows share ran apart first (`rlpipe.core.models.prefix.shared_cache`), each row's remaining
tokens pack, and attention puts the row's cached keys and values before its slot.

`attention` is registered in the process as transformers' ``sdpa`` attention function (the
first packed forward does it); a forward that passes no `Rows` gets transformers' own function,
unchanged.

Same arithmetic as the padded forward (the same positions, and each token attends to the same
tokens; float32 round-off aside), with ``B x L - T`` fewer tokens through every linear layer.

>>> pm = torch.tensor([[False, True, True], [True, True, True]])
>>> rm = torch.tensor([[True, True, False], [True, False, False]])
>>> rows = Rows.of(pm, rm, min_saved=1)
>>> rows.ids(torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([[6, 7, 0], [8, 0, 0]])).tolist()
[[1, 2, 6, 7, 3, 4, 5, 8]]
>>> rows.position_ids.tolist()
[[0, 1, 2, 3, 0, 1, 2, 3]]
>>> rows.index.tolist()  # tokens 2 and 6 score 6 and 7, token 5 scores 8
[1, 2, 6]
"""

from __future__ import annotations

import warnings
import weakref

import torch

# Pack only when it drops at least this many padding tokens: the packed forward adds a gather
# of q, k and v and a scatter of the output per layer, small against a token's matmuls. Measured
# on SmolLM2-135M, 8 rows + 32 response tokens, forward + backward on a 2-core CPU: level with
# the padded forward at 14 padding tokens, 3% faster at 28, 7% at 56 (BENCHMARKS.md)
MIN_SAVED_TOKENS = 32
KWARG = "rlpipe_rows"  # the keyword a packed forward passes `Rows` to `attention` by
_PACKS = weakref.WeakKeyDictionary()  # model -> whether its forwards pack (`packs`)


class Rows:
    """Where the real tokens of a padded batch go in the packed sequence and back."""

    def __init__(self, keep: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                 response_lengths: torch.Tensor, response_width: int, past=None):
        B, device = len(lengths), lengths.device
        self.keep = keep                    # [B, L] the real tokens of the padded batch
        self.tokens = int(lengths.sum())    # T
        self.width = int(lengths.max())     # W, the longest row
        starts = torch.cumsum(lengths, 0) - lengths
        column = torch.arange(self.width, device=device)
        # attention's slots: [B * W] the packed token in each slot, T (a zero row) past the row
        slot = starts[:, None] + column
        self.slots = torch.where(column < lengths[:, None], slot, self.tokens).flatten()
        # and back: [T] the slot of each packed token
        self.back = (torch.arange(B, device=device)[:, None] * self.width + column)[
            column < lengths[:, None]]
        self.position_ids = (self.back % self.width)[None]
        # prompt tokens run apart (`rlpipe.core.models.prefix.shared_cache`): their KV cache, one row
        # per row; each row's tokens come after its cached ones, which `attend` lets a query see
        self.cache, cached_mask = past if past is not None else (None, None)
        self.attend = None  # [B, 1, W, P + W]: the row's real cached keys, its own up to itself
        if past is not None:
            self.position_ids = self.position_ids + cached_mask.sum(1)[self.back // self.width]
            P = cached_mask.shape[1]
            own = torch.ones(self.width, self.width, dtype=torch.bool, device=device).tril()
            self.attend = torch.cat([cached_mask.bool()[:, None, None].expand(B, 1, self.width, P),
                                     own.expand(B, 1, self.width, self.width)], -1)
        # [N] the token before each real response token, the one whose output scores it (the
        # last prompt token, then the response's own), row by row; [B, R] where they go back
        ahead = torch.arange(response_width, device=device)
        self.response = ahead < response_lengths[:, None]
        self.index = (starts + prompt_lengths - 1)[:, None].add(ahead)[self.response]
        self.rows, self.calls = B, 0

    @classmethod
    def of(cls, prompt_mask: torch.Tensor, response_mask: torch.Tensor,
           min_saved: int | None = None, past=None) -> "Rows | None":
        """The packing of a batch of left-padded prompts (each at least one token) and
        right-padded responses (one token at least among them); None when it would drop fewer
        than ``min_saved`` padding tokens (default `MIN_SAVED_TOKENS`) or the masks are not
        laid out that way. ``past``: ``(cache, cached_mask)`` of prompt tokens that ran apart
        (`rlpipe.core.models.prefix.shared_cache`), which come before each row's tokens."""
        p, r = prompt_mask.bool(), response_mask.bool()
        if bool((p[:, 1:] < p[:, :-1]).any()) or bool((r[:, 1:] > r[:, :-1]).any()):
            return None  # a hole in a row: not plain left / right padding
        prompt_lengths, response_lengths = p.sum(1), r.sum(1)
        if bool((prompt_lengths == 0).any()) or not bool(response_lengths.any()):
            return None
        keep = torch.cat([p, r], 1)
        lengths = prompt_lengths + response_lengths
        min_saved = MIN_SAVED_TOKENS if min_saved is None else min_saved
        if keep.numel() - int(lengths.sum()) < max(min_saved, 1):
            return None
        return cls(keep, lengths, prompt_lengths, response_lengths, r.shape[1], past)

    def ids(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
        """The packed token ids, ``[1, T]``."""
        return torch.cat([prompt_ids, response_ids], 1)[self.keep][None]

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """A packed output ``[1, T, ...]`` at the token before each response token (`index`):
        ``[1, N, ...]``."""
        return x[0].index_select(0, self.index)[None]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Per response token ``[1, N]`` to the padded responses ``[B, R]``, 0 on padding."""
        return x.new_zeros(self.response.shape).masked_scatter(self.response, x[0])

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[1, H, T, d]`` to slots ``[B, H, W, d]`` (zeros past each row's end)."""
        x = torch.cat([x, x.new_zeros(*x.shape[:2], 1, x.shape[3])], 2)[0]
        return x.index_select(1, self.slots).view(x.shape[0], self.rows, self.width,
                                                  x.shape[2]).transpose(0, 1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Slots ``[B, W, H, d]`` (attention's output layout) to packed ``[1, T, H, d]``."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.back)[None]


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa`` attention, over each row's slot where a forward passes `Rows`
    (``rlpipe_rows``); otherwise transformers' own function, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = kwargs.pop(KWARG, None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows.calls += 1
    kwargs.pop("is_causal", None)  # causal: `packs` takes no model with other attention
    query, key, value = rows.unpack(query), rows.unpack(key), rows.unpack(value)
    if rows.cache is None:
        out, weights = sdpa_attention_forward(module, query, key, value, None, is_causal=True,
                                              **kwargs)
    else:  # the row's cached keys and values first (their gradient flows to the prefill)
        past = rows.cache.layers[module.layer_idx]
        out, weights = sdpa_attention_forward(module, query, torch.cat([past.keys, key], 2),
                                              torch.cat([past.values, value], 2), rows.attend,
                                              is_causal=False, **kwargs)
    return rows.pack(out), weights


def run(forward, rows: Rows, prompt_ids: torch.Tensor, response_ids: torch.Tensor, model,
        **kwargs):
    """``forward(**inputs)`` over the packed rows (``kwargs`` added), ``model`` being the
    transformers model it runs. None when the model's attention did not take the rows in each
    of its layers (a model that passes no keyword arguments to its attention function, as
    GPT-2 before transformers 5): the output is discarded, and from then on the model's
    forwards run padded (`packs`), with a warning."""
    import transformers
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", attention)  # idempotent; unchanged without `Rows`
    ids = rows.ids(prompt_ids, response_ids)
    # an all-ones mask: transformers then builds no [T, T] mask (`attention` needs none)
    out = forward(input_ids=ids, attention_mask=torch.ones_like(ids),
                  position_ids=rows.position_ids, use_cache=False, **{KWARG: rows}, **kwargs)
    layers = getattr(model.config, "num_hidden_layers", None)
    if rows.calls == 0 or (layers is not None and rows.calls != layers):
        _PACKS[model] = False
        warnings.warn(f"models.packed: {rows.calls} of the {layers} attention layers of "
                      f"{type(model).__name__} took the packed rows (transformers "
                      f"{transformers.__version__}); its forwards run padded", RuntimeWarning)
        return None
    return out


def packs(model) -> bool:
    """Whether ``model``'s forwards (a transformers model) pack: it runs transformers' ``sdpa``
    attention, which `attention` replaces for packed rows, causal and over whole rows (a
    sliding window lives in the mask that packed rows go without), and its attention took the
    rows before (`run`)."""
    if model not in _PACKS:
        config = getattr(model, "config", None)
        types = getattr(config, "layer_types", None)
        _PACKS[model] = (getattr(config, "_attn_implementation", None) == "sdpa"
                         and (all(t == "full_attention" for t in types) if types is not None
                              else getattr(config, "sliding_window", None) is None)
                         and all(getattr(m, "is_causal", True) is not False
                                 for m in model.modules()))
    return _PACKS[model]
