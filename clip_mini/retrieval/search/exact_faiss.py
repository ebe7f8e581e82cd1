"""The faiss scan exact-search kernel (one or a few queries, with or without torch, when faiss >= 1.11 is installed).

A faiss scalar-quantizer flat index whose codes *are* the stored rows (``QT_fp16`` / ``QT_bf16`` codes are the same
bytes as float16 / bfloat16 rows, so the index is a view of the memory map, nothing copied). faiss decodes each row
to float32 in SIMD registers and takes its inner product with the float32 query as it streams the rows, so one
query costs about one read of the matrix; the rows are split between the cores. Each part's approximate top
``k + 32`` is re-scored exactly (the float32 accumulation, and the query's rounding to bf16 where faiss's bf16 scan
multiplies in bf16 hardware, have a proven error bound, ``bounds.margin``), falling back to a range search of a part
whose short list ends above the floor (many near-ties). Past a few queries each one re-reads the matrix, and the
matrix-product kernels win.
"""
from __future__ import annotations

import numpy as np

from clip_mini.retrieval.rows import BF16Rows, f32_to_bf16_bits
from clip_mini.retrieval.search import bounds, shortlist
from clip_mini.retrieval.search.faiss_lib import faiss_available, faiss_module

_scan_available: bool | None = None


def faiss_scan_available() -> bool:
    """faiss is installed and new enough to search codes it does not own (``MaybeOwnedVector``, faiss >= 1.11) with
    bfloat16 codes; checked once, without importing faiss unless it is installed."""
    global _scan_available
    if _scan_available is None:
        _scan_available = faiss_available() and _scan_api(faiss_module())
    return _scan_available


def _scan_api(faiss) -> bool:
    return hasattr(faiss, "MaybeOwnedVectorUInt8") and hasattr(faiss.ScalarQuantizer, "QT_bf16")


_NO_OWNER = None


def _scan_view(faiss, rows: np.ndarray, bf16: bool):
    """A faiss ``IndexScalarQuantizer`` whose codes are ``rows``' bytes (C-contiguous float16 or bfloat16 bits):
    no copy. faiss does not own that memory: the caller keeps ``rows`` alive for as long as it uses the index."""
    global _NO_OWNER
    if _NO_OWNER is None:
        # create_view wants a shared_ptr owner, which faiss's Python wrapper cannot make; an empty vector's null
        # owner serves (the caller's numpy array is what keeps the memory alive)
        _NO_OWNER = faiss.MaybeOwnedVectorUInt8()
    n, d = rows.shape
    qt = faiss.ScalarQuantizer.QT_bf16 if bf16 else faiss.ScalarQuantizer.QT_fp16
    index = faiss.IndexScalarQuantizer(d, qt, faiss.METRIC_INNER_PRODUCT)
    assert index.code_size == 2 * d
    flat = rows.reshape(-1).view(np.uint8)
    if n:
        index.codes = faiss.MaybeOwnedVectorUInt8.create_view(faiss.swig_ptr(flat), flat.nbytes, _NO_OWNER.owner)
    index.ntotal = n
    return index


_rounds_query: dict[tuple[bool, int], bool] = {}


def _scan_rounds_query(faiss, bf16: bool, d: int = 16) -> bool:
    """Whether faiss's scan rounds the query to the rows' 16-bit type before the products (checked once per type
    and width: faiss picks its SIMD path by both).

    faiss decodes the codes to float32 exactly and accumulates the d products in float32; on a CPU with
    AVX512-BF16 its bfloat16 scan multiplies bf16 pairs in hardware, so the query is rounded to bf16 first. The
    score of a unit row against a query a hair above it (1 + 2^-20, which neither 16-bit type can hold) tells
    which, for every component, and the error bound (``bounds.margin``) counts that rounding where it happens."""
    if (bf16, d) not in _rounds_query:
        # one probe per component (a SIMD path may cover some components and a scalar tail the rest): unit rows
        # e_i, and queries (1 + 2^-20) e_i; row i's score for query i is 1 + 2^-20 unless query i was rounded
        rows = np.eye(d, dtype=np.float32)
        code = f32_to_bf16_bits(rows).reshape(d, d) if bf16 else rows.astype(np.float16)
        queries = np.ascontiguousarray(np.float32(1 + 2.0 ** -20) * rows)
        scores, ids = _scan_view(faiss, code, bf16).search(queries, 1)
        exact = np.float32(1 + 2.0 ** -20)
        _rounds_query[(bf16, d)] = bool((scores[:, 0] != exact).any() or (ids[:, 0] != np.arange(d)).any())
    return _rounds_query[(bf16, d)]


def _scan_threads(faiss) -> int:
    return max(1, faiss.omp_get_max_threads())


def search(embeddings, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Approximate scores from faiss's scan (float32 arithmetic on exactly decoded rows), then exact re-scoring of
    every row within the proven error bound of the approximate K-th best.

    Fewer queries than cores: the rows are split into one part per core, each scanned by one thread (faiss
    releases the GIL), since faiss itself parallelises over queries. More: one scan, faiss's threads over the
    queries."""
    faiss = faiss_module()
    if not _scan_api(faiss):
        raise ValueError("the faiss exact-search kernel needs faiss >= 1.11 (pip install -U faiss-cpu)")
    bf16 = isinstance(embeddings, BF16Rows)
    rows = np.ascontiguousarray(embeddings.bits if bf16 else embeddings)
    if not bf16 and rows.dtype != np.float16:
        raise ValueError(f"the faiss exact-search kernel reads float16 or bfloat16 rows, not {rows.dtype}")
    n, d = rows.shape
    threads = _scan_threads(faiss)
    parts = min(threads, max(1, n // 1024)) if len(queries) < threads else 1
    edges = [n * p // parts for p in range(parts + 1)]
    views = [_scan_view(faiss, rows[lo:hi], bf16) for lo, hi in zip(edges, edges[1:])]
    keep = [min(hi - lo, k + shortlist.SCAN_EXTRA) for lo, hi in zip(edges, edges[1:])]

    def scan_part(p: int):
        # OpenMP's thread count is per calling thread: this pool thread's faiss call runs on itself alone (a team
        # per part would only spin idle threads against the other part's)
        faiss.omp_set_num_threads(1)
        return views[p].search(queries, keep[p])

    if parts == 1:
        found = [views[0].search(queries, keep[0])]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(parts) as pool:
            found = list(pool.map(scan_part, range(parts)))
    rounds = 1 if _scan_rounds_query(faiss, bf16, d) else 0
    margin = bounds.margin(bounds.BF16_U if bf16 else bounds.FP16_U, rounds, d)
    vals = np.concatenate([v for v, _ in found], axis=1)
    floor = np.partition(vals, vals.shape[1] - k, axis=1)[:, vals.shape[1] - k] - margin   # (Q,)
    cand_q, cand_i = [], []
    for p, (v, i) in enumerate(found):
        lo, size = edges[p], edges[p + 1] - edges[p]
        complete = keep[p] == size
        for j in range(len(queries)):
            if complete or v[j, -1] < floor[j]:
                # everything this part left out scores below the floor: its short list holds every candidate
                sel = i[j][(v[j] >= floor[j]) & (i[j] >= 0)]
            else:   # more near-ties in this part than its short list: take every row above the floor
                _, _, sel = views[p].range_search(queries[j:j + 1], float(np.nextafter(floor[j], -np.inf)))
            cand_q.append(np.full(len(sel), j))
            cand_i.append(sel.astype(np.int64) + lo)
    return shortlist.rescore(embeddings, queries, np.concatenate(cand_q), np.concatenate(cand_i), k)
