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
# index, or made by an earlier search), on a CPU without AMX, from this many rows (the sidecar's own threshold),
# from INT8_MIN_QUERIES queries where its product is u8 x s8 (VNNI; fewer: the faiss scan), and for
# INT8_MIN_QUERIES_U8..INT8_MAX_QUERIES_U8 where it is u8 x u8. 1M x 256 rows on the 2-core EPYC with AVX512-BF16 and
# VNNI (u8 x s8), ms, torch-free, each kernel forced: 1 / 8 / 64 queries int8 40 / 57 / 151, onnxruntime 101 / 92 /
# 219, faiss scan 20 / 130 / 803 (benchmarks/speed/bench_search_many.py, with auto's pick). The u8 x u8 range is the
# 2-core EPYC without AVX-512's, measured with the pass before this one (the codes as the product's constant
# operand): the faster for 1-8 queries there, onnxruntime's float32 pass from 16.
INT8_MIN_ROWS = codes.MIN_ROWS
INT8_MIN_QUERIES = FAISS_SCAN_MAX_QUERIES + 1
INT8_MIN_QUERIES_U8 = 1
INT8_MAX_QUERIES_U8 = 8
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
        int8 = sixteen_bit and _int8_ready(embeddings)
        kernel = auto_kernel(n, len(queries), sixteen_bit, int8=int8, int8_signed=bool(exact_int8.signed(dim)))
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
    """Whether ``auto`` may use the int8 pass on these rows: enough of them, their codes at hand, and the product
    checked exact here (by ``prepare``, or an int8 search before: ``auto`` does not stop to check it)."""
    n, dim = embeddings.shape
    if not (n >= INT8_MIN_ROWS and not cpu_amx() and exact_int8.checked(dim)):
        return False
    return codes.ready(embeddings)


def prepare(embeddings) -> bool:
    """Ready what ``auto`` will search these rows with, so that a server's first queries do not wait for it: the
    int8 codes of 16-bit rows ``auto`` would search with them (their sidecar: opened, or made once if the rows have
    none, ``codes.for_rows``) and, on a thread of its own, the check of the int8 product (``auto`` uses the other
    kernels until it is done). Returns whether the int8 codes are at hand."""
    sixteen_bit = isinstance(embeddings, BF16Rows) or getattr(embeddings, "dtype", None) == np.float16
    n, dim = embeddings.shape
    if not (sixteen_bit and n >= INT8_MIN_ROWS and not cpu_amx()
            and dim <= exact_int8.MAX_DIM and exact_ort.ort_available()):
        return False
    try:
        made = codes.for_rows(embeddings, make=codes.source_file(embeddings) is not None)
    except ValueError:   # rows that are not finite: the other kernels search them
        return False
    if made is not None:
        exact_int8.prepare(made, background=True)
    return made is not None


def auto_kernel(n: int, n_queries: int, sixteen_bit: bool, int8: bool = False, int8_signed: bool = True) -> str:
    """The exact-search kernel ``auto`` picks for ``n`` rows and ``n_queries`` queries (see the package docstring):
    the faiss scan for a few queries over float16 / bfloat16 rows (torch loaded or not); for more, on a CPU with
    AMX, torch's bf16 matrix products when torch is already imported (importing it costs seconds), else
    onnxruntime's float32 ones (a core dependency, already loaded for the query towers); on a CPU without AMX
    (AVX512-BF16 alone, or no bf16), onnxruntime's with torch loaded or not (its one-thread-per-core float32 pass
    is the faster one there: on the AVX512-BF16 EPYC, 64 queries over 1M x 256 rows, 211 ms against torch's bf16
    292 ms); numpy for small or float32 matrices. The int8 pass before all of them where the rows' int8 codes are
    at hand (``int8``), on a CPU without AMX, for the query counts where it is measured the faster
    (from ``INT8_MIN_QUERIES`` for the u8 x s8 product, ``int8_signed``; ``INT8_MIN_QUERIES_U8`` to
    ``INT8_MAX_QUERIES_U8`` for the u8 x u8 one)."""
    if not sixteen_bit:
        return "numpy"
    ort = n >= ORT_MIN_ROWS and exact_ort.ort_available()
    queries = (n_queries >= INT8_MIN_QUERIES if int8_signed
               else INT8_MIN_QUERIES_U8 <= n_queries <= INT8_MAX_QUERIES_U8)
    if int8 and ort and n >= INT8_MIN_ROWS and not cpu_amx() and queries:
        return "int8"
    torch = "torch" in sys.modules and n >= TORCH_MIN_ROWS and (cpu_amx() or not ort)
    few = (FAISS_SCAN_MAX_QUERIES if torch else FAISS_SCAN_MAX_QUERIES_NO_TORCH if cpu_native_bf16()
           else FAISS_SCAN_MAX_QUERIES_NO_BF16)
    if (n_queries <= few and (n >= FAISS_SCAN_MIN_ROWS or "faiss" in sys.modules)
            and exact_faiss.faiss_scan_available()):
        return "faiss"
    return "torch" if torch else "onnxruntime" if ort else "numpy"
