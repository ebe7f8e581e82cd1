"""Many queries over a large matrix in float32 products, keeping only group maxima: the numpy and onnxruntime
kernels' pass over large matrices (on a CPU without native bf16, where a float32 product is the fastest arithmetic
there is, onnxruntime's is ``auto``'s pick for many queries, torch loaded or not: 64 queries over 1M x 256 rows
against the fp32 compute floor in ``benchmarks/speed/bench_search_many.py``).

Each chunk of ``C`` rows is scored for every query at once by the caller's ``score`` (one float32 matrix product
of the rows, widened exactly from float16 or bfloat16, and the queries: (C, Q) scores), and the chunk's scores are
reduced at once to the maxima of groups of ``GROUP`` rows and of super-groups of ``SUPER`` groups. A group is
strided, not contiguous: group ``j`` of a chunk holds its rows ``j, j + C/16, j + 2 C/16, ...``, so its maxima
are one element-wise maximum over 16 contiguous slabs of the score block (whole SIMD vectors, no per-group loop),
and a super-group ``u`` holds the rows ``u + w C/1024``. Only 1/16 of the scores leave the cache.

Then, per query: the K-th best super-group maximum, a value K distinct groups reach, is at most the K-th best group
maximum, so only super-groups within ``margin`` of it can hold a group within ``margin`` of the K-th best group
maximum (the floor); the rows of the groups above the floor are re-scored exactly (``shortlist.rescore``). The
margin (``bounds.margin``) is twice the bound on a float32 score's error, so no true top-K row is missed, ties
included: a true top-K row scores at least the K-th best group maximum less the margin.

The chunks are shared out between one worker thread per core (each with its own buffers; numpy, BLAS and
onnxruntime release the GIL), which takes no synchronisation beyond handing out chunk numbers.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np

from clip_mini.retrieval.search import shortlist

GROUP = 16    # rows per group maximum
SUPER = 64    # groups per super-group
BLOCK = GROUP * SUPER   # a chunk is a whole number of these (1,024 rows)
MAX_K = 256   # a larger k re-scores k groups of 16 rows each per query: the chunked short list is cheaper then
GMAX_BYTES = 1 << 28   # group maxima held at once (N/16 x queries float32): more queries run in blocks
MIN_BLOCK_QUERIES = 32   # fewer queries a product loses float32 speed (half-empty register tiles)

# (start, stop, out): writes the (stop - start, Q) float32 scores of those rows into ``out``
Score = Callable[[int, int, np.ndarray], None]
Margins = shortlist.Margins


def cores() -> int:
    """CPU cores this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_workers(work: Callable[[], None], workers: int) -> None:
    """``work`` on ``workers`` threads at once (each takes chunks until none are left), or here for one; a worker's
    exception is raised here."""
    if workers == 1:
        work()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(work) for _ in range(workers)]:
            f.result()


def usable(n: int, k: int) -> bool:
    """Whether the group pass suits ``n`` rows and top ``k``: enough groups that the K-th best means something."""
    return k <= MAX_K and n >= BLOCK


def group_rows(g: np.ndarray, chunk: int, n: int) -> np.ndarray:
    """(len(g), GROUP) row numbers of global groups ``g`` (chunk ``g // (chunk/16)``, group ``g % (chunk/16)``);
    rows past the matrix (the padded last chunk) are -1."""
    per = chunk // GROUP
    c, j = np.divmod(g.astype(np.int64), per)
    rows = (c * chunk + j)[:, None] + np.arange(GROUP, dtype=np.int64) * per
    return np.where(rows < n, rows, -1)


