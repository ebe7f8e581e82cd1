"""Search back ends over stored float16 (or bfloat16) embeddings: exact (chunked matrix product) and faiss (HNSW or IVF).

Exact search has four kernels, with the same results (the float32 top-K, ties by row id); ``auto_kernel`` picks:

* faiss scan (one or a few queries, with or without torch, when faiss is installed): a faiss scalar-quantizer flat
  index whose codes *are* the stored rows (``QT_fp16`` / ``QT_bf16`` codes are the same bytes as float16 / bfloat16
  rows, so the index is a view of the memory map, nothing copied). faiss decodes each row to float32 in SIMD
  registers and takes its inner product with the float32 query as it streams the rows, so one query costs about
  one read of the matrix; the rows are split between the cores. Each part's approximate top ``k + 32`` is re-scored
  exactly (the float32 accumulation, and the query's rounding to bf16 where faiss's bf16 scan multiplies in bf16
  hardware, have a proven error bound, ``_margin``), falling back to a range search of a part whose short list
  ends above the floor (many near-ties). Past a few queries each one re-reads the matrix, and
  the matrix-product kernels below win.
* onnxruntime (many queries without torch: onnxruntime is a core dependency, loaded anyway for the query towers):
  each cache-sized chunk is converted and multiplied by the queries in one call (MLAS's float16 cast is several
  times numpy's), its top ``k + 32`` kept per query and re-scored exactly as above.
* numpy (always available; small or float32 matrices): each chunk of the (N, d) float16 matrix (a memory map, so
  an index larger than RAM works) is converted to float32 in a reused cache-sized buffer and scored with one BLAS
  product; top-K is kept with ``argpartition``.
* torch (used when torch is already imported, as in a server or a notebook, or asked for): a cheap approximate
  pass over the whole matrix, then exact float64 re-scoring of a short list. One or a few queries: torch's float16
  matrix-vector product (float32 accumulation, read at close to memory speed). More queries: each cache-sized
  chunk goes float16 -> float32 -> bfloat16 and through a bf16 matrix product (AMX/AVX512-BF16 where the CPU has
  them, much faster than fp32), of which only the maximum of each group of 16 rows is kept; on a CPU with native
  bf16 the float32 chunk goes to oneDNN as it is, asked to round it to bf16 inside the product (one conversion pass
  fewer). The K-th best group maximum and the groups near it are found on the maxima of 64-group super-groups first.
  The approximate scores' rounding error has a proven bound (``_margin``); every row whose approximate score is
  within twice that bound of the approximate K-th best is re-scored exactly, so no true top-K row can be missed.
  fp16 arithmetic itself is never used: without native support it is emulated and far slower.

An index stored as bfloat16 (``clip-mini index --dtype bfloat16``, ``clip_mini.retrieval.rows``) skips every
conversion: the torch kernel hands its rows straight to the bf16 matrix-vector or matrix product (a query then
costs little more than reading the rows), and the numpy kernel widens bf16 bits to float32 exactly.
Re-scoring uses the stored values either way, so results are exact for the rows as stored.

faiss's approximate indexes (HNSW, IVF, IVF-PQ) are worth it for large indexes: their stored graph or inverted
lists avoid touching every row. faiss is imported only when used (the exact scan imports it for 50k rows and up);
where it is missing or older than 1.11, ``auto`` leaves the scan out.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Literal

import numpy as np

from clip_mini.retrieval.rows import BF16Rows, bf16_bits_to_f32, f32_to_bf16_bits

FaissKind = Literal["hnsw", "ivf", "ivfpq"]
KERNELS = ("auto", "numpy", "onnxruntime", "torch", "faiss")
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


def exact_search(embeddings: np.ndarray, queries: np.ndarray, k: int = 10, chunk_rows: int | None = None,
                 kernel: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-K.

    Args:
        embeddings: (N, d) stored rows (float16 memmap or any array), L2-normalised.
        queries: (Q, d) or (d,) float32, L2-normalised.
        k: results per query; clipped to N.
        chunk_rows: rows scored per step of the numpy kernel (default: an 8 MB float32 block, which stays in cache
            between the conversion and the product).
        kernel: "numpy", "onnxruntime", "torch", "faiss", or "auto" (``auto_kernel``; see the module docstring).

    Returns:
        ``scores`` (Q, k) float32 cosine similarities, best first, and ``ids`` (Q, k) int64 row numbers.
    """
    n, dim = embeddings.shape
    queries = _check_queries(queries, dim, k)
    k = min(k, n)
    if kernel not in KERNELS:
        raise ValueError(f"unknown exact-search kernel {kernel!r} (use {', '.join(KERNELS)})")
    if n == 0:   # an empty index: no results, from every kernel
        return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
    bf16 = isinstance(embeddings, BF16Rows)
    if kernel == "auto":
        kernel = auto_kernel(n, len(queries), bf16 or embeddings.dtype == np.float16)
    if kernel == "torch":
        return _exact_torch(embeddings, queries, k)
    if kernel == "faiss":
        return _exact_faiss(embeddings, queries, k)
    if kernel == "onnxruntime":
        return _exact_ort(embeddings, queries, k)
    return _exact_numpy(embeddings, queries, k, chunk_rows)


