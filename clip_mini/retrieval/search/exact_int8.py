"""The int8 exact-search kernel: a first pass over per-row int8 codes of the stored rows (``codes``, a sidecar
memory-mapped beside them), exact re-scoring of a short list from the stored rows.

Each query is scaled so that its largest component is 127 (a positive factor per query: the ranking of the rows is
the same) and rounded to 8-bit codes. The rows' codes are multiplied by the queries' chunk by chunk (``groups``:
one worker thread per core, each running its chunks through a one-thread session): onnxruntime's ``MatMulInteger``
with a chunk of the codes as the left-hand operand, read straight from the memory map (unsigned bytes, zero point
128: nothing copied, nothing packed per process, so ``clip-mini serve --workers N`` share the codes through the page
cache), the queries' codes as the right-hand one (packed per call: a few kilobytes), then each row's scale. The
queries enter as signed bytes, MLAS's u8 x s8 kernel, which is VNNI's instruction where the CPU has it; without VNNI
that kernel's int16 pair sums can saturate, so ``works`` takes it only where ``_check_product`` proves it exact on
this machine, and otherwise the queries as unsigned bytes with zero point 128, MLAS's u8 x u8 kernel, which widens
to 16 bits before multiplying (no pair sums to saturate), proved exact the same way before the kernel's first use.
The integer product is exact in int32 and in float32 (below 2^24 for widths up to 1,040), then scaled once.

Of the (rows x queries) approximate scores of a chunk, the maxima of groups of 16 rows are taken in the cache
(``groups``' strided layout), and only the rows of groups that reach the query's running threshold are looked at
(``_rows_pass``): those reaching it are kept. The short list is every kept row within the query's margin
(``bounds.quantized_margin``: Cauchy-Schwarz on the rows' quantization error, from the largest residual norm stored
with the codes, and the query's own, plus the float32 rounding) of its approximate K-th best, re-scored exactly
(``shortlist.rescore``): the float32 top-K of the rows as stored, ties by row id, as every kernel gives it. Where
it is the faster: ``dispatch.INT8_MIN_QUERIES``.
"""
from __future__ import annotations

import threading

import numpy as np

from clip_mini.retrieval.search import bounds, codes as C, groups, shortlist

QUERY_LEVELS = 127      # 8-bit query codes
MAX_DIM = 2048          # wider rows: the integer products pass 2^24 by too much (one rounding more below this)
# rows per product call: CHUNK_BYTES of (rows x queries) float32 scores, which stay in the L2 cache until the group
# maxima are taken, within CHUNK..MAX_CHUNK rows (1M x 256 codes, AVX512-BF16 EPYC: 64 queries fastest at 4,096,
# one to 16 at 16,384 or more: fewer calls)
CHUNK_BYTES = 1 << 20
CHUNK = 4096
MAX_CHUNK = 32768
MAX_QUERIES = 256   # queries per pass (more: in blocks, each a pass over the codes)
_sessions: dict[bool, object] = {}   # signed -> the one-thread session (shared by the worker threads)
_session_lock = threading.Lock()   # the product checks
_build_lock = threading.Lock()
_checked: dict[int, bool] = {}   # width -> whether the product checked exact
_signed: dict[int, bool] = {}    # width -> whether that product is the u8 x s8 one (``_session``'s ``signed``)


