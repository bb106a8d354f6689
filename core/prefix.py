"""The shared prompt prefix: prompt tokens that every row of a forward begins with (a chat
template's system prompt, a task instruction; the whole prompt where all rows are samples of one
prompt) run once.

Attention is causal, so a prefix's keys and values depend on the prefix alone: they are the same
in every row. `run` runs the prefix once at batch size 1 with a KV cache, repeats the
cache to the batch, and leaves each row only the rest of its prompt and its response. Same
arithmetic as the whole forward (positions, masks and the tokens each token attends to are
unchanged; float32 round-off aside), and in backward the prefix's gradient is the sum over the
rows, as before. The saving is the prefix's share of the tokens in every actor, critic and
reference forward and backward (`models.shared_prefix`).

>>> ids = torch.tensor([[0, 7, 8, 9, 4], [7, 8, 9, 5, 6]])
>>> mask = torch.tensor([[False, True, True, True, True], [True] * 5])
>>> shared_length(ids, mask, min_saved=1)
3
>>> prefix, rest_ids, rest_mask = split(ids, mask, 3)
>>> prefix.tolist(), rest_ids.tolist(), rest_mask.tolist()
([[7, 8, 9]], [[9, 4], [5, 6]], [[False, True], [True, True]])
"""

from __future__ import annotations

import torch

from rlpipe.core.errors import UserError

# Run the prefix apart only when its rows save at least this many tokens, (rows - 1) x length:
# the extra call reads every weight once more (in backward it also writes and adds a whole weight
# gradient). Measured break-even for a float32 model on a 2-core CPU: ~85 saved tokens in an
# update micro-step, ~135 in a no-grad forward (BENCHMARKS.md)
MIN_SAVED_TOKENS = 192


def shared_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  min_saved: int = MIN_SAVED_TOKENS) -> int:
    """How many leading real tokens all rows of a left-padded prompt batch have in common, at
    most the shortest prompt's length minus one (each row keeps its last prompt token: it scores
    the first response token); 0 when sharing them saves fewer than ``min_saved`` tokens, or for
    a mask that is not left padding.

    >>> mask = torch.tensor([[True, True, True], [False, True, True]])
    >>> shared_length(torch.tensor([[3, 3, 1], [0, 3, 2]]), mask, min_saved=1)
    1
    >>> shared_length(torch.tensor([[3, 3, 1], [0, 4, 2]]), mask, min_saved=1)
    0
    """
    lengths = prompt_mask.sum(1)
    longest, shortest = prompt_ids.shape[1], int(lengths.min())
    if (len(prompt_ids) - 1) * (shortest - 1) < max(min_saved, 1):
        return 0
    if bool((prompt_mask[:, 1:].long() < prompt_mask[:, :-1].long()).any()):
        return 0  # a real token followed by padding: not left padding
    first = (longest - lengths)[:, None] + torch.arange(shortest - 1, device=lengths.device)
    tokens = prompt_ids.gather(1, first)
    same = (tokens == tokens[:1]).all(0)
    n = shortest - 1 if bool(same.all()) else int(same.long().argmin())
    return n if (len(prompt_ids) - 1) * n >= max(min_saved, 1) else 0


def split(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int):
    """``(prefix [1, n], rest_ids, rest_mask)``: the first ``n`` real tokens, the same in every
    row, and the prompts without them, still left-padded (``n`` columns narrower; a shorter row's
    cleared prefix tokens become masked columns)."""
    lengths = prompt_mask.sum(1)
    start = prompt_ids.shape[1] - int(lengths.max())  # the first column any row uses
    longest_row = int(lengths.argmax())
    prefix = prompt_ids[longest_row:longest_row + 1, start:start + n]
    keep = prompt_mask & (prompt_mask.long().cumsum(1) > n)  # the rest of each row's prompt
    return prefix, prompt_ids[:, start + n:], keep[:, start + n:]


def run(forward, prefill, prompt_ids, prompt_mask, response_ids, response_mask,
        cache_arg: str | None):
    """``forward(**inputs)`` over prompt + response (``position_ids = cumsum(mask) - 1``). With
    ``cache_arg`` (the forward's name for a KV cache: ``cache``, ``past_key_values`` before
    transformers 5.24; None: no sharing) and a shared prefix that saves `MIN_SAVED_TOKENS`,
    ``prefill(**inputs)`` runs the prefix first, at batch size 1; its KV cache, repeated to the
    batch, is passed to ``forward`` with the rest. A model whose cache is not a plain
    `transformers.DynamicCache` runs whole."""
    n = shared_length(prompt_ids, prompt_mask, MIN_SAVED_TOKENS) if cache_arg else 0
    cache = None
    if n:
        prefix, rest_ids, rest_mask = split(prompt_ids, prompt_mask, n)
        cache = _prefilled(prefill, prefix, len(prompt_ids), cache_arg)
    if cache is None:
        ids = torch.cat([prompt_ids, response_ids], 1)
        mask = torch.cat([prompt_mask, response_mask], 1).long()
        return forward(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    ids = torch.cat([rest_ids, response_ids], 1)
    mask = torch.cat([prompt_mask.new_ones(len(ids), n), rest_mask, response_mask], 1).long()
    out = forward(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1)[:, n:],
                  use_cache=True, **{cache_arg: cache})
    if any(layer.get_seq_length() != mask.shape[1] for layer in cache.layers):
        raise UserError("models.shared_prefix: this model's forward did not use the prefix's KV "
                        "cache; set models.shared_prefix: false")
    return out


def _prefilled(prefill, prefix: torch.Tensor, batch: int, cache_arg: str):
    """The prefix's KV cache repeated to ``batch`` rows, or None for a cache other than a
    `DynamicCache` of full-attention layers (sliding windows and other caches keep their own
    rules)."""
    from transformers import cache_utils

    n = prefix.shape[1]
    out = prefill(input_ids=prefix, attention_mask=torch.ones_like(prefix),
                  position_ids=torch.arange(n, device=prefix.device)[None], use_cache=True)
    cache = getattr(out, cache_arg, None)
    full = getattr(cache_utils, "DynamicLayer", None)  # transformers' per-layer caches (>= 4.56)
    if (type(cache) is not cache_utils.DynamicCache or full is None
            or any(type(x) is not full for x in getattr(cache, "layers", [None]))):
        return None
    cache.batch_repeat_interleave(batch)
    return cache
