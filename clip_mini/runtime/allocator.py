"""Keep freed host memory in the process, so a training step or a tower pass does not page-fault its tensors in afresh.

PyTorch's CPU allocator hands every tensor to ``malloc`` and every free back to it. glibc's malloc serves a block
above its mmap threshold (128 KiB at start, raised dynamically up to 32 MiB) with fresh ``mmap``'d pages and
unmaps them on free, and it gives the top of the heap back to the kernel once more than its trim threshold is free
there. A step allocates and frees the same activations every time, so every step the kernel zero-fills them again,
one page fault per 4 KiB page. Here no block is ``mmap``'d (``M_MMAP_MAX`` 0: large ones come from the heap too,
so the raised threshold's 32 MiB cap no longer matters: DINOv2's MLP activations at batch 64 are 50 MB each) and
up to ``trim_mib`` of free heap top is kept: the next step reuses the same memory without a fault. What that gives
is measured in ``benchmarks/results/speed/allocator.json``. The default keeps 2047 MiB, the most ``mallopt`` takes
(a C int of bytes): with a smaller cap such as 512 MiB, a training step that runs both locked towers on pixels
(``frozen_features: 0``) still swings its heap top past the threshold every step and faults its pages in again,
spending a large share of the step in the kernel. The price is that up to ``trim_mib`` of freed memory stays with
the process instead of going back to the system, and freed blocks below the heap top are reused rather than
returned. glibc still maps fresh memory where the heap cannot grow, and in threads other than the main one for
blocks larger than their 64 MiB arenas.

A process-wide setting, so the programs (``train.py``, ``clip-mini``) call it at start; importing clip_mini does
not. Elsewhere than Linux with glibc it changes nothing and returns False.
"""
from __future__ import annotations

import ctypes
import sys

# mallopt(3) parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_TRIM_MIB = 2047   # the most mallopt takes: its value is a C int of bytes


def keep_freed_memory(trim_mib: int = DEFAULT_TRIM_MIB) -> bool:
    """No ``mmap``'d blocks and a ``trim_mib`` trim threshold for glibc's malloc; True when both were accepted.

    False (and nothing changed) where there is no glibc ``mallopt`` (macOS, Windows, musl).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)   # the process's own symbols: libc is loaded; find_library would run ldconfig
        mallopt = libc.mallopt
        libc.gnu_get_libc_version   # glibc only: musl has a mallopt that ignores these parameters
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim = min(int(trim_mib) * 1024 * 1024, 2**31 - 1)   # mallopt takes a C int
    return bool(mallopt(M_TRIM_THRESHOLD, trim)) & bool(mallopt(M_MMAP_MAX, 0))
