"""Shared prompt tokens run once: a prefix that every row of a forward begins with (a chat
template's system prompt, a task instruction), and each prompt that several rows sample from
(GRPO's groups, ``collector.n`` > 1).

Attention is causal, so the keys and values of a row's first tokens depend on those tokens
alone: rows that begin with the same tokens have the same keys and values there. `run` runs
those tokens once with a KV cache and leaves each row only the rest:

- a **common prefix**: run once at batch size 1, its cache repeated to the rows, which run the
  rest of their prompt and their response;
- **distinct prompts**, where rows repeat prompts: each distinct prompt (all but its last
  token, their own common prefix run once) runs once, its cache is selected for every row of
  that prompt, and each row runs its last prompt token and its response.

Same arithmetic as the whole forward (positions, masks and the tokens each token attends to are
unchanged; float32 round-off aside), and in backward a shared token's gradient is the sum over
the rows that read it, as before. The saving is the shared tokens' share of every actor,
critic and reference forward and backward (`models.shared_prefix`).

>>> ids = torch.tensor([[0, 7, 8, 9, 4], [7, 8, 9, 5, 6]])
>>> mask = torch.tensor([[False, True, True, True, True], [True] * 5])
>>> shared_length(ids, mask, min_saved=1)
3
>>> prefix, rest_ids, rest_mask = split(ids, mask, 3)
>>> prefix.tolist(), rest_ids.tolist(), rest_mask.tolist()
([[7, 8, 9]], [[9, 4], [5, 6]], [[False, True], [True, True]])
>>> first, inverse = distinct_prompts(torch.tensor([[1, 2], [3, 4], [1, 2]]), torch.ones(3, 2) > 0)
>>> first.tolist(), inverse.tolist()
([0, 1], [0, 1, 0])
"""

from __future__ import annotations

import torch

from rlpipe.core.base.errors import UserError

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


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """``(first, inverse)``: the first row of each distinct prompt [U] and, for each row, the
    index of its prompt in ``first`` [B]. Padding is ignored: rows are the same prompt when
    their real tokens are."""
    _, inverse = torch.unique(prompt_ids.masked_fill(~prompt_mask, -1), dim=0, return_inverse=True)
    rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
    first = torch.full((int(inverse.max()) + 1,), len(prompt_ids), device=rows.device)
    return first.scatter_reduce(0, inverse, rows, "amin"), inverse


def run(forward, prefill, prompt_ids, prompt_mask, response_ids, response_mask,
        cache_arg: str | None):
    """``forward(**inputs)`` over prompt + response (``position_ids = cumsum(mask) - 1``). With
    ``cache_arg`` (the forward's name for a KV cache: ``cache``, ``past_key_values`` before
    transformers 5.24; None: no sharing), shared prompt tokens that save `MIN_SAVED_TOKENS`
    run first through ``prefill(**inputs)``: the distinct prompts where rows repeat them and
    that saves more, else the common prefix. ``forward`` then gets their KV cache with the rest
    of each row. A model whose cache is not a plain `transformers.DynamicCache` runs whole."""
    got = shared_cache(prefill, prompt_ids, prompt_mask, cache_arg) if cache_arg else None
    return finish(forward, got, prompt_ids, prompt_mask, response_ids, response_mask, cache_arg)


