"""faiss's approximate indexes (HNSW, IVF, IVF-PQ): worth it for large indexes, where their stored graph or inverted
lists avoid touching every row. Building, searching (optionally re-ranked exactly from the stored rows), saving and
loading them, and the sizes ``--faiss auto`` chooses by.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np

from clip_mini.retrieval.search import shortlist
from clip_mini.retrieval.search.faiss_lib import faiss_module

FaissKind = Literal["hnsw", "ivf", "ivfpq"]
# Above this many rows `auto` prefers a stored faiss index: exact search time grows with the rows (the float16 ->
# float32 conversion dominates, far above the time to read the matrix once) while faiss IVF stays fast at full
# recall on clustered data (benchmarks/results/speed/search.json).
FAISS_THRESHOLD = 500_000
# From this many rows `auto` builds IVF-PQ instead of HNSW: HNSW keeps float32 rows plus its graph in RAM
# (~1.3 KB a row at d=256) and builds slowly, IVF-PQ d/8 bytes of code and an 8-byte id (40 B a row) and builds
# fast, its approximate scores re-ranked exactly from the memory-mapped float16 rows. At that size on text-like
# queries it is also the faster of the two at every recall (benchmarks/results/speed/ann_real.json).
IVFPQ_THRESHOLD = 1_000_000
IVFPQ_MIN_ROWS = 10_000   # k-means of the sqrt(N) lists, and PQ's centroids, need ~39 training rows each
HNSW_M = 32   # graph neighbours per row (two levels' worth of int32 links, ~2 * M * 4 bytes a row)
# IVF-PQ candidates per wanted result, re-scored exactly: near neighbours' scores crowd together as an index grows,
# finer than PQ codes resolve, so a short list loses recall at a million rows; 50 holds it for a few hundred rows
# more read from the memory map a query (benchmarks/results/speed/index_10m.json)
RERANK = 50
_RERANK_BLOCK = 16   # queries re-ranked together (16 x 500 candidates x 256 float32: 8 MB)


def ivf_lists(n: int) -> int:
    """Inverted lists of an IVF-Flat index over ``n`` rows: ~4 sqrt(N), at least 39 rows each for k-means."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39 or 1))


def ivfpq_lists(n: int) -> int:
    return max(1, min(int(math.sqrt(n)), 4096))


def faiss_memory(kind: str, n: int, dim: int) -> int:
    """Bytes a faiss index of ``n`` rows of width ``dim`` holds in RAM when searched (the estimate ``--faiss auto``
    checks against its memory budget; ``benchmarks/results/speed/index_10m.json`` measures the real ones)."""
    if kind == "hnsw":
        return n * (4 * dim + 2 * HNSW_M * 4 + 8)                # float32 rows + links + level/offset bookkeeping
    if kind == "ivf":
        return n * (4 * dim + 8) + ivf_lists(n) * dim * 4         # float32 rows + ids + centroids
    if kind == "ivfpq":
        return n * (dim // 8 + 8) + (ivfpq_lists(n) + 16) * dim * 4    # codes + ids, centroids + PQ tables
    raise ValueError(f"unknown faiss index kind {kind!r}")


def build_faiss(embeddings: np.ndarray, kind: FaissKind = "hnsw", seed: int = 0, progress: bool = False,
                nlist: int | None = None):
    """Build an inner-product faiss index over float16 rows (converted to float32 in blocks).

    HNSW (M=32) needs no training and gives high recall; IVF-Flat clusters the rows into ~4*sqrt(N) lists
    (k-means on a sample of at most 64 per list) and probes ``nprobe`` of them at query time.
    """
    faiss = faiss_module()
    n, dim = embeddings.shape
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        index.hnsw.efSearch = 64
    elif kind == "ivf":
        nlist = nlist or ivf_lists(n)
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
    """IVF-PQ: sqrt(N) lists (at most 4096), d/4 sub-vectors of 4 bits (d/8 bytes a row), trained on a sample.

    4-bit codes in faiss's fast-scan layout: a query's distance tables fit SIMD registers, so scanning a list
    costs a fraction of 8-bit PQ's table lookups at the same bytes a row: on text-like queries, re-ranked from the
    float16 rows, it reaches a given recall sooner than 8-bit PQ and builds in seconds
    (``benchmarks/results/speed/ann_real.json``). Past RAM, on tightly clustered rows, the coarser codes leave more
    true neighbours outside the re-ranked candidates.
    """
    n, dim = embeddings.shape
    if n < IVFPQ_MIN_ROWS:
        raise ValueError(f"an IVF-PQ index needs at least {IVFPQ_MIN_ROWS} rows, this one has {n}: use hnsw or ivf")
    if dim % 8:
        raise ValueError(f"IVF-PQ stores d/8 bytes a row (d/4 sub-vectors of 4 bits): d={dim} is not a multiple of 8")
    nlist = ivfpq_lists(n)
    index = faiss.IndexIVFPQFastScan(faiss.IndexFlatIP(dim), dim, nlist, dim // 4, 4, faiss.METRIC_INNER_PRODUCT)
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
    queries = shortlist.check_queries(queries, dim or index.d, k)
    k = min(k, index.ntotal)
    if rerank is None:
        scores, ids = index.search(queries, k)
        return shortlist.sort_topk(scores.astype(np.float32), ids.astype(np.int64))
    _, cand = index.search(queries, min(RERANK * k, index.ntotal))
    cand = np.sort(cand.astype(np.int64), axis=1)   # per query, row ids in order: the memory map is read forwards
    best_s = np.empty((len(queries), k), np.float32)
    best_i = np.empty((len(queries), k), np.int64)
    for b in range(0, len(queries), _RERANK_BLOCK):   # whole blocks of queries at once: no per-query Python
        c = cand[b:b + _RERANK_BLOCK]
        missing = c < 0   # fewer candidates than asked (a small index or short lists): faiss pads with -1
        rows = np.asarray(rerank[np.where(missing, 0, c).ravel()], dtype=np.float32).reshape(*c.shape, -1)
        # elementwise product summed along d: every row's sum runs in the same order, so equal rows get equal
        # scores (a BLAS product may round rows differently by where they fall in its blocks): ties go by row id
        s = (rows * queries[b:b + _RERANK_BLOCK, None, :]).sum(-1)
        s[missing] = -np.inf
        order = np.lexsort((c, -s), axis=-1)[:, :k]
        best_s[b:b + len(c)] = np.take_along_axis(s, order, 1)
        best_i[b:b + len(c)] = np.where(np.isneginf(best_s[b:b + len(c)]), -1, np.take_along_axis(c, order, 1))
    return best_s, best_i


def save_faiss(index, path: str | Path) -> None:
    from clip_mini.fileio.atomic import atomic_write_with

    faiss = faiss_module()
    atomic_write_with(path, lambda tmp: faiss.write_index(index, str(tmp)))


def load_faiss(path: str | Path):
    """Read a faiss index file (a plain binary format: no pickle). Its checksum is verified by the caller."""
    faiss = faiss_module()
    try:
        return faiss.read_index(str(path))
    except RuntimeError as e:   # faiss reports a truncated or foreign file as a C++ exception
        raise ValueError(f"{path} is not a readable faiss index ({str(e).strip().splitlines()[0][:160]})") from None
