"""``exact_search``: checks its input and hands it to one of the four exact kernels, ``auto_kernel``'s pick unless
the caller names one. Every kernel gives the same result: the float32 top-K of the rows as stored, ties by row id.
"""
from __future__ import annotations

import sys

import numpy as np

from clip_mini.retrieval.rows import BF16Rows
from clip_mini.runtime import isa
from clip_mini.retrieval.search import exact_faiss, exact_numpy, exact_ort, exact_torch, shortlist

KERNELS = ("auto", "numpy", "onnxruntime", "torch", "faiss")
TORCH_MIN_ROWS = 50_000   # below this the numpy kernel takes a few ms anyway
# The faiss scan reads the whole matrix once per query per core, the matrix-product kernels once for all queries:
# up to this many queries the scan is the faster one (benchmarks/bench_search.py: exact_faiss against
# exact_torch with torch loaded, against exact_onnxruntime in torch_free).
FAISS_SCAN_MAX_QUERIES = 4
FAISS_SCAN_MAX_QUERIES_NO_TORCH = 4
FAISS_SCAN_MIN_ROWS = 50_000   # below this numpy takes a few ms, less than importing faiss
ORT_MIN_ROWS = 50_000          # likewise for building the onnxruntime session


def exact_search(embeddings: np.ndarray, queries: np.ndarray, k: int = 10, chunk_rows: int | None = None,
                 kernel: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-K.

    Args:
        embeddings: (N, d) stored rows (float16 memmap, ``BF16Rows``, or a float32 array), L2-normalised.
        queries: (Q, d) or (d,) float32, L2-normalised.
        k: results per query; clipped to N.
        chunk_rows: rows scored per step of the numpy kernel (default: an 8 MB float32 block, which stays in cache
            between the conversion and the product).
        kernel: "numpy", "onnxruntime", "torch", "faiss", or "auto" (``auto_kernel``; see the package docstring).

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
        kernel = auto_kernel(n, len(queries), isinstance(embeddings, BF16Rows) or embeddings.dtype == np.float16)
    if kernel == "torch":
        return exact_torch.search(embeddings, queries, k)
    if kernel == "faiss":
        return exact_faiss.search(embeddings, queries, k)
    if kernel == "onnxruntime":
        return exact_ort.search(embeddings, queries, k)
    return exact_numpy.search(embeddings, queries, k, chunk_rows)


def auto_kernel(n: int, n_queries: int, sixteen_bit: bool) -> str:
    """The exact-search kernel ``auto`` picks for ``n`` rows and ``n_queries`` queries (see the package docstring):
    the faiss scan for a few queries over float16 / bfloat16 rows (torch loaded or not); for more, torch's matrix
    products when torch is already imported (importing it costs seconds) and the CPU multiplies bf16 natively, else
    onnxruntime's (a core dependency, already loaded for the query towers); numpy for small or float32 matrices.

    Without native bf16 (an AVX2-only CPU) torch's pass multiplies float32, and onnxruntime's Cast + Gemm was faster
    there (1M x 256 float16 rows, 2-core EPYC, torch loaded: 8 queries 134 ms against 272, 12 queries 226 against
    321; ``benchmarks/speed/bench_serve.py --arm 1m`` serves such batches)."""
    torch_loaded = "torch" in sys.modules and isa.cpu_native_bf16()
    if not sixteen_bit:
        return "numpy"
    few = FAISS_SCAN_MAX_QUERIES if torch_loaded and n >= TORCH_MIN_ROWS else FAISS_SCAN_MAX_QUERIES_NO_TORCH
    if (n_queries <= few and (n >= FAISS_SCAN_MIN_ROWS or "faiss" in sys.modules)
            and exact_faiss.faiss_scan_available()):
        return "faiss"
    if torch_loaded and n >= TORCH_MIN_ROWS:
        return "torch"
    return "onnxruntime" if n >= ORT_MIN_ROWS and exact_ort.ort_available() else "numpy"
