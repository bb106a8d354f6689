"""Denormal floats flushed to zero on every CPU thread torch computes on.

A float32 below 1.2e-38 in magnitude is "denormal"; x86 CPUs run arithmetic on denormals through
a slow path, 10-50x slower per element. Training produces them in bulk: ``exp`` of log-probs far
below the maximum (the softmax backward over a 49 152-token vocabulary), tiny gradients, their
squares in Adam's second moment. `torch.set_flush_denormal` sets the flush-to-zero and
denormals-are-zero bits of the calling thread only, so the OpenMP worker threads that run half of
every parallel op on 2 cores keep the slow path. `flush_denormals` sets them on every thread of
torch's OpenMP team too, by running a parallel region of the same OpenMP runtime.

What it changes: a result or an input below 1.2e-38 reads as 0. Any such value is below the
float32 round-off of every normal number it meets (a sum or a product with a normal operand), so
results change by less than 1.2e-38 per element.

>>> import torch
>>> flush_denormals(True)
True
>>> int((torch.full((1 << 20,), 1e-39) * 0.5).count_nonzero())
0
>>> flush_denormals(False)
True
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=None)
def _openmp_parallel():
    """``GOMP_parallel`` of the OpenMP runtime torch links (``torch/lib/libgomp*``), or None
    (another runtime, or none: then only the calling thread is set)."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if not found:
        return None
    try:
        parallel = ctypes.CDLL(str(found[0])).GOMP_parallel
    except (OSError, AttributeError):
        return None
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    parallel.argtypes = [callback, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    return parallel, callback


def flush_denormals(on: bool = True) -> bool:
    """Flush denormals to zero (``on``) or stop, on this thread and on each of torch's
    ``torch.get_num_threads()`` OpenMP threads. False where the CPU cannot (no DAZ bit)."""
    if not torch.set_flush_denormal(on):
        return False
    found = _openmp_parallel()
    if found is not None and torch.get_num_threads() > 1:
        parallel, callback = found
        run = callback(lambda _: torch.set_flush_denormal(on))  # runs on every team thread
        parallel(run, None, torch.get_num_threads(), 0)
    return True
