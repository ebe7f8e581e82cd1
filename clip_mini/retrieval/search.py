"""Search back ends over stored float16 embeddings: exact (chunked matrix product) and faiss (HNSW or IVF).

Exact search reads the (N, d) float16 matrix chunk by chunk (a memory map, so an index larger than RAM works),
converts each chunk to float32 in a reused cache-sized buffer (fp16 arithmetic is emulated on CPUs without
AVX512-FP16 and ~100x slower) and scores it with one BLAS product. Top-K is kept with ``argpartition``; only
scores above the running K-th best are looked at, so after the first chunks the bookkeeping is one comparison.

faiss (``pip install 'clip-mini[faiss]'``) is approximate and worth it for large indexes: its stored graph or
inverted lists avoid touching every row. It is imported only when used.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np

FaissKind = Literal["hnsw", "ivf", "ivfpq"]
# Above this many rows `auto` prefers a stored faiss index: exact search time grows with the rows (the float16 ->
# float32 conversion dominates, far above the time to read the matrix once) while faiss IVF stays in milliseconds
# at recall@10 1.0 on clustered data. Figures: benchmarks/results/search.json (benchmarks/bench_search.py).
FAISS_THRESHOLD = 500_000
# Above this many rows `auto` builds IVF-PQ instead of HNSW: HNSW keeps float32 rows plus its graph in RAM
# (~1.3 KB a row at d=256: 2.6 GB at 2M rows), IVF-PQ d/8 bytes of code and an 8-byte id (40 B a row at d=256:
# 0.4 GB at 10M), its approximate scores re-ranked exactly from the memory-mapped float16 rows.
# Figures: benchmarks/results/index_10m.json (benchmarks/bench_index_10m.py).
IVFPQ_THRESHOLD = 2_000_000
IVFPQ_MIN_ROWS = 10_000   # PQ's 256 centroids per sub-vector need ~39 training rows each
RERANK = 10               # IVF-PQ candidates per wanted result, re-scored exactly


def _check_queries(queries: np.ndarray, dim: int, k: int) -> np.ndarray:
    queries = np.asarray(queries, dtype=np.float32)
    if queries.ndim == 1:
        queries = queries[None]
    if queries.ndim != 2 or queries.shape[1] != dim:
        raise ValueError(f"queries must be (n, {dim}) or ({dim},), got shape {queries.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return np.ascontiguousarray(queries)


def _sort_topk(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Best first; equal scores ordered by row id so results are deterministic.
    order = np.lexsort((ids, -scores), axis=-1)
    return np.take_along_axis(scores, order, -1), np.take_along_axis(ids, order, -1)


def exact_search(embeddings: np.ndarray, queries: np.ndarray, k: int = 10, chunk_rows: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-K.

    Args:
        embeddings: (N, d) stored rows (float16 memmap or any array), L2-normalised.
        queries: (Q, d) or (d,) float32, L2-normalised.
        k: results per query; clipped to N.
        chunk_rows: rows scored per step (default: an 8 MB float32 block, which stays in cache between the
            conversion and the product).

    Returns:
        ``scores`` (Q, k) float32 cosine similarities, best first, and ``ids`` (Q, k) int64 row numbers.
    """
    n, dim = embeddings.shape
    queries = _check_queries(queries, dim, k)
    k = min(k, n)
    chunk_rows = max(chunk_rows or (1 << 21) // dim, 1)
    # Buffers reused for every chunk: fresh arrays per chunk cost page faults that dominate the arithmetic.
    block = np.empty((min(chunk_rows, n), dim), np.float32)
    sims = np.empty((len(queries), min(chunk_rows, n)), np.float32)
    best_s = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_i = np.full((len(queries), k), -1, dtype=np.int64)
    for start in range(0, n, chunk_rows):
        c = min(chunk_rows, n - start)
        np.copyto(block[:c], embeddings[start:start + c], casting="unsafe")   # float16 -> float32
        np.matmul(queries, block[:c].T, out=sims[:, :c])  # (Q, c)
        _merge_chunk(best_s, best_i, sims[:, :c], start)
    return _sort_topk(best_s, best_i)


def _merge_chunk(best_s: np.ndarray, best_i: np.ndarray, sims: np.ndarray, offset: int) -> None:
    """Fold a chunk of scores into the running top-K (in place); only scores beating the K-th best are looked at."""
    kth = best_s.min(axis=1)  # (Q,)
    rows, cols = np.nonzero(sims > kth[:, None])
    if rows.size == 0:
        return
    bounds = np.searchsorted(rows, np.arange(len(best_s) + 1))
    k = best_s.shape[1]
    for q in np.flatnonzero(np.diff(bounds)):
        c = cols[bounds[q]:bounds[q + 1]]
        if len(c) > 8 * k:   # many candidates (first chunks): shortlist them before concatenating
            c = c[np.argpartition(sims[q, c], -k)[-k:]]
        cand_s = np.concatenate([best_s[q], sims[q, c]])
        cand_i = np.concatenate([best_i[q], c.astype(np.int64) + offset])
        top = np.argpartition(cand_s, -k)[-k:]
        best_s[q], best_i[q] = cand_s[top], cand_i[top]


# -- faiss ---------------------------------------------------------------------------------------------------
def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("the faiss back end needs faiss: pip install 'clip-mini[faiss]'") from None
    return faiss


def build_faiss(embeddings: np.ndarray, kind: FaissKind = "hnsw", seed: int = 0, progress: bool = False):
    """Build an inner-product faiss index over float16 rows (converted to float32 in blocks).

    HNSW (M=32) needs no training and gives high recall; IVF-Flat clusters the rows into ~4*sqrt(N) lists
    (k-means on a sample of at most 64 per list) and probes ``nprobe`` of them at query time.
    """
    faiss = _faiss()
    n, dim = embeddings.shape
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        index.hnsw.efSearch = 64
    elif kind == "ivf":
        nlist = max(1, min(int(4 * math.sqrt(n)), n // 39 or 1))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(n, size=min(n, nlist * 64), replace=False))
        index.train(np.asarray(embeddings[sample], dtype=np.float32))
        index.nprobe = min(nlist, 16)
    elif kind == "ivfpq":
        index = _ivfpq(faiss, embeddings, seed)
    else:
        raise ValueError(f"unknown faiss index kind {kind!r} (use 'hnsw', 'ivf' or 'ivfpq')")
    step = 65536
    blocks = range(0, n, step)
    if progress:
        from tqdm import tqdm

        blocks = tqdm(blocks, desc=f"faiss {kind}", unit="block", leave=False)
    for start in blocks:
        index.add(np.asarray(embeddings[start:start + step], dtype=np.float32))
    return index


def _ivfpq(faiss, embeddings: np.ndarray, seed: int):
    """IVF-PQ: sqrt(N) lists (at most 4096), d/8 sub-vectors of 8 bits (d/8 bytes a row), trained on a sample."""
    n, dim = embeddings.shape
    if n < IVFPQ_MIN_ROWS:
        raise ValueError(f"an IVF-PQ index needs at least {IVFPQ_MIN_ROWS} rows, this one has {n}: use hnsw or ivf")
    if dim % 8:
        raise ValueError(f"IVF-PQ splits rows into d/8 sub-vectors: d={dim} is not a multiple of 8")
    nlist = max(1, min(int(math.sqrt(n)), 4096))
    index = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, dim // 8, 8, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=min(n, max(nlist * 39, 256 * 39)), replace=False))
    index.train(np.asarray(embeddings[sample], dtype=np.float32))
    index.nprobe = min(nlist, 32)
    return index


def faiss_search(index, queries: np.ndarray, k: int = 10, dim: int | None = None,
                 rerank: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Search a faiss index; same return contract as ``exact_search`` (missing results dropped by clipping k).

    With ``rerank`` (the stored (N, d) rows, a memory map) the index proposes ``RERANK * k`` candidates per query
    and their exact inner products pick the top k: scores are then exact, only the candidate list is approximate.
    """
    queries = _check_queries(queries, dim or index.d, k)
    k = min(k, index.ntotal)
    if rerank is None:
        scores, ids = index.search(queries, k)
        return _sort_topk(scores.astype(np.float32), ids.astype(np.int64))
    _, cand = index.search(queries, min(RERANK * k, index.ntotal))
    best_s = np.full((len(queries), k), -np.inf, np.float32)
    best_i = np.full((len(queries), k), -1, np.int64)
    for q, c in enumerate(cand):
        c = np.unique(c[c >= 0])   # sorted row ids: the memory map is read front to back
        s = np.asarray(rerank[c], dtype=np.float32) @ queries[q]
        top = np.argsort(-s, kind="stable")[:k]
        best_s[q, :len(top)], best_i[q, :len(top)] = s[top], c[top]
    return _sort_topk(best_s, best_i)


def save_faiss(index, path: str | Path) -> None:
    from clip_mini.io import atomic_write_with

    faiss = _faiss()
    atomic_write_with(path, lambda tmp: faiss.write_index(index, str(tmp)))


def load_faiss(path: str | Path):
    """Read a faiss index file (a plain binary format: no pickle). Its checksum is verified by the caller."""
    return _faiss().read_index(str(path))


def faiss_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("faiss") is not None
