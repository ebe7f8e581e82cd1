"""Keep freed host memory in the process, so a training step does not page-fault its activations in afresh.

PyTorch's CPU allocator hands every tensor to ``malloc`` and every free back to it. glibc's malloc serves a block
above its mmap threshold (128 KiB at start, raised dynamically up to 32 MiB) with fresh ``mmap``'d pages, and gives
the top of the heap back to the kernel once more than its trim threshold (128 KiB) is free there. A training step
allocates and frees the same activations every step, so each step the kernel zero-fills them again, one page fault
per 4 KiB page: about 40,000 faults and 0.06 s of kernel time a step at open_clip's tiny-CLIP size, batch 128
(``benchmarks/bench_train.py``, ``results/train_allocator.json``). Fixing the mmap threshold at glibc's largest
(32 MiB, which also stops the dynamic raise) and the trim threshold at 512 MiB keeps those blocks in the heap: the
next step reuses them without a fault. The price is that up to ``trim_mib`` of freed memory stays with the
process instead of going back to the system.

A process-wide setting, so the programs (``train.py``, ``clip-mini``) call it at start; importing clip_mini does
not. Elsewhere than Linux with glibc it does nothing and says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt(3) parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024   # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_memory(trim_mib: int = 512) -> bool:
    """Set glibc's mmap threshold to 32 MiB and its trim threshold to ``trim_mib``; True when both were accepted.

    False (and nothing changed) where there is no glibc ``mallopt`` (macOS, Windows, musl).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version   # glibc only: musl's mallopt ignores these parameters
    except (OSError, AttributeError):
        return False
    del gnu_get_libc_version
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim = min(int(trim_mib) * 1024 * 1024, 2**31 - 1)   # mallopt takes a C int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) & bool(mallopt(M_TRIM_THRESHOLD, trim))
