"""What every exact-search kernel shares: query checks, the running top-K of a chunked pass, the floor below which
no true top-K row can score (``bounds.margin``), and exact re-scoring of the short list.

The rule all kernels keep: the float32 top-K of the rows as stored (float64 products rounded once, so equal rows
score equally), best first, ties by row id.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

# approximate results kept per query (or per faiss part) beyond k: room for near-ties before a second pass
SCAN_EXTRA = 32
RESCORE_PAIRS = 1 << 16   # short-listed (query, row) pairs re-scored per read of their rows

Chunks = Callable[[np.ndarray], Iterable[tuple[int, np.ndarray]]]
# queries -> each query's margin as it is (a kernel whose bound depends on the query, e.g. its quantization)
Margins = Callable[[np.ndarray], np.ndarray]


def check_queries(queries: np.ndarray, dim: int, k: int) -> np.ndarray:
    """``queries`` as a C-contiguous (Q, dim) float32 array; a (dim,) query becomes (1, dim).

    Raises:
        ValueError: the queries' width is not ``dim``, or ``k`` is not a positive integer.
    """
    queries = np.asarray(queries, dtype=np.float32)
    if queries.ndim == 1:
        queries = queries[None]
    if queries.ndim != 2 or queries.shape[1] != dim:
        raise ValueError(f"queries must be (n, {dim}) or ({dim},), got shape {queries.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return np.ascontiguousarray(queries)


def sort_topk(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of (scores, ids) best first; equal scores ordered by row id so results are deterministic."""
    order = np.lexsort((ids, -scores), axis=-1)
    return np.take_along_axis(scores, order, -1), np.take_along_axis(ids, order, -1)


def query_margins(margin: float | Margins, queries: np.ndarray) -> np.ndarray:
    """(Q,) float64 margins: ``margin`` (a bound for unit queries) scaled by each query's length where it is above
    1 (the bound is on sum |e_i q_i| <= |e| |q|), or, for a function, what it gives for these queries."""
    if callable(margin):
        return np.asarray(margin(queries), np.float64).reshape(len(queries))
    return margin * np.maximum(np.linalg.norm(queries.astype(np.float64), axis=1), 1.0)


def floor_and_rescore(embeddings, queries: np.ndarray, k: int, chunks: Chunks, margin: float | Margins
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The exact top-K from approximate float32 scores: ``chunks(queries)`` yields (start, (Q, c) scores of rows
    start..start + c); each query keeps its top ``k + SCAN_EXTRA``, and every row within ``margin`` (scaled by the
    query's length where it is above 1; or per query, ``query_margins``) of the approximate K-th best is re-scored
    exactly. A query whose short list ends above that floor (many near-ties, more than the list holds) gets a second
    pass collecting every row above it, so no row tied with the K-th best is lost, whatever the order the chunks'
    products put them in."""
    n = len(embeddings)
    keep = min(n, k + SCAN_EXTRA)
    best_s = np.full((len(queries), keep), -np.inf, dtype=np.float32)
    best_i = np.full((len(queries), keep), -1, dtype=np.int64)
    for start, sims in chunks(queries):
        merge_chunk(best_s, best_i, sims, start)
    floor = (-np.sort(-best_s, axis=1)[:, k - 1] - query_margins(margin, queries)).astype(np.float32)
    short = (best_s >= floor[:, None]) & (best_i >= 0)
    cand_q, cand_i = [np.nonzero(short)[0]], [best_i[short]]
    again = np.flatnonzero((best_s.min(axis=1) >= floor) & (keep < n))
    if len(again):
        for start, sims in chunks(queries[again]):
            qs, cols = np.nonzero(sims >= floor[again, None])
            cand_q.append(again[qs])
            cand_i.append(cols.astype(np.int64) + start)
    return rescore(embeddings, queries, np.concatenate(cand_q), np.concatenate(cand_i), k)


def merge_chunk(best_s: np.ndarray, best_i: np.ndarray, sims: np.ndarray, offset: int) -> None:
    """Fold a chunk of scores into the running top-K (in place); only scores beating the K-th best are looked at.

    Equal scores may go either way: the callers' floor and re-scoring decide ties, by row id."""
    k = best_s.shape[1]
    if sims.shape[1] >= k and (best_i < 0).all():   # the first chunk: one partition per query, no index lists
        top = np.argpartition(sims, sims.shape[1] - k, axis=1)[:, -k:]
        best_s[:], best_i[:] = np.take_along_axis(sims, top, 1), top + offset
        return
    kth = best_s.min(axis=1)  # (Q,)
    rows, cols = np.nonzero(sims > kth[:, None])
    if rows.size == 0:
        return
    bounds = np.searchsorted(rows, np.arange(len(best_s) + 1))
    for q in np.flatnonzero(np.diff(bounds)):
        c = cols[bounds[q]:bounds[q + 1]]
        if len(c) > 8 * k:   # many candidates (first chunks): shortlist them before concatenating
            c = c[np.argpartition(sims[q, c], -k)[-k:]]
        cand_s = np.concatenate([best_s[q], sims[q, c]])
        cand_i = np.concatenate([best_i[q], c.astype(np.int64) + offset])
        top = np.argpartition(cand_s, -k)[-k:]
        best_s[q], best_i[q] = cand_s[top], cand_i[top]


def rescore(embeddings, queries: np.ndarray, cq: np.ndarray, ci: np.ndarray, k: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """Exact float32 scores of the short-listed (query ``cq``, row ``ci``) pairs, then each query's top-K (ties by
    row id)."""
    scores = np.empty((len(queries), k), np.float32)
    ids = np.empty((len(queries), k), np.int64)
    n = len(embeddings)
    pairs = np.unique(cq.astype(np.int64) * n + ci)   # by query, then row (sorted, once each)
    qs, rows = np.divmod(pairs, n)
    bounds = np.searchsorted(qs, np.arange(len(queries) + 1))
    start = 0
    while start < len(queries):   # queries in blocks of up to RESCORE_PAIRS pairs: one read of their rows each
        stop = max(start + 1, int(np.searchsorted(bounds, bounds[start] + RESCORE_PAIRS, side="right")) - 1)
        stop = min(stop, len(queries))
        block = rows[bounds[start]:bounds[stop]]
        # each row read once, in order (the memory map is read forwards), widened to float64 once
        unique, where = np.unique(block, return_inverse=True)
        wide = np.asarray(embeddings[unique], dtype=np.float64)
        for j in range(start, stop):
            a, b = bounds[j] - bounds[start], bounds[j + 1] - bounds[start]
            r = block[a:b]
            # float64 products rounded once: equal rows get equal scores (a float32 BLAS call can round the rows of
            # one product differently, by where each falls in its vector blocks), so ties really go by row id.
            s = (wide[where[a:b]] @ queries[j].astype(np.float64)).astype(np.float32)
            # (a BF16Rows index returns its stored values exactly as float32, so these are the stored rows' scores)
            order = np.lexsort((r, -s))[:k]
            scores[j], ids[j] = s[order], r[order]
        start = stop
    return scores, ids
