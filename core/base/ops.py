"""Masked tensor helpers: means, variances and whitening over valid tokens only.

Masks are bool tensors shaped like the data, true on real tokens. Values at masked-out
positions are never read (``torch.where``, not multiplication), so padding may hold garbage.
An empty mask gives 0, never NaN.

>>> import torch
>>> x = torch.tensor([[1.0, 3.0, 99.0]])
>>> m = torch.tensor([[True, True, False]])
>>> masked_mean(x, m).item(), masked_var(x, m).item()
(2.0, 1.0)
"""

from __future__ import annotations

import functools

import torch

from rlpipe.core.base.errors import UserError


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over true entries of ``mask``, over all entries (``dim=None``) or along
    ``dim``. A slice with no true entry gives 0.

    >>> masked_mean(torch.tensor([[1.0, 5.0], [2.0, 7.0]]),
    ...             torch.tensor([[True, False], [False, False]]), dim=-1).tolist()
    [1.0, 0.0]
    """
    total = torch.where(mask, x, 0).sum() if dim is None else torch.where(mask, x, 0).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (divides by the count, no Bessel correction) of ``x`` over all true
    entries of ``mask``; 0 for an empty mask or a single entry.

    >>> masked_var(torch.tensor([0.0, 2.0, 50.0]), torch.tensor([True, True, False])).item()
    1.0
    """
    centred = x - masked_mean(x, mask)
    return masked_mean(centred * centred, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to mean 0 and (population) std 1 over all true entries of ``mask`` (the
    whole batch at once); 0 at masked-out positions. With ``shift_mean=False`` only the scale
    changes (the mean is added back).

    >>> masked_whiten(torch.tensor([1.0, 3.0, 7.0]), torch.tensor([True, True, False])).tolist()
    [-1.0, 1.0, 0.0]
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] long index of the last true entry of each row of a [B, R] mask; -1 for a row with
    no true entry (a zero-length response).

    >>> last_token_index(torch.tensor([[True, True, False], [True, True, True],
    ...                                [False, False, False]])).tolist()
    [1, 2, -1]
    """
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, positions, -1).amax(dim=-1)


# Elements of one [rows, vocab] chunk in `token_logprobs`. On CPU 4 Mi floats (16 MiB in
# float32): small enough for the cache-friendly passes, large enough that the Python loop costs
# nothing. On a GPU a 4 Mi pass takes microseconds, as long as launching it, so chunks are 8x
# larger (128 MiB of float32 per temporary; 220 positions of Qwen's 152k vocabulary, not 27).
CHUNK_ELEMENTS = 1 << 22
GPU_CHUNK_ELEMENTS = 1 << 25


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, start: int, temperature: float = 1.0,
                   with_entropy: bool = False, entropy_grad: bool = False, compiled: bool = False):
    """``log softmax(logits[:, start + t] / temperature)[ids[:, t]]`` for each of the
    ``R = ids.shape[1]`` positions, [B, R] float32, and optionally the entropy of each of those
    distributions. The same numbers as ``log_softmax(...).gather(...)`` (the same per-row
    kernels), computed chunk by chunk over rows: no [B, R, vocab] tensor is made besides
    ``logits`` itself and, in backward, its gradient (written straight into one buffer of
    ``logits``' shape). The entropy has a gradient only with ``entropy_grad``. ``compiled``: each
    chunk's passes run as the kernels ``torch.compile`` fuses them into
    (``models.compile_logprobs``; float32 round-off apart, the same numbers).

    >>> logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0], [5.0, 0.0, 0.0]]])
    >>> logp, ent = token_logprobs(logits, torch.tensor([[2, 0]]), start=0, with_entropy=True)
    >>> logp.shape, round(ent[0, 1].item(), 4), round(float(torch.log(torch.tensor(3.0))), 4)
    (torch.Size([1, 2]), 1.0986, 1.0986)
    """
    logp, entropy = _TokenLogprobs.apply(logits, ids, start, temperature, with_entropy, compiled)
    if with_entropy and not (entropy_grad and torch.is_grad_enabled()):
        entropy = entropy.detach()
    return logp, (entropy if with_entropy else None)


def _chunks(logits: torch.Tensor, ids: torch.Tensor, start: int):
    """(b, positions slice) blocks of ``ids``' positions, each at most `CHUNK_ELEMENTS` logits
    (`GPU_CHUNK_ELEMENTS` off the CPU)."""
    size = CHUNK_ELEMENTS if logits.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    rows = max(1, size // logits.shape[-1])
    for b in range(ids.shape[0]):
        for t in range(0, ids.shape[1], rows):
            end = min(t + rows, ids.shape[1])
            yield b, slice(t, end), slice(start + t, start + end)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    x = x.float()
    return x / temperature if temperature != 1.0 else x


def _chunk_forward(x: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    """One chunk's ``(log-probs of ids, entropy or None)``; ``x`` [n, vocab], ``ids`` [n]."""
    x = _scaled(x, temperature)
    logp = torch.log_softmax(x, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    logz = torch.logsumexp(x, dim=-1, keepdim=True)  # log Z - sum p x: no second softmax copy
    return logp, logz.squeeze(-1) - (torch.exp(x - logz) * x).sum(-1)


def _chunk_backward(x: torch.Tensor, ids: torch.Tensor, grad_logp: torch.Tensor,
                    entropy: torch.Tensor, grad_entropy: torch.Tensor | None, temperature: float):
    """One chunk's gradient with respect to ``x``, in ``x``'s dtype: autograd's own backward of
    gather then log_softmax, plus the entropy's ``-p (log p + H)`` where it has a gradient."""
    lsm = torch.log_softmax(_scaled(x, temperature), dim=-1)
    onehot = torch.zeros_like(lsm).scatter_(-1, ids.unsqueeze(-1), grad_logp.unsqueeze(-1))
    chunk = torch.ops.aten._log_softmax_backward_data(onehot, lsm, -1, lsm.dtype)
    if grad_entropy is not None:
        chunk = chunk - torch.exp(lsm) * (lsm + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
    if temperature != 1.0:
        chunk = chunk / temperature
    return chunk.to(x.dtype)


@functools.cache
def _compiled() -> tuple:
    """`_chunk_forward` and `_chunk_backward` under ``torch.compile`` (built on first use; shapes
    dynamic, so chunks of every size share one kernel each); a build that fails later in the run
    (a new dtype or device recompiles: the cache folder gone or unwritable by then) is one line."""
    return (_one_line(torch.compile(_chunk_forward, dynamic=True)),
            _one_line(torch.compile(_chunk_backward, dynamic=True)))


def _one_line(kernel):
    def run(*args):
        try:
            return kernel(*args)
        except Exception as exc:  # inductor's: BackendCompilerFailed (not imported here), OSError
            if not (isinstance(exc, OSError) or type(exc).__name__ == "BackendCompilerFailed"):
                raise
            cause = getattr(exc, "inner_exception", None) or exc
            first = (str(cause).strip().splitlines() or [""])[0][:200]
            raise UserError(f"models.compile_logprobs: torch.compile could not build the log-prob "
                            f"kernels ({type(cause).__name__}: {first}); check that "
                            f"TORCHINDUCTOR_CACHE_DIR is writable, or set "
                            f"models.compile_logprobs: false") from None
    return run


def check_compiled(device: torch.device, dtype: torch.dtype) -> None:
    """Build `token_logprobs`' compiled kernels for ``device`` and ``dtype`` now, on three
    positions, forward and backward, with and without the entropy: where ``torch.compile``
    cannot run (no C++ compiler, no Triton) this raises before any model runs."""
    logits = torch.zeros(1, 4, 8, device=device, dtype=dtype, requires_grad=True)
    ids = torch.zeros(1, 3, dtype=torch.long, device=device)
    with torch.no_grad():
        token_logprobs(logits, ids, 1, compiled=True)
    logp, entropy = token_logprobs(logits, ids, 1, with_entropy=True, entropy_grad=True,
                                   compiled=True)
    (logp.sum() + entropy.sum()).backward()


class _TokenLogprobs(torch.autograd.Function):
    """Forward and backward of `token_logprobs`; backward recomputes each chunk's softmax."""

    @staticmethod
    def forward(ctx, logits, ids, start, temperature, with_entropy, compiled):
        B, R = ids.shape
        logp = logits.new_empty((B, R), dtype=torch.float32)
        entropy = logits.new_zeros((B, R), dtype=torch.float32)
        kernel = _compiled()[0] if compiled else _chunk_forward
        for b, t, pos in _chunks(logits, ids, start):
            logp[b, t], ent = kernel(logits[b, pos], ids[b, t], temperature, with_entropy)
            if with_entropy:
                entropy[b, t] = ent
        ctx.save_for_backward(logits, ids, entropy)
        ctx.start, ctx.temperature, ctx.compiled = start, temperature, compiled
        ctx.mark_non_differentiable(ids)
        ctx.set_materialize_grads(False)  # an entropy without a graph: no pass for its zeros
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, ids, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(entropy)
        kernel = _compiled()[1] if ctx.compiled else _chunk_backward
        grad = torch.empty_like(logits)
        R = ids.shape[1]
        grad[:, :ctx.start].zero_()  # positions that were not scored
        grad[:, ctx.start + R:].zero_()
        for b, t, pos in _chunks(logits, ids, ctx.start):
            grad[b, pos] = kernel(logits[b, pos], ids[b, t], grad_logp[b, t], entropy[b, t],
                                  None if grad_entropy is None else grad_entropy[b, t],
                                  ctx.temperature)
        return grad, None, None, None, None, None


def trim_padding(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                 response_mask: torch.Tensor) -> list[torch.Tensor]:
    """The four inputs of a forward without the prompt columns that are padding in every row
    (prompts are left-padded) and the response columns that are padding in every row (responses
    are right-padded); at least one response column stays. A micro-batch cut from a larger batch
    is padded to the whole batch's longest prompt and response: these columns change no real
    token's output (they are masked keys, after every real token or before it with the same
    position ids) and cost a full forward and backward.

    >>> pm = torch.tensor([[False, False, True], [False, True, True]])
    >>> rm = torch.tensor([[True, False, False], [True, True, False]])
    >>> [tuple(x.shape) for x in trim_padding(pm.long(), pm, rm.long(), rm)]
    [(2, 2), (2, 2), (2, 2), (2, 2)]
    """
    used = prompt_mask.any(0)
    start = int(used.long().argmax()) if bool(used.any()) else prompt_mask.shape[1]
    used = response_mask.any(0)
    end = max(1, int(torch.where(used, torch.arange(len(used), device=used.device) + 1, 0).max()))
    return [prompt_ids[:, start:], prompt_mask[:, start:], response_ids[:, :end],
            response_mask[:, :end]]


def pad_positions(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """``x`` [B, r] zero-padded on the right to [B, width] (the inverse of `trim_padding` for
    a per-token output that is 0 on padding); None stays None.

    >>> pad_positions(torch.ones(1, 2), 3).tolist()
    [[1.0, 1.0, 0.0]]
    """
    if x is None or x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))
