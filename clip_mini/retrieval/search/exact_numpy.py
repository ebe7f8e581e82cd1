"""The numpy exact-search kernel (always available; ``auto``'s pick for small or float32 matrices).

Each chunk of the (N, d) matrix (a memory map, so an index larger than RAM works) is widened to float32 in a reused
cache-sized buffer (float32 rows are used where they lie) and scored with one BLAS product. A large matrix keeps
only group maxima of the scores (``groups``); a small one, or a caller's ``chunk_rows``, each query's top
``k + 32`` (``shortlist.floor_and_rescore``); either way the short list is re-scored exactly.
"""
from __future__ import annotations

import numpy as np

from clip_mini.retrieval.rows import BF16Rows, bf16_bits_to_f32
from clip_mini.retrieval.search import bounds, groups, shortlist

GROUPED_MIN_ROWS = 65_536   # from here the group-maxima pass (below it the per-query short lists cost little)
_GROUPED_CHUNK = 8192       # rows per product in that pass


def search(embeddings, queries: np.ndarray, k: int, chunk_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 scores chunk by chunk from one BLAS product each, then the short list and exact re-scoring every
    kernel shares: a BLAS product may round equal rows differently by where they fall in its blocks, so its own
    order is not the float32 top-K with ties by row id.

    Args:
        chunk_rows: rows scored per product (default: an 8 MB float32 block, which stays in cache between the
            conversion and the product; from ``GROUPED_MIN_ROWS`` rows, the group-maxima pass's chunk).
    """
    n, dim = embeddings.shape
    # float16, bfloat16 and float32 rows widen to float32 exactly: only the accumulation rounds; wider rows are
    # rounded to float32 once on the way in
    exact = isinstance(embeddings, BF16Rows) or embeddings.dtype in (np.float16, np.float32)
    margin = bounds.margin(0.0, 0, dim) if exact else bounds.margin(bounds.F32_U, 1, dim)
    if chunk_rows is None and n >= GROUPED_MIN_ROWS and groups.usable(n, k):
        return groups.search(embeddings, queries, k, lambda rows, q: _scorer(embeddings, q, rows), margin,
                             _GROUPED_CHUNK, workers=1)
    chunk_rows = max(chunk_rows or (1 << 21) // dim, 1)
    return shortlist.floor_and_rescore(embeddings, queries, k, lambda q: _chunks(embeddings, q, chunk_rows), margin)


def _widen(embeddings, start: int, stop: int, block: np.ndarray | None) -> np.ndarray:
    """Rows start..stop as float32: float32 rows in memory where they lie, others converted into ``block``."""
    if block is None:
        return embeddings[start:stop]
    rows = block[:stop - start]
    if isinstance(embeddings, BF16Rows):
        return bf16_bits_to_f32(embeddings.bits[start:stop], out=rows)
    np.copyto(rows, embeddings[start:stop], casting="unsafe")   # float16 -> float32
    return rows


def _in_place(embeddings) -> bool:
    return not isinstance(embeddings, BF16Rows) and isinstance(embeddings, np.ndarray) \
        and embeddings.dtype == np.float32


def _scorer(embeddings, queries: np.ndarray, chunk: int) -> groups.Score:
    """A ``groups.Score`` with its own conversion buffer: (rows, d) float32 @ (d, Q) into the caller's block."""
    qT = np.ascontiguousarray(queries.T)
    block = None if _in_place(embeddings) else np.empty((min(chunk, len(embeddings)), embeddings.shape[1]),
                                                        np.float32)

    def score(start: int, stop: int, out: np.ndarray) -> None:
        np.matmul(_widen(embeddings, start, stop, block), qT, out=out)

    return score


def _chunks(embeddings, queries: np.ndarray, chunk_rows: int):
    """(start, scores of rows start.. for every query) chunk by chunk; the scores array is reused. float32 rows in
    memory are multiplied where they lie; others are converted into a reused cache-sized buffer first."""
    n, dim = embeddings.shape
    step = min(chunk_rows, n)
    # Buffers reused for every chunk: fresh arrays per chunk cost page faults that dominate the arithmetic.
    block = None if _in_place(embeddings) else np.empty((step, dim), np.float32)
    sims = np.empty((len(queries), step), np.float32)
    for start in range(0, n, step):
        c = min(step, n - start)
        np.matmul(queries, _widen(embeddings, start, start + c, block).T, out=sims[:, :c])  # (Q, c)
        yield start, sims[:, :c]
