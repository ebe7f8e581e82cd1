"""``exact_search``: checks its input and hands it to one of the five exact kernels, ``auto_kernel``'s pick unless
the caller names one. Every kernel gives the same result: the float32 top-K of the rows as stored, ties by row id.
"""
from __future__ import annotations

import sys
from collections import Counter

import numpy as np

from clip_mini.retrieval.rows import BF16Rows
from clip_mini.retrieval.search import codes, exact_faiss, exact_int8, exact_numpy, exact_ort, exact_torch, shortlist
from clip_mini.runtime.isa import cpu_amx, cpu_native_bf16

KERNELS = ("auto", "numpy", "onnxruntime", "torch", "faiss", "int8")
TORCH_MIN_ROWS = 50_000   # below this the numpy kernel takes a few ms anyway
# The faiss scan reads the whole matrix once per query per core, the matrix-product kernels once for all queries:
# up to this many queries the scan is the faster one. Against torch's bf16 products (torch loaded, a CPU with
# native bf16) and against onnxruntime's float32 pass on such a CPU: benchmarks/speed/bench_search.py
# (exact_faiss against exact_torch and exact_onnxruntime). On a CPU without native bf16, where onnxruntime's float32
# pass is the matrix-product kernel with torch loaded or not: benchmarks/speed/bench_search_many.py.
FAISS_SCAN_MAX_QUERIES = 4
FAISS_SCAN_MAX_QUERIES_NO_TORCH = 4
FAISS_SCAN_MAX_QUERIES_NO_BF16 = 4
FAISS_SCAN_MIN_ROWS = 50_000   # below this numpy takes a few ms, less than importing faiss
ORT_MIN_ROWS = 50_000          # likewise for building the onnxruntime session
# The int8 pass (``exact_int8``) where the rows' codes are at hand (``codes.ready``: a sidecar written with the
# index, or made by an earlier search), on a CPU without AMX (where it was measured), from this many rows
# (the sidecar's own threshold), for INT8_MIN_QUERIES..INT8_MAX_QUERIES queries, and while the packed copy of the
# codes each process makes for it stays within INT8_MAX_BYTES.
# 1M rows, 2-core EPYC without AVX-512 (benchmarks/speed/bench_search_many.py, and the same kernels at width 128 on
# random rows, ms): width 128, 1 / 2 / 4 / 8 / 16 / 32 queries: int8 14.6 / 15.7 / 26.8 / 39.3 / 75 / 154,
# faiss scan 13.2 / 24.0 / 52.5 / 90.9 / 182, onnxruntime 100 / 80 / 63 / 60 / 78 / 128; width 256 (clustered):
# int8 33.6 / 36.2 / 59.0 / 101 / 207 / 393, faiss scan 21.4 / 41.6 / 79.0 / 153 / 353, onnxruntime 107 / 111 /
# 112 / 113 / 158 / 221; onnxruntime's float32 pass is the faster from 16 queries. One query, measured again 15
# times round-robin: int8 16.2 / faiss 16.3 (width 128), 38.2 / 38.4 (256): a tie, and the int8 pass is the pick
# (bench_search_many's one query, width 256: int8 19.2, faiss 23.1). On the 2-core EPYC with AVX512-BF16 (no AMX),
# width 256, torch loaded / not: 8 queries int8 67 / 77, onnxruntime 83 / 94, torch 152, faiss scan 117 / 131;
# one query int8 18.8 / 24.9, faiss scan 23.0 / 20.9.
INT8_MIN_ROWS = codes.MIN_ROWS
INT8_MIN_QUERIES = 1
INT8_MAX_QUERIES = 8
INT8_MAX_BYTES = 1 << 30
# searches per kernel in this process (a server's /api/info shows them)
searches: Counter = Counter()