def normalized(queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each query scaled to a largest component of 127 (float64; a zero query stays zero) and its 8-bit codes."""
    q = queries.astype(np.float64)
    amax = np.abs(q).max(axis=1) if q.shape[1] else np.zeros(len(q))
    qn = q * np.where(amax > 0, QUERY_LEVELS / np.where(amax > 0, amax, 1.0), 0.0)[:, None]
    return qn, np.clip(np.rint(qn), -QUERY_LEVELS, QUERY_LEVELS).astype(np.int64)


def margins(queries: np.ndarray, codes: C.Int8Codes) -> np.ndarray:
    """Each query's margin, in the units of its approximate scores (its largest component 127), from its own
    quantization (``bounds.quantized_margin``)."""
    qn, qc = normalized(queries)
    d = queries.shape[1]
    # the integer product converts to float32 exactly below 2^24, then the row's scale (times 1): one rounding,
    # two counted; past 2^24, one more
    roundings = 2 + (d * C.LEVELS * QUERY_LEVELS >= 2 ** 24)
    return bounds.quantized_margin(np.linalg.norm(qn, axis=1), np.linalg.norm(qn - qc, axis=1),
                                   np.linalg.norm(qc.astype(np.float64), axis=1), codes.row_error, codes.code_norm,
                                   roundings)


def checked(dim: int) -> bool | None:
    """What ``works`` found for this width, without checking now: None until it has run."""
    return _checked.get(dim)


def signed(dim: int) -> bool | None:
    """Whether the checked product for this width is the u8 x s8 one (VNNI's); None until ``works`` has run."""
    return _signed.get(dim) if _checked.get(dim) else None


def works(dim: int) -> bool:
    """Whether the kernel runs exactly here for rows of width ``dim``: onnxruntime has the product and its integer
    product is exact (``_check_product``, once per width; a few milliseconds)."""
    if dim > MAX_DIM:
        return False
    with _session_lock:
        if dim not in _checked:
            exact = False   # ``checked`` says None until the check is done
            for signed in (True, False):   # u8 x s8 first: VNNI's product, where it is exact
                try:
                    _check_product(lambda A, Q, S, out: _product(signed, Q)(A, S, out), dim)
                except Exception:   # no onnxruntime, no MatMulInteger in this build, or an inexact product
                    continue
                exact, _signed[dim] = True, signed
                break
            _checked[dim] = exact
        return _checked[dim]


def search(embeddings, queries: np.ndarray, k: int, codes: C.Int8Codes | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """The int8 pass over the codes of ``embeddings`` (``codes.for_rows``: the sidecar, made if missing), then
    exact re-scoring from ``embeddings`` themselves.

    Args:
        codes: the rows' codes (default: ``codes.for_rows(embeddings)``).

    Raises:
        ValueError: rows wider than ``MAX_DIM``, codes of another shape, rows that are not finite, or a machine
            where the integer product is not exact.
    """
    n, dim = embeddings.shape
    if dim > MAX_DIM:
        raise ValueError(f"the int8 exact-search kernel reads rows of width up to {MAX_DIM}, not {dim}")
    if not works(dim):
        raise ValueError("the int8 exact-search kernel does not run here (onnxruntime's int8 product is missing or "
                         "not exact on this machine)")
    codes = C.for_rows(embeddings) if codes is None else codes
    if codes.shape != (n, dim):
        raise ValueError(f"int8 codes of shape {codes.shape} do not belong to rows of shape {embeddings.shape}")
    if groups.usable(n, k):
        parts = [_rows_pass(embeddings, codes, queries[b:b + MAX_QUERIES], k)
                 for b in range(0, len(queries), MAX_QUERIES)]
        return np.concatenate([s for s, _ in parts]), np.concatenate([i for _, i in parts])
    margin = lambda q: margins(q, codes)   # noqa: E731
    # few rows, or k past the group pass's: every row's approximate score, short-listed per query
    every = lambda q: [(0, np.ascontiguousarray(scores(codes, q).T))]   # noqa: E731
    return shortlist.floor_and_rescore(embeddings, queries, k, every, margin)


def _rows_pass(embeddings, codes: C.Int8Codes, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The pass over every chunk of ``CHUNK`` rows (one worker thread per core, each taking the next chunk): the
    chunk's (rows, queries) approximate scores, the maxima of its groups of 16 rows (``groups``' strided layout),
    and out of the groups that reach the query's running threshold, the rows that reach it, kept with their
    approximate scores. The threshold is the best lower bound on the query's final floor seen so far: a chunk's
    K-th best group maximum is reached by K distinct rows, so the K-th best approximate score is at least that,
    and the floor (the K-th best less the query's margin) at least that less the margin. At the end, each query's
    floor from the rows kept (the K-th best approximate scores are all among them), the rows above it re-scored
    exactly. Only rows individually near the K-th best are re-scored, not whole groups."""
    n, nq = len(embeddings), len(queries)
    margin = margins(queries, codes).astype(np.float32)
    chunk = min(MAX_CHUNK, max(CHUNK, CHUNK_BYTES // (4 * nq))) // groups.GROUP * groups.GROUP
    chunks = -(-n // chunk)
    best = np.full((k, nq), -np.inf, np.float32)   # each query's K best group maxima so far (all workers')
    kth = np.full(nq, -np.inf, np.float32)         # the smallest of them (a stale read only costs a merge)
    thr = np.full(nq, -np.inf, np.float32)         # that less the margin: a lower bound on the query's floor
    todo = iter(range(chunks))
    lock = threading.Lock()
    found: list[tuple[np.ndarray, np.ndarray]] = []   # (row * nq + query, approximate score) of the kept rows

    def work() -> None:
        score = scorer(codes, queries, chunk)
        block = np.empty((chunk, nq), np.float32)
        flat = block.reshape(-1)
        gmax_buf = np.empty((chunk // groups.GROUP, nq), np.float32)
        mine = []
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                break
            start = i * chunk
            c = min(chunk, n - start)
            cp = -(-c // groups.GROUP) * groups.GROUP
            score(start, start + c, block[:c])
            block[c:cp] = -np.inf
            per = cp // groups.GROUP
            gmax = gmax_buf[:per]   # (per, nq): group j holds the chunk's rows j + t per
            np.max(block[:cp].reshape(groups.GROUP, per, nq), axis=0, out=gmax)
            if per >= k:   # the K best group maxima so far, of distinct groups: K rows reach the smallest
                up = np.flatnonzero(gmax.max(axis=0) > kth)   # only the queries whose K-th best this chunk beats
                if len(up):
                    top = np.partition(gmax[:, up], per - k, axis=0)[per - k:]
                    with lock:
                        merged = np.partition(np.concatenate([best[:, up], top]), k, axis=0)
                        best[:, up] = merged[k:]
                        kth[up] = merged[k]
                        thr[up] = np.maximum(thr[up], merged[k] - margin[up])
            th = thr.copy()
            hit = np.flatnonzero(gmax >= th)   # (group, query) pairs, as gmax's flat positions
            if len(hit):
                # the group's 16 rows, as the block's flat positions: group j's row j + t per, query q
                pos = hit[:, None] + np.arange(0, groups.GROUP * per * nq, per * nq)
                vals = flat.take(pos)
                keep = vals >= th[hit % nq][:, None]
                if c < cp:
                    keep &= pos < c * nq
                mine.append((pos[keep] + start * nq, vals[keep]))
        with lock:
            found.extend(mine)

    groups.run_workers(work, max(1, min(groups.cores(), chunks)))
    fr, fq = np.divmod(np.concatenate([f[0] for f in found]).astype(np.int64), nq)
    fs = np.concatenate([f[1] for f in found])
    order = np.argsort(fq, kind="stable")
    fq, fr, fs = fq[order], fr[order], fs[order]
    bounds = np.searchsorted(fq, np.arange(nq + 1))
    floor = np.empty(nq, np.float32)
    for j in range(nq):   # every query keeps its K best approximate scores at least (n >= k rows)
        v = fs[bounds[j]:bounds[j + 1]]
        floor[j] = np.partition(v, len(v) - k)[len(v) - k] - margin[j]
    keep = fs >= floor[fq]
    return shortlist.rescore(embeddings, queries, fq[keep], fr[keep], k)


def scorer(codes: C.Int8Codes, queries: np.ndarray, rows: int) -> groups.Score:
    """A ``groups.Score``: the (stop - start, Q) float32 approximate scores of rows start..stop, each query scaled
    as ``normalized`` (so its ``margins`` apply), written straight into the caller's block (chunks of up to
    ``rows`` rows)."""
    if not works(codes.shape[1]):
        raise ValueError("the int8 exact-search kernel does not run here (onnxruntime's int8 product is missing or "
                         "not exact on this machine)")
    run = _product(_signed[codes.shape[1]], normalized(queries)[1].T)

    def score(start: int, stop: int, out: np.ndarray) -> None:
        run(codes.codes[start:stop], codes.scales[start:stop], out)

    return score


def scores(codes: C.Int8Codes, queries: np.ndarray) -> np.ndarray:
    """(N, Q) float32 approximate scores of every row, each query scaled as ``normalized``."""
    out = np.empty((codes.rows, len(queries)), np.float32)
    scorer(codes, queries, len(out))(0, len(out), out)
    return out


def prepare(codes: C.Int8Codes, background: bool = False) -> None:
    """Check the product for the codes' width (``works``) now, not at the first search; ``background``: on a
    thread of its own (``checked`` says when it is done)."""
    if background:
        threading.Thread(target=works, args=(codes.shape[1],), name="clip-mini-int8-check", daemon=True).start()
    else:
        works(codes.shape[1])


def _product(signed: bool, Q: np.ndarray):
    """``run(A, S, out)``: writes (A - 128) @ Q * S[:, None] into ``out`` (c, m) float32 for a chunk A (c, d) of
    stored codes (uint8, code + 128) and its scales S (c,), through ``_session(signed)``; ``Q`` (d, m): the query
    codes, integers in -127..127, bound once."""
    sess = _session(signed)
    io = sess.io_binding()
    b = np.ascontiguousarray(Q if signed else Q + C.ZERO, np.int8 if signed else np.uint8)
    m = b.shape[1]
    io.bind_cpu_input("B", b)

    def run(A: np.ndarray, S: np.ndarray, out: np.ndarray, _keep=b) -> None:
        c = len(A)
        if c == 0 or m == 0:
            return
        io.bind_cpu_input("A", np.ascontiguousarray(A, np.uint8))
        io.bind_cpu_input("S", np.ascontiguousarray(S, np.float32).reshape(c, 1))
        io.bind_output("Y", "cpu", 0, np.float32, [c, m], out.ctypes.data)
        sess.run_with_iobinding(io)

    return run


def _session(signed: bool):
    """The session computing ``Y = (A - 128) @ (B - zb) * S`` for a chunk A (c, d) of stored codes, query codes B
    (d, m) and the chunk's scales S (c, 1): ``signed``: B int8 (zero point 0), onnxruntime's u8 x s8 kernel, VNNI's
    instruction where the CPU has it (``works`` takes it only where ``_check_product`` finds it exact: AVX2's u8 x
    s8 instruction saturates); else B the codes + 128 as uint8 (zero point 128), the u8 x u8 kernel. One thread
    (``groups`` runs one caller per core); graph optimisations off, so the three nodes run as written."""
    with _build_lock:
        if signed not in _sessions:
            _sessions[signed] = _build(signed)
        return _sessions[signed]


def _build(signed: bool):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    bt = TensorProto.INT8 if signed else TensorProto.UINT8
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "B", "zero_a", "zero_b"], ["I"]),
         helper.make_node("Cast", ["I"], ["F"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["F", "S"], ["Y"])],
        "int8_scores",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, ["c", "d"]),
         helper.make_tensor_value_info("B", bt, ["d", "m"]),
         helper.make_tensor_value_info("S", TensorProto.FLOAT, ["c", 1])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["c", "m"])],
        initializer=[helper.make_tensor("zero_a", TensorProto.UINT8, [], [C.ZERO]),
                     helper.make_tensor("zero_b", bt, [], [0 if signed else C.ZERO])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _check_product(run, dim: int) -> None:
    """Refuse a machine where the product is not exact over the codes' whole range: rows and queries at the
    extremes (every pair 127 x 127 of either sign, alternating, random), for numbers of rows and of queries that
    take the kernel's different register tiles and edges. ``run(A, Q, S, out)``: ``_product(signed, Q)(A, S, out)``.

    Raises:
        RuntimeError: the product differs from numpy's exact one.
    """
    rng = np.random.default_rng(0)
    alt = np.where(np.arange(dim) % 2, 255, 1)
    cols = [np.full(dim, 255), np.full(dim, 1), alt, 256 - alt, rng.integers(1, 256, dim)]
    A = np.array([cols[i % len(cols)] for i in range(67)], np.uint8)              # (67, d) stored codes
    for m in (1, 2, 3, 4, 7, 8, 16, 33, 64):
        Q = np.array([cols[(j + 2) % len(cols)] for j in range(m)], np.int64).T - C.ZERO   # (d, m) in -127..127
        for c in (1, 5, 67):
            got = np.empty((c, m), np.float32)
            run(A[:c], Q, np.ones(c, np.float32), got)
            want = (A[:c].astype(np.int64) - C.ZERO) @ Q   # exact, then one rounding
            if not np.array_equal(got, want.astype(np.float32)):
                raise RuntimeError(f"onnxruntime's int8 product is not exact here (width {dim}, {m} queries): the "
                                   "int8 exact-search kernel cannot run")