def search(embeddings, queries: np.ndarray, k: int, make_score: Callable[[int, np.ndarray], Score],
           margin: float | Margins, chunk: int, workers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The exact top-K from group maxima of float32 scores.

    Args:
        make_score: ``make_score(rows, queries)`` returns a ``Score`` of those (C-contiguous) queries with its own
            buffers for chunks of up to ``rows`` rows (called once per worker thread).
        margin: twice the bound on |float32 score - exact score| for unit rows and queries (scaled here by the
            query's length where it is above 1), or a function of the queries giving each one's margin as it is
            (``shortlist.query_margins``).
        chunk: rows per product; rounded to whole ``BLOCK``s (at most the matrix, padded).
        workers: threads (default: one per core).
    """
    n, nq = len(embeddings), len(queries)
    per_query = 4 * (-(-n // GROUP) + BLOCK)   # bytes of group maxima a query holds
    step = max(MIN_BLOCK_QUERIES, GMAX_BYTES // per_query)
    if nq > step:   # many queries over many rows: in blocks, each a pass over the rows
        parts = [search(embeddings, queries[b:b + step], k, make_score, margin, chunk, workers)
                 for b in range(0, nq, step)]
        return np.concatenate([s for s, _ in parts]), np.concatenate([i for _, i in parts])
    chunk = max(BLOCK, chunk // BLOCK * BLOCK)
    chunk = min(chunk, -(-n // BLOCK) * BLOCK)
    chunks = -(-n // chunk)
    per, supers = chunk // GROUP, chunk // BLOCK
    gmax = np.empty((chunks, per, nq), np.float32)
    smax = np.empty((chunks, supers, nq), np.float32)
    todo = iter(range(chunks))   # shared: each worker takes the next chunk number
    lock = threading.Lock()

    def work() -> None:
        score = make_score(chunk, queries)
        scores = np.empty((chunk, nq), np.float32)
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            start = i * chunk
            c = min(chunk, n - start)
            score(start, start + c, scores[:c])
            if c < chunk:   # the last chunk: padding scores below every real one
                scores[c:] = -np.inf
            np.max(scores.reshape(GROUP, per, nq), axis=0, out=gmax[i])
            np.max(gmax[i].reshape(SUPER, supers, nq), axis=0, out=smax[i])

    run_workers(work, max(1, min(workers or cores(), chunks)))
    margins = shortlist.query_margins(margin, queries).astype(np.float32)
    cq, ci = candidates(gmax.reshape(-1, nq), smax.reshape(-1, nq), k, margins, chunk, n)
    return shortlist.rescore(embeddings, queries, cq, ci, k)


def candidates(gmax: np.ndarray, smax: np.ndarray, k: int, margin: np.ndarray, chunk: int, n: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(query, row) pairs of every group whose maximum is within ``margin`` (per query) of the query's K-th best
    group maximum; every row when the matrix has fewer real groups than ``k``.

    ``gmax`` is (groups, Q) and ``smax`` (super-groups, Q), chunk by chunk as ``search`` lays them out; padding
    scores -inf."""
    nq = gmax.shape[1]
    per, supers = chunk // GROUP, chunk // BLOCK
    last = n - (n - 1) // chunk * chunk   # real rows of the last chunk
    real_groups = (len(gmax) // per - 1) * per + min(per, last)
    if real_groups < k:   # every row is a candidate
        return np.repeat(np.arange(nq), n), np.tile(np.arange(n, dtype=np.int64), nq)
    if len(smax) >= k:
        low = np.partition(smax, len(smax) - k, axis=0)[len(smax) - k] - margin   # (Q,)
    else:
        low = np.full(nq, -np.inf, np.float32)
    qi, si = np.nonzero(smax.T >= low[:, None])   # by query, then super-group
    c, u = np.divmod(si, supers)
    g = (c * per + u)[:, None] + np.arange(SUPER) * supers   # (pairs, SUPER): each super-group's groups
    vals = gmax[g, qi[:, None]]
    # each query's K-th best group maximum: its top-K groups all lie in its candidate super-groups
    bounds = np.searchsorted(qi, np.arange(nq + 1))
    floor = np.empty(nq, np.float32)
    for j in range(nq):
        v = vals[bounds[j]:bounds[j + 1]].ravel()
        floor[j] = np.partition(v, len(v) - k)[len(v) - k] - margin[j]
    p, o = np.nonzero(vals >= floor[qi][:, None])
    rows = group_rows(g[p, o], chunk, n)   # (pairs, GROUP)
    cq = np.repeat(qi[p], GROUP)
    ci = rows.ravel()
    real = ci >= 0
    return cq[real], ci[real]