def finish(forward, got, prompt_ids, prompt_mask, response_ids, response_mask, cache_arg):
    """`run`'s forward, given what `shared_cache` returned (None: the whole rows)."""
    if got is None:
        ids = torch.cat([prompt_ids, response_ids], 1)
        mask = torch.cat([prompt_mask, response_mask], 1).long()
        return forward(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    cache, cached_mask, rest_ids, rest_mask = got
    ids = torch.cat([rest_ids, response_ids], 1)
    mask = torch.cat([cached_mask, rest_mask, response_mask], 1).long()
    out = forward(input_ids=ids, attention_mask=mask,
                  position_ids=(mask.cumsum(-1) - 1)[:, -ids.shape[1]:], use_cache=True,
                  **{cache_arg: cache})
    if any(layer.get_seq_length() != mask.shape[1] for layer in cache.layers):
        raise UserError("models.shared_prefix: this model's forward did not use the prefix's KV "
                        "cache; set models.shared_prefix: false")
    return out


def shared_cache(prefill, prompt_ids, prompt_mask, cache_arg: str):
    """``(cache, cached_mask, rest_ids, rest_mask)``: the KV cache of the prompt tokens run
    apart through ``prefill`` (already selected for every row), the mask of its columns, and
    each row's prompt tokens left to run; None when nothing saves `MIN_SAVED_TOKENS` or the
    cache is not a plain `DynamicCache`. `run` uses it, and so does generation (a prompt's
    prefill, `rlpipe.core.models.lm.generation_cache`)."""
    rows, lengths = len(prompt_ids), prompt_mask.sum(1)
    by_prefix = (rows - 1) * shared_length(prompt_ids, prompt_mask, min_saved=1)
    by_prompt = 0
    if rows > 1 and int(lengths.min()) >= 2 and bool(prompt_mask[:, -1].all()):
        first, inverse = distinct_prompts(prompt_ids, prompt_mask)
        by_prompt = int((lengths - 1).sum() - (lengths[first] - 1).sum())
    if max(by_prefix, by_prompt) < MIN_SAVED_TOKENS:
        return None
    if by_prompt > by_prefix:  # each distinct prompt but its last token, then one row each
        got = _prompts_cache(prefill, prompt_ids[first, :-1], prompt_mask[first, :-1], cache_arg)
        if got is None:
            return None
        cache, cached_mask = got
        cache.batch_select_indices(inverse)
        return cache, cached_mask[inverse], prompt_ids[:, -1:], prompt_mask[:, -1:]
    return _prefix_cache(prefill, prompt_ids, prompt_mask, by_prefix // (rows - 1), cache_arg)


def _prompts_cache(prefill, ids, mask, cache_arg: str):
    """``(cache, cached_mask)``: the KV cache of the left-padded prompts ``ids`` (their common
    prefix run once where it saves `MIN_SAVED_TOKENS`) and the mask of its columns; None for a
    cache that is not a plain `DynamicCache`."""
    n = shared_length(ids, mask, MIN_SAVED_TOKENS)
    if not n:
        out = prefill(input_ids=ids, attention_mask=mask.long(),
                      position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0), use_cache=True)
        cache = _plain(getattr(out, cache_arg, None))
        return None if cache is None else (cache, mask)
    got = _prefix_cache(prefill, ids, mask, n, cache_arg)
    if got is None:
        return None
    cache, prefix_mask, rest_ids, rest_mask = got
    cached_mask = torch.cat([prefix_mask, rest_mask], 1)
    prefill(input_ids=rest_ids, attention_mask=cached_mask.long(),
            position_ids=(cached_mask.long().cumsum(-1) - 1)[:, n:], use_cache=True,
            **{cache_arg: cache})
    return cache, cached_mask


def _prefix_cache(prefill, ids, mask, n: int, cache_arg: str):
    """``(cache, prefix_mask, rest_ids, rest_mask)`` for the first ``n`` tokens every row of
    ``ids`` shares (`split`): their KV cache repeated to the rows, and the rows' tokens after
    them; None (`_plain`)."""
    prefix, rest_ids, rest_mask = split(ids, mask, n)
    cache = _prefilled(prefill, prefix, len(ids), cache_arg)
    return None if cache is None else (cache, rest_mask.new_ones(len(ids), n), rest_ids, rest_mask)


def _prefilled(prefill, prefix: torch.Tensor, batch: int, cache_arg: str):
    """The prefix's KV cache repeated to ``batch`` rows, or None (`_plain`)."""
    n = prefix.shape[1]
    out = prefill(input_ids=prefix, attention_mask=torch.ones_like(prefix),
                  position_ids=torch.arange(n, device=prefix.device)[None], use_cache=True)
    cache = _plain(getattr(out, cache_arg, None))
    if cache is not None:
        cache.batch_repeat_interleave(batch)
    return cache


def _plain(cache):
    """``cache`` when it is a `DynamicCache` of full-attention layers, else None (sliding
    windows and other caches keep their own rules)."""
    from transformers import cache_utils

    full = getattr(cache_utils, "DynamicLayer", None)  # transformers' per-layer caches (>= 4.56)
    if (type(cache) is not cache_utils.DynamicCache or full is None
            or any(type(x) is not full for x in getattr(cache, "layers", [None]))):
        return None
    return cache
