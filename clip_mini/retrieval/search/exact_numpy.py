"""The numpy exact-search kernel (always available; ``auto``'s pick for small or float32 matrices).

Each chunk of the (N, d) matrix (a memory map, so an index larger than RAM works) is widened to float32 in a reused
cache-sized buffer (float32 rows are used where they lie) and scored with one BLAS product; each query's top
``k + 32`` is kept and re-scored exactly (``shortlist.floor_and_rescore``).
"""
from __future__ import annotations

import numpy as np

from clip_mini.retrieval.rows import BF16Rows, bf16_bits_to_f32
from clip_mini.retrieval.search import bounds, shortlist


def search(embeddings, queries: np.ndarray, k: int, chunk_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 scores chunk by chunk from one BLAS product each, then the short list and exact re-scoring every
    kernel shares: a BLAS product may round equal rows differently by where they fall in its blocks, so its own
    order is not the float32 top-K with ties by row id.

    Args:
        chunk_rows: rows scored per product (default: an 8 MB float32 block, which stays in cache between the
            conversion and the product).
    """
    dim = embeddings.shape[1]
    chunk_rows = max(chunk_rows or (1 << 21) // dim, 1)
    # float16, bfloat16 and float32 rows widen to float32 exactly: only the accumulation rounds; wider rows are
    # rounded to float32 once on the way in
    exact = isinstance(embeddings, BF16Rows) or embeddings.dtype in (np.float16, np.float32)
    margin = bounds.margin(0.0, 0, dim) if exact else bounds.margin(bounds.F32_U, 1, dim)
    return shortlist.floor_and_rescore(embeddings, queries, k, lambda q: _chunks(embeddings, q, chunk_rows), margin)


def _chunks(embeddings, queries: np.ndarray, chunk_rows: int):
    """(start, scores of rows start.. for every query) chunk by chunk; the scores array is reused. float32 rows in
    memory are multiplied where they lie; others are converted into a reused cache-sized buffer first."""
    n, dim = embeddings.shape
    step = min(chunk_rows, n)
    bf16 = isinstance(embeddings, BF16Rows)
    in_place = not bf16 and isinstance(embeddings, np.ndarray) and embeddings.dtype == np.float32
    # Buffers reused for every chunk: fresh arrays per chunk cost page faults that dominate the arithmetic.
    block = None if in_place else np.empty((step, dim), np.float32)
    sims = np.empty((len(queries), step), np.float32)
    for start in range(0, n, step):
        c = min(step, n - start)
        if in_place:
            rows = embeddings[start:start + c]
        elif bf16:
            rows = bf16_bits_to_f32(embeddings.bits[start:start + c], out=block[:c])
        else:
            rows = block[:c]
            np.copyto(rows, embeddings[start:start + c], casting="unsafe")   # float16 -> float32
        np.matmul(queries, rows.T, out=sims[:, :c])  # (Q, c)
        yield start, sims[:, :c]