def exact_search(embeddings: np.ndarray, queries: np.ndarray, k: int = 10, chunk_rows: int | None = None,
                 kernel: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-K.

    Args:
        embeddings: (N, d) stored rows (float16 memmap, ``BF16Rows``, or a float32 array), L2-normalised.
        queries: (Q, d) or (d,) float32, L2-normalised.
        k: results per query; clipped to N.
        chunk_rows: rows scored per step of the numpy kernel (default: an 8 MB float32 block, which stays in cache
            between the conversion and the product).
        kernel: "numpy", "onnxruntime", "torch", "faiss", "int8", or "auto" (``auto_kernel``; see the package
            docstring). "int8" makes the rows' int8 codes if they have none (``codes.for_rows``: a sidecar beside a
            memory-mapped ``.npy``, written once; rows in memory, every call); ``auto`` picks it only where they
            are at hand.

    Returns:
        ``scores`` (Q, k) float32 cosine similarities, best first, ties by row id, and ``ids`` (Q, k) int64 row
        numbers.

    Raises:
        ValueError: bad queries or ``k``, an unknown kernel, or rows of a type the kernel named does not read.
    """
    n, dim = embeddings.shape
    queries = shortlist.check_queries(queries, dim, k)
    k = min(k, n)
    if kernel not in KERNELS:
        raise ValueError(f"unknown exact-search kernel {kernel!r} (use {', '.join(KERNELS)})")
    if n == 0:   # an empty index: no results, from every kernel
        return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
    if kernel == "auto":
        sixteen_bit = isinstance(embeddings, BF16Rows) or embeddings.dtype == np.float16
        kernel = auto_kernel(n, len(queries), sixteen_bit, int8=sixteen_bit and _int8_ready(embeddings))
    searches[kernel] += 1
    if kernel == "int8":
        return exact_int8.search(embeddings, queries, k)
    if kernel == "torch":
        return exact_torch.search(embeddings, queries, k)
    if kernel == "faiss":
        return exact_faiss.search(embeddings, queries, k)
    if kernel == "onnxruntime":
        return exact_ort.search(embeddings, queries, k)
    return exact_numpy.search(embeddings, queries, k, chunk_rows)


def _int8_ready(embeddings) -> bool:
    """Whether ``auto`` may use the int8 pass on these rows: enough of them, their codes at hand, not too many
    for the packed copy, the product checked exact here (by ``prepare``, or an int8 search before: ``auto`` does
    not stop to check it), and no session being built for them in the background."""
    n, dim = embeddings.shape
    if not (n >= INT8_MIN_ROWS and n * dim <= INT8_MAX_BYTES and not cpu_amx() and exact_int8.checked(dim)):
        return False
    made = codes.for_rows(embeddings, make=False) if codes.ready(embeddings) else None
    return made is not None and not exact_int8.busy(made)


def prepare(embeddings) -> bool:
    """Ready what ``auto`` will search these rows with, so that a server's first queries do not wait for it: the
    int8 codes of 16-bit rows ``auto`` would search with them (their sidecar: opened, or made once if the rows have
    none, ``codes.for_rows``) and, on a thread of its own, the check of the int8 product and the kernel's session
    (``auto`` uses the other kernels until they are ready). Returns whether the int8 codes are at hand."""
    sixteen_bit = isinstance(embeddings, BF16Rows) or getattr(embeddings, "dtype", None) == np.float16
    n, dim = embeddings.shape
    if not (sixteen_bit and n >= INT8_MIN_ROWS and n * dim <= INT8_MAX_BYTES and not cpu_amx()
            and dim <= exact_int8.MAX_DIM and exact_ort.ort_available()):
        return False
    try:
        made = codes.for_rows(embeddings, make=codes.source_file(embeddings) is not None)
    except ValueError:   # rows that are not finite: the other kernels search them
        return False
    if made is not None:
        exact_int8.prepare(made, background=True)
    return made is not None


def auto_kernel(n: int, n_queries: int, sixteen_bit: bool, int8: bool = False) -> str:
    """The exact-search kernel ``auto`` picks for ``n`` rows and ``n_queries`` queries (see the package docstring):
    the faiss scan for a few queries over float16 / bfloat16 rows (torch loaded or not); for more, on a CPU with
    AMX, torch's bf16 matrix products when torch is already imported (importing it costs seconds), else
    onnxruntime's float32 ones (a core dependency, already loaded for the query towers); on a CPU without AMX
    (AVX512-BF16 alone, or no bf16), onnxruntime's with torch loaded or not (its one-thread-per-core float32 pass
    is the faster one there: on the AVX512-BF16 EPYC, 64 queries over 1M x 256 rows, 211 ms against torch's bf16
    292 ms); numpy for small or float32 matrices. The int8 pass before all of them where the rows' int8 codes are
    at hand (``int8``), on a CPU without AMX, for the query counts where it is measured the faster
    (``INT8_MIN_QUERIES``..``INT8_MAX_QUERIES``)."""
    if not sixteen_bit:
        return "numpy"
    ort = n >= ORT_MIN_ROWS and exact_ort.ort_available()
    if (int8 and ort and n >= INT8_MIN_ROWS and not cpu_amx()
            and INT8_MIN_QUERIES <= n_queries <= INT8_MAX_QUERIES):
        return "int8"
    torch = "torch" in sys.modules and n >= TORCH_MIN_ROWS and (cpu_amx() or not ort)
    few = (FAISS_SCAN_MAX_QUERIES if torch else FAISS_SCAN_MAX_QUERIES_NO_TORCH if cpu_native_bf16()
           else FAISS_SCAN_MAX_QUERIES_NO_BF16)
    if (n_queries <= few and (n >= FAISS_SCAN_MIN_ROWS or "faiss" in sys.modules)
            and exact_faiss.faiss_scan_available()):
        return "faiss"
    return "torch" if torch else "onnxruntime" if ort else "numpy"