def _exact_numpy(embeddings, queries: np.ndarray, k: int, chunk_rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """float32 scores chunk by chunk from one BLAS product each, then the same short list and exact re-scoring as
    the onnxruntime kernel (``_floor_and_rescore``): a BLAS product may round equal rows differently by where they
    fall in its blocks, so its own order is not the float32 top-K with ties by row id."""
    dim = embeddings.shape[1]
    chunk_rows = max(chunk_rows or (1 << 21) // dim, 1)
    # float16, bfloat16 and float32 rows widen to float32 exactly: only the accumulation rounds; wider rows are
    # rounded to float32 once on the way in
    exact = isinstance(embeddings, BF16Rows) or embeddings.dtype in (np.float16, np.float32)
    margin = _margin(0.0, 0, dim) if exact else _margin(2.0 ** -24, 1, dim)
    return _floor_and_rescore(embeddings, queries, k, lambda q: _numpy_chunks(embeddings, q, chunk_rows), margin)


def _numpy_chunks(embeddings, queries: np.ndarray, chunk_rows: int):
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


def _floor_and_rescore(embeddings, queries: np.ndarray, k: int, chunks, margin: float
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The exact top-K from approximate float32 scores: ``chunks(queries)`` yields (start, (Q, c) scores of rows
    start..start + c); each query keeps its top ``k + 32``, and every row within ``margin`` (scaled by the query's
    length where it is above 1) of the approximate K-th best is re-scored exactly. A query whose short list ends
    above that floor (many near-ties, more than the list holds) gets a second pass collecting every row above it,
    so no row tied with the K-th best is lost, whatever the order the chunks' products put them in."""
    n = len(embeddings)
    keep = min(n, k + _SCAN_EXTRA)
    best_s = np.full((len(queries), keep), -np.inf, dtype=np.float32)
    best_i = np.full((len(queries), keep), -1, dtype=np.int64)
    for start, sims in chunks(queries):
        _merge_chunk(best_s, best_i, sims, start)
    # the bound is on sum |e_i q_i| <= |e| |q|: unit rows, and queries whose length may be above 1
    scale = np.maximum(np.linalg.norm(queries.astype(np.float64), axis=1), 1.0)
    floor = (-np.sort(-best_s, axis=1)[:, k - 1] - margin * scale).astype(np.float32)
    short = (best_s >= floor[:, None]) & (best_i >= 0)
    cand_q, cand_i = [np.nonzero(short)[0]], [best_i[short]]
    again = np.flatnonzero((best_s.min(axis=1) >= floor) & (keep < n))
    if len(again):
        for start, sims in chunks(queries[again]):
            qs, cols = np.nonzero(sims >= floor[again, None])
            cand_q.append(again[qs])
            cand_i.append(cols.astype(np.int64) + start)
    return _rescore(embeddings, queries, np.concatenate(cand_q), np.concatenate(cand_i), k)


def _merge_chunk(best_s: np.ndarray, best_i: np.ndarray, sims: np.ndarray, offset: int) -> None:
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


TORCH_MIN_ROWS = 50_000   # below this the numpy kernel takes a few ms anyway
# The faiss scan reads the whole matrix once per query per core, the matrix-product kernels once for all queries:
# up to this many queries the scan is the faster one (benchmarks/bench_search.py: exact_faiss against
# exact_torch with torch loaded, against exact_onnxruntime in torch_free).
FAISS_SCAN_MAX_QUERIES = 4
FAISS_SCAN_MAX_QUERIES_NO_TORCH = 4
FAISS_SCAN_MIN_ROWS = 50_000   # below this numpy takes a few ms, less than importing faiss
ORT_MIN_ROWS = 50_000          # likewise for building the onnxruntime session


def auto_kernel(n: int, n_queries: int, sixteen_bit: bool) -> str:
    """The exact-search kernel ``auto`` picks for ``n`` rows and ``n_queries`` queries (see the module docstring):
    the faiss scan for a few queries over float16 / bfloat16 rows (torch loaded or not); for more, torch's matrix
    products when torch is already imported (importing it costs seconds), else onnxruntime's (a core dependency,
    already loaded for the query towers); numpy for small or float32 matrices."""
    torch_loaded = "torch" in sys.modules
    if not sixteen_bit:
        return "numpy"
    few = FAISS_SCAN_MAX_QUERIES if torch_loaded and n >= TORCH_MIN_ROWS else FAISS_SCAN_MAX_QUERIES_NO_TORCH
    if n_queries <= few and (n >= FAISS_SCAN_MIN_ROWS or "faiss" in sys.modules) and faiss_scan_available():
        return "faiss"
    if torch_loaded and n >= TORCH_MIN_ROWS:
        return "torch"
    return "onnxruntime" if n >= ORT_MIN_ROWS and _ort_available() else "numpy"


# -- onnxruntime: the numpy kernel's chunked product, converted and multiplied by MLAS ------------------------------
_ORT_CHUNK = 4096   # rows per call: the float32 copy of a chunk stays in the L2 cache between Cast and Gemm
_ort_sessions: dict = {}


def _ort_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def _ort_session(dim: int, float16: bool):
    """A session computing Q @ E.T for a chunk E of rows: float16 rows cast to float32 inside (MLAS converts with
    F16C, several times numpy's float16 cast), float32 rows (bf16 widened by ``bf16_bits_to_f32``) as they are."""
    key = (dim, float16)
    if key not in _ort_sessions:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        nodes = [helper.make_node("Gemm", ["Q", "Ef" if float16 else "E"], ["S"], transB=1)]
        if float16:
            nodes.insert(0, helper.make_node("Cast", ["E"], ["Ef"], to=TensorProto.FLOAT))
        graph = helper.make_graph(
            nodes, "scores",
            [helper.make_tensor_value_info("E", TensorProto.FLOAT16 if float16 else TensorProto.FLOAT, ["n", dim]),
             helper.make_tensor_value_info("Q", TensorProto.FLOAT, ["m", dim])],
            [helper.make_tensor_value_info("S", TensorProto.FLOAT, ["m", "n"])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        so = ort.SessionOptions()
        # worker threads that spin between calls take the cores the merge (and any other process) needs; on a
        # busy machine spinning made the whole search several times slower
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        _ort_sessions[key] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return _ort_sessions[key]


def _exact_ort(embeddings, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 scores chunk by chunk from onnxruntime (conversion and product in one call, into one reused
    output buffer), each query's top ``k + 32`` kept, then exact re-scoring of every row within the float32
    product's error bound of the K-th best: a BLAS product may round equal rows differently by where they fall
    in its blocks, so its own order is not the float32 top-K with ties by row id. A query whose short list ends
    above the floor (many near-ties) gets a second pass collecting every row above it."""
    bf16 = isinstance(embeddings, BF16Rows)
    if not bf16 and embeddings.dtype != np.float16:
        raise ValueError(f"the onnxruntime exact-search kernel reads float16 or bfloat16 rows, not {embeddings.dtype}")
    # 16-bit rows widen to float32 exactly and the query is float32: only the accumulation rounds
    return _floor_and_rescore(embeddings, queries, k, lambda q: _ort_chunks(embeddings, q, bf16),
                              _margin(0.0, 0, embeddings.shape[1]))


def _ort_chunks(embeddings, queries: np.ndarray, bf16: bool):
    """(start, scores of rows start.. for every query) chunk by chunk; the scores array is reused."""
    n, dim = embeddings.shape
    sess = _ort_session(dim, not bf16)
    io = sess.io_binding()
    queries = np.ascontiguousarray(queries)
    io.bind_cpu_input("Q", queries)
    step = min(_ORT_CHUNK, n)
    sims = np.empty(len(queries) * step, np.float32)
    wide = np.empty((step, dim), np.float32) if bf16 else None
    for start in range(0, n, step):
        c = min(step, n - start)
        if bf16:
            chunk = bf16_bits_to_f32(embeddings.bits[start:start + c], out=wide[:c])
        else:
            chunk = np.ascontiguousarray(embeddings[start:start + c])
        io.bind_cpu_input("E", chunk)
        out = sims[:len(queries) * c]   # contiguous (Q, c)
        io.bind_output("S", "cpu", 0, np.float32, [len(queries), c], out.ctypes.data)
        sess.run_with_iobinding(io)
        yield start, out.reshape(len(queries), c)


# -- faiss scan: faiss's scalar-quantizer flat index over the stored rows ------------------------------------------
_SCAN_EXTRA = 32   # approximate results kept per part beyond k: room for near-ties before the range-search fallback
_scan_available: bool | None = None


def faiss_scan_available() -> bool:
    """faiss is installed and new enough to search codes it does not own (``MaybeOwnedVector``, faiss >= 1.11) with
    bfloat16 codes; checked once, without importing faiss unless it is installed."""
    global _scan_available
    if _scan_available is None:
        _scan_available = faiss_available() and _scan_api(_faiss())
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
    which, for every component, and the error bound (``_margin``) counts that rounding where it happens."""
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


def _exact_faiss(embeddings, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Approximate scores from faiss's scan (float32 arithmetic on exactly decoded rows), then exact re-scoring of
    every row within the proven error bound of the approximate K-th best.

    Fewer queries than cores: the rows are split into one part per core, each scanned by one thread (faiss
    releases the GIL), since faiss itself parallelises over queries. More: one scan, faiss's threads over the
    queries."""
    faiss = _faiss()
    if not _scan_api(faiss):
        raise ValueError("the faiss exact-search kernel needs faiss >= 1.11 (pip install -U faiss-cpu)")
    bf16 = isinstance(embeddings, BF16Rows)
    rows = np.ascontiguousarray(embeddings.bits if bf16 else embeddings)
    if not bf16 and rows.dtype != np.float16:
        raise ValueError(f"the faiss exact-search kernel reads float16 or bfloat16 rows, not {rows.dtype}")
    n, d = rows.shape
    threads = _scan_threads(faiss)
    parts = min(threads, max(1, n // 1024)) if len(queries) < threads else 1
    bounds = [n * p // parts for p in range(parts + 1)]
    views = [_scan_view(faiss, rows[lo:hi], bf16) for lo, hi in zip(bounds, bounds[1:])]
    keep = [min(hi - lo, k + _SCAN_EXTRA) for lo, hi in zip(bounds, bounds[1:])]

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
    margin = _margin(_BF16_U if bf16 else _FP16_U, 1 if _scan_rounds_query(faiss, bf16, d) else 0, d)
    vals = np.concatenate([v for v, _ in found], axis=1)
    floor = np.partition(vals, vals.shape[1] - k, axis=1)[:, vals.shape[1] - k] - margin   # (Q,)
    cand_q, cand_i = [], []
    for p, (v, i) in enumerate(found):
        lo, size = bounds[p], bounds[p + 1] - bounds[p]
        complete = keep[p] == size
        for j in range(len(queries)):
            if complete or v[j, -1] < floor[j]:
                # everything this part left out scores below the floor: its short list holds every candidate
                sel = i[j][(v[j] >= floor[j]) & (i[j] >= 0)]
            else:   # more near-ties in this part than its short list: take every row above the floor
                _, _, sel = views[p].range_search(queries[j:j + 1], float(np.nextafter(floor[j], -np.inf)))
            cand_q.append(np.full(len(sel), j))
            cand_i.append(sel.astype(np.int64) + lo)
    return _rescore(embeddings, queries, np.concatenate(cand_q), np.concatenate(cand_i), k)


# -- torch: approximate pass, exact re-scoring ------------------------------------------------------------------
_MV_MAX_QUERIES = 4       # up to this many queries: one fp16 matrix-vector product each (memory-bound)
_FP16_U, _BF16_U = 2.0 ** -11, 2.0 ** -8   # unit roundoffs (round to nearest)


def _margin(u: float, roundings: int, d: int) -> float:
    """How far below the approximate K-th best a true top-K row can score: twice the bound on |approximate - exact|
    (its own error, and that of the rows that set the K-th best).

    The approximate score rounds ``roundings`` of {the row, the query, the result} to unit roundoff ``u`` (fp16 mv:
    query and result; a bf16 product over stored bf16 rows: query and result; over float16 rows converted by
    torch: all three; rounded by oneDNN inside the product, whose result stays float32: row and query) and
    accumulates d products in float32 (gamma_d = d 2^-24 / (1 - d 2^-24)), so it is within
    ((1 + u)^r (1 + gamma_d) - 1) * sum |e_i q_i| of the exact one; sum |e_i q_i| <= |e| |q| <= 1.01 for unit
    vectors rounded to fp16 or bf16 (norms within 2^-8 of 1)."""
    gamma = d * 2.0 ** -24 / (1 - d * 2.0 ** -24)
    return 2 * 1.01 * ((1 + u) ** roundings * (1 + gamma) - 1)


_BIG_CHUNK = 1 << 18      # rows per fp16 mv call (128 MB at d=256: the page cache streams a larger-than-RAM map)
_BF16_CHUNK = 4096        # float16 rows converted per bf16 product: the fp32 and bf16 copies stay in the L2 cache
_BF16_ROWS_CHUNK = 16384  # stored bf16 rows per product (no copies)
_IMPLICIT_CHUNK = 16384   # float16 rows per float32 chunk that oneDNN rounds to bf16 (it packs its own copy)
_GROUP = 16               # rows per group maximum in the many-queries pass
_SUPER = 64               # groups per super-group (1,024 rows): the floor and the first filter run on their maxima
_IMPLICIT_BF16 = True     # float16 rows: let oneDNN round float32 chunks to bf16 inside the product where it can


def _exact_torch(embeddings: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    bf16 = isinstance(embeddings, BF16Rows)
    with warnings.catch_warnings():   # torch warns about read-only memory maps; nothing writes to it
        warnings.simplefilter("ignore")
        bits = embeddings.bits if bf16 else np.asarray(embeddings)
        E = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16 if bf16 else torch.float16)  # (N, d), no copy
    q = torch.from_numpy(queries)
    with torch.inference_mode():
        if len(queries) <= _MV_MAX_QUERIES:
            cq, ci = _few_queries(torch, E, q.bfloat16() if bf16 else q.half(), k,
                                  _margin(_BF16_U if bf16 else _FP16_U, 2, queries.shape[1]))
        else:
            cq, ci = _many_queries(torch, E, q.bfloat16(), q, k)
    return _rescore(embeddings, queries, cq.numpy(), ci.numpy(), k)


def _few_queries(torch, E, qv, k: int, margin: float):
    """One matrix-vector product per query (memory-bound: the matrix is read at close to memory speed), each
    chunk's top ``k + 32`` kept; returns the (query, row) pairs whose approximate score is within ``margin`` of the
    approximate K-th best."""
    def approx(start: int, stop: int):
        return torch.stack([torch.mv(E[start:stop], qv[j]) for j in range(len(qv))])

    spans, tops = [], []
    for start in range(0, len(E), _BIG_CHUNK):
        a = approx(start, start + _BIG_CHUNK)
        v, i = torch.topk(a, min(k + 32, a.shape[1]), dim=1)   # (Q, keep) each
        spans.append((start, start + a.shape[1]))
        tops.append((v.float(), i + start))
    vals = torch.cat([v for v, _ in tops], 1)
    floor = torch.topk(vals, k, dim=1).values[:, -1:] - margin   # (Q, 1)
    cand_q, cand_i = [], []
    for (start, stop), (v, i) in zip(spans, tops):
        if v.shape[1] == stop - start or bool((v[:, -1:] < floor).all()):
            # Everything this chunk left out scores below the floor: its top list is complete. Otherwise (many
            # near-ties in one chunk) take every row above the floor.
            qs, cols = torch.nonzero(v >= floor, as_tuple=True)
            cand_q.append(qs)
            cand_i.append(i[qs, cols])
        else:
            qs, rows = torch.nonzero(approx(start, stop).float() >= floor, as_tuple=True)
            cand_q.append(qs)
            cand_i.append(rows + start)
    return torch.cat(cand_q), torch.cat(cand_i)


def _many_queries(torch, E, qb, qf, k: int):
    """One bf16 matrix product per chunk, rows by queries (faster than queries by rows), of which only
    each group of ``_GROUP`` rows' maximum is kept: a top-K per chunk costs twice the product. The K-th best group
    maximum is a score that K distinct rows reach, so only groups whose maximum is within ``margin`` of it can hold
    a true top-K row; their rows are scored exactly and those above the floor (the K-th best less the margin)
    returned."""
    n, d = E.shape
    nq, G, S = len(qb), _GROUP, _SUPER
    groups = -(-n // G)
    if groups < k:   # fewer groups than results: every row is a candidate
        return torch.arange(nq).repeat_interleave(n), torch.arange(n).repeat(nq)
    stored = E.dtype == torch.bfloat16
    implicit = not stored and _implicit_bf16(torch)
    margin = _margin(_BF16_U, 2 if stored or implicit else 3, d)
    supers = -(-groups // S)
    # group maxima, padded to whole super-groups; float32 where oneDNN's product hands back float32
    gmax = torch.empty(supers * S, nq, dtype=torch.float32 if implicit else torch.bfloat16)
    gmax[groups:] = -math.inf
    chunk_rows = _BF16_ROWS_CHUNK if stored else _IMPLICIT_CHUNK if implicit else _BF16_CHUNK
    step = max(G, chunk_rows // G * G)   # whole groups per chunk
    if not stored:   # float16 -> float32 (-> bfloat16) in reused buffers (float16 -> bfloat16 directly is slower)
        f32 = torch.empty(min(step, n), d)
        b16 = None if implicit else torch.empty(min(step, n), d, dtype=torch.bfloat16)
    qT = (qf if implicit else qb).T.contiguous()
    with _matmul_precision(torch, "bf16" if implicit else None):
        for start in range(0, n, step):
            c = min(step, n - start)
            if stored:
                chunk = E[start:start + c]
            elif implicit:   # oneDNN rounds the float32 rows and queries to bf16 inside the product
                chunk = f32[:c].copy_(E[start:start + c])
            else:
                chunk = b16[:c].copy_(f32[:c].copy_(E[start:start + c]))
            s = chunk @ qT   # (c, Q)
            g0, full = start // G, c // G
            torch.amax(s[:full * G].view(full, G, nq), 1, out=gmax[g0:g0 + full])
            if full * G < c:   # the last, partial group
                gmax[g0 + full] = s[full * G:].amax(0)
    g, qi, floor = _candidate_groups(torch, gmax.view(supers, S, nq), k, margin)
    # A few thousand groups qualify. Their rows are scored exactly (float32) query by query, each query's groups
    # gathered as whole 16-row blocks: several times faster than one gather and one batched product over all the
    # (group, query) pairs, whose large temporaries cost more than the arithmetic. A true top-K row scores at least
    # the approximate K-th best minus one error bound, above the floor, so the exact scores filter safely.
    full = n // G
    blocks = E[:full * G].view(full, G, d)
    offsets = torch.arange(G)
    tail_rows = torch.arange(full * G, n)
    cand_q, cand_i = [], []
    for j, gj in enumerate(g.split(torch.bincount(qi, minlength=nq).tolist())):
        tail = len(gj) > 0 and int(gj[-1]) == full   # the last, partial group
        if tail:
            gj = gj[:-1]
        rows = (gj[:, None] * G + offsets).flatten()
        s = blocks.index_select(0, gj).view(-1, d).float() @ qf[j]
        if tail:
            rows = torch.cat([rows, tail_rows])
            s = torch.cat([s, E[full * G:].float() @ qf[j]])
        keep = rows[s >= floor[j]]
        cand_q.append(torch.full_like(keep, j))
        cand_i.append(keep)
    return torch.cat(cand_q), torch.cat(cand_i)


def _candidate_groups(torch, gmax, k: int, margin: float):
    """The (group, query) pairs whose group maximum is within ``margin`` of the query's K-th best group maximum,
    sorted by query, then group; and each query's floor (that K-th best less the margin).

    ``gmax`` is (super-groups, ``_SUPER``, Q), padded with -inf. A top-K and a comparison over every group cost
    a fifth of the search at 1M rows, so both run on super-group maxima first: the K-th best super-group maximum
    is a value K distinct groups reach, so it is at most the K-th best group maximum, and every group within the
    margin of that lies in a super-group within the margin of it. Only those super-groups' groups are looked at."""
    supers, S, nq = gmax.shape
    smax = gmax.amax(1).float()   # (super-groups, Q); float32, as every bound below: bf16 would round it
    if supers >= k:
        low = torch.topk(smax, k, dim=0).values[-1] - margin   # (Q,)
    else:   # fewer super-groups than results: their K-th best bounds nothing
        low = torch.full((nq,), -math.inf)
    si, qi = torch.nonzero(smax >= low, as_tuple=True)
    order = torch.argsort(qi, stable=True)
    si, qi = si[order], qi[order]
    vals = gmax[si, :, qi]   # (pairs, S): the group maxima of each candidate super-group, for its query
    # each query's exact K-th best group maximum: its top-K groups all lie in its candidate super-groups
    counts = torch.bincount(qi, minlength=nq)
    pos = torch.arange(len(qi)) - (torch.cumsum(counts, 0) - counts)[qi]
    dense = torch.full((nq, int(counts.max()), S), -math.inf, dtype=vals.dtype)
    dense[qi, pos] = vals
    floor = torch.topk(dense.view(nq, -1), k, dim=1).values[:, -1].float() - margin   # (Q,)
    p, o = torch.nonzero(vals >= floor[qi, None], as_tuple=True)   # ordered by pair: query, group
    return si[p] * S + o, qi[p], floor


def _implicit_bf16(torch) -> bool:
    """Whether float32 products can be asked to run in bf16 inside oneDNN (``torch.backends.mkldnn.matmul.
    fp32_precision``, torch >= 2.9) on a CPU with native bf16: one conversion pass (float16 -> float32) instead
    of two, the rounding to bf16 done while oneDNN packs the operands (``benchmarks/results/speed/search.json``)."""
    if not _IMPLICIT_BF16:
        return False
    backend = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if backend is None or not hasattr(backend, "fp32_precision") or not torch.backends.mkldnn.is_available():
        return False
    try:   # without native bf16 oneDNN would emulate it: no gain, and looser scores
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


class _matmul_precision:
    """Sets oneDNN's float32 matmul precision for a block and restores it (``None``: leave it alone). The setting is
    process-wide: a float32 product another thread runs inside the block is rounded to bf16 as well."""

    def __init__(self, torch, precision: str | None):
        self.backend = torch.backends.mkldnn.matmul if precision else None
        self.precision = precision

    def __enter__(self):
        if self.backend is not None:
            self.saved = self.backend.fp32_precision
            self.backend.fp32_precision = self.precision

    def __exit__(self, *exc):
        if self.backend is not None:
            self.backend.fp32_precision = self.saved


def _rescore(embeddings: np.ndarray, queries: np.ndarray, cq: np.ndarray, ci: np.ndarray, k: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Exact float32 scores of the short-listed (query, row) pairs, then each query's top-K (ties by row id)."""
    scores = np.empty((len(queries), k), np.float32)
    ids = np.empty((len(queries), k), np.int64)
    for j in range(len(queries)):
        rows = np.unique(ci[cq == j])                      # sorted: the memory map is read in order
        # float64 products rounded once: equal rows get equal scores (a float32 BLAS call can round the rows of
        # one product differently, by where each falls in its vector blocks), so ties really go by row id.
        s = (np.asarray(embeddings[rows], dtype=np.float64) @ queries[j].astype(np.float64)).astype(np.float32)
        # (a BF16Rows index returns its stored values exactly as float32, so these are the stored rows' scores)
        order = np.lexsort((rows, -s))[:k]
        scores[j], ids[j] = s[order], rows[order]
    return scores, ids


# -- faiss ---------------------------------------------------------------------------------------------------
def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("the faiss back end needs faiss: pip install 'clip-mini[faiss]'") from None
    return faiss


def build_faiss(embeddings: np.ndarray, kind: FaissKind = "hnsw", seed: int = 0, progress: bool = False,
                nlist: int | None = None):
    """Build an inner-product faiss index over float16 rows (converted to float32 in blocks).

    HNSW (M=32) needs no training and gives high recall; IVF-Flat clusters the rows into ~4*sqrt(N) lists
    (k-means on a sample of at most 64 per list) and probes ``nprobe`` of them at query time.
    """
    faiss = _faiss()
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
    queries = _check_queries(queries, dim or index.d, k)
    k = min(k, index.ntotal)
    if rerank is None:
        scores, ids = index.search(queries, k)
        return _sort_topk(scores.astype(np.float32), ids.astype(np.int64))
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

    faiss = _faiss()
    atomic_write_with(path, lambda tmp: faiss.write_index(index, str(tmp)))


def load_faiss(path: str | Path):
    """Read a faiss index file (a plain binary format: no pickle). Its checksum is verified by the caller."""
    faiss = _faiss()
    try:
        return faiss.read_index(str(path))
    except RuntimeError as e:   # faiss reports a truncated or foreign file as a C++ exception
        raise ValueError(f"{path} is not a readable faiss index ({str(e).strip().splitlines()[0][:160]})") from None


def faiss_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("faiss") is not None
