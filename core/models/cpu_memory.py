"""Freed CPU memory kept in the process for the next tensor of the same size.

torch allocates CPU tensors with the C library's ``malloc``. glibc serves a block above 32 MiB
with a fresh ``mmap`` and returns it to the kernel on ``free``, and it trims the top of its heap
once more than a few MiB there are free. A PPO step allocates such blocks again and again: the
logits of every micro-batch and their gradient ([8, 33, 49 152] float32 is 52 MiB), the gradient
of the LM head and of each tied embedding ([49 152, 576] is 113 MiB), the reference's logits.
Each comes back as fresh pages, and the kernel faults in and zeroes every 4 KiB page on first
touch: close to 2 GB of such blocks per SmolLM2-135M iteration of BENCHMARKS.md, faulted in at
1-2 GB/s on its 2-core VMs (68 000 faults, 0.15-0.25 s, per micro-batch's blocks in isolation).
`keep_freed_memory` tells glibc to serve every block from its heap and never to trim it, so a
freed block is reused without a fault: what torch's CUDA caching allocator does on the GPU. It
changes no number (the same kernels run on the same values); the process's resident memory stays
at its high-water mark instead of falling between phases.

It applies to glibc only (Linux); elsewhere it does nothing and says so.

>>> keep_freed_memory(False)  # glibc: its default values back; elsewhere: False
True
"""

from __future__ import annotations

import ctypes
import functools
import platform

# mallopt parameters (malloc.h) and glibc's default values of the two set here (once set, the
# trim threshold no longer adapts to freed mmapped blocks, as glibc's untouched default does)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_MMAP_MAX: 65536}
NEVER_TRIM = 2**31 - 1  # mallopt takes a C int


@functools.lru_cache(maxsize=None)
def _mallopt():
    """glibc's ``mallopt``, or None (another C library)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory(on: bool = True) -> bool:
    """``on``: every later ``malloc`` comes from glibc's heap (no ``mmap``) and the heap is never
    trimmed; off: glibc's default values again. False where the C library is not glibc (nothing
    set). Process-wide: it holds for every thread and for whatever else runs in the process."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    wanted = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: NEVER_TRIM} if on else DEFAULTS
    return all(mallopt(param, value) == 1 for param, value in wanted.items())
