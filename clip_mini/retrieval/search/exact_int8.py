"""The int8 exact-search kernel: a first pass over per-row int8 codes of the stored rows (``codes``, a sidecar
memory-mapped beside them), exact re-scoring of a short list from the stored rows.

Each query is scaled so that its largest component is 127 (a positive factor per query: the ranking of the rows is
the same), rounded to 8-bit codes, and multiplied by every row's codes at once: onnxruntime's
``MatMulIntegerToFloat`` over the codes as a constant operand, which onnxruntime reads from the sidecar file
itself (external data: nothing is copied through Python), times each row's scale. The query is unsigned bytes with
zero point 128; the codes enter as signed bytes (the stored bytes xor 128, folded once when the session is made),
MLAS's u8 x s8 kernel, which is VNNI's instruction where the CPU has it (1M x 256 codes, 8 / 64 queries on the
AVX512-BF16 EPYC: 64 / 192 ms, against 85 / 512 ms for u8 x u8). Without VNNI that kernel's int16 pair sums can
saturate, so ``works`` takes it only where ``_check_product`` proves it exact on this machine, and otherwise the
stored unsigned bytes with zero point 128, MLAS's u8 x u8 kernel, which widens to 16 bits before multiplying (no
pair sums to saturate), proved exact the same way before the kernel's first use. The integer product is exact in int32 and in float32 (below 2^24 for
widths up to 1,040), then scaled once.

Of the (queries x rows) approximate scores only the maxima of groups of 16 rows (``groups``' layout, chunks of
``codes.PAD`` rows) are looked at: the short list is every group within the query's margin (``bounds``
``.quantized_margin``: Cauchy-Schwarz on the rows' quantization error, from the largest residual norm stored with the
codes, and the query's own, plus the float32 rounding) of the approximate K-th best group maximum
(``groups.candidates``), re-scored exactly (``shortlist.rescore``): the float32 top-K of the rows as stored, ties by
row id, as every kernel gives it.

onnxruntime packs the constant codes for its kernel once per session: a private copy the size of the codes in
each process (``clip-mini serve --workers 2``: two), what makes the pass fast (the same product over codes bound
per call, packed on every call, measured no faster than the float32 pass; 1M x 128 codes, 8 queries: 13 ms
against 27 ms for the product alone). One session is kept per open codes (``codes.for_rows`` keeps the latest
few), built in about a second per million rows of width 128. Where it is the faster: ``dispatch.INT8_MIN_QUERIES``.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from clip_mini.retrieval.search import bounds, codes as C, groups, shortlist

QUERY_LEVELS = 127      # 8-bit query codes (u8 x u8: no saturation, see the module docstring)
MAX_DIM = 2048          # wider rows: the integer products pass 2^24 by too much (one rounding more below this)
MAX_SCORE_BYTES = 64 << 20   # approximate scores held at once (queries x padded rows float32): more in blocks
_sessions: "weakref.WeakKeyDictionary[C.Int8Codes, object]" = weakref.WeakKeyDictionary()
_session_lock = threading.Lock()
_build_lock = threading.Lock()
_building: "weakref.WeakSet[C.Int8Codes]" = weakref.WeakSet()   # sessions being built in the background
_checked: dict[int, bool] = {}   # width -> whether the product checked exact
_signed: dict[int, bool] = {}    # width -> whether that product is the u8 x s8 one (``_build``'s ``signed``)
_local = threading.local()       # each thread's buffer of approximate scores


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


def works(dim: int) -> bool:
    """Whether the kernel runs exactly here for rows of width ``dim``: onnxruntime has the product and its integer
    product is exact (``_check_product``, once per width)."""
    if dim > MAX_DIM:
        return False
    with _session_lock:
        if dim not in _checked:
            _checked[dim] = False
            for signed in (True, False):   # u8 x s8 first: VNNI's product, where it is exact
                try:
                    _check_product(lambda codes, scales: _build(codes, scales, None, 1, signed), dim)
                except Exception:   # no onnxruntime, no MatMulIntegerToFloat in this build, or an inexact product
                    continue
                _checked[dim], _signed[dim] = True, signed
                break
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
    step = max(1, MAX_SCORE_BYTES // (4 * codes.codes.shape[1]))
    margin = lambda q: margins(q, codes)   # noqa: E731
    parts = []
    for b in range(0, len(queries), step):
        q = queries[b:b + step]
        if groups.usable(n, k):
            parts.append(_grouped(embeddings, codes, q, k))
        else:   # few rows, or k past the group pass's: every row's approximate score, short-listed per query
            parts.append(shortlist.floor_and_rescore(embeddings, q, k, lambda qq: [(0, scores(codes, qq)[:, :n])],
                                                     margin))
    return np.concatenate([s for s, _ in parts]), np.concatenate([i for _, i in parts])


def _grouped(embeddings, codes: C.Int8Codes, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The group maxima of the approximate scores (``groups``' layout: chunk ``c`` of ``codes.pad`` rows, group
    ``j`` its rows ``j + t pad/16``), the groups near the K-th best, their rows re-scored."""
    y = scores(codes, queries)
    m, p, pad = len(queries), y.shape[1], codes.pad
    per, supers = pad // groups.GROUP, pad // groups.BLOCK
    gmax = np.empty((m, p // pad, per), np.float32)
    blocks = y.reshape(m, p // pad, groups.GROUP, per)
    halves = [slice(0, (m + 1) // 2), slice((m + 1) // 2, m)] if m > 1 and groups.cores() > 1 else [slice(0, m)]
    if len(halves) == 1:
        np.max(blocks, axis=2, out=gmax)
    else:   # the queries' maxima on two threads (numpy lets go of the GIL): a pass over all the scores
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda h: np.max(blocks[h], axis=2, out=gmax[h]), halves))
    smax = gmax.reshape(m, p // pad, groups.SUPER, supers).max(axis=2)    # (m, chunks, supers)
    cq, ci = groups.candidates(np.ascontiguousarray(gmax.reshape(m, -1).T),
                               np.ascontiguousarray(smax.reshape(m, -1).T), k,
                               margins(queries, codes).astype(np.float32), pad, codes.rows)
    return shortlist.rescore(embeddings, queries, cq, ci, k)


def scores(codes: C.Int8Codes, queries: np.ndarray) -> np.ndarray:
    """(Q, P) float32 approximate scores of every (padded) row, each query scaled as ``normalized`` (so its
    ``margins`` apply), padding -inf; a view of this thread's buffer, valid until its next call."""
    sess = _session(codes)
    _, qc = normalized(queries)
    m, p = len(queries), codes.codes.shape[1]
    buf = getattr(_local, "scores", None)
    if buf is None or buf.size < m * p:
        _local.scores = buf = np.empty(m * p, np.float32)
    out = buf[:m * p].reshape(m, p)
    io = sess.io_binding()
    io.bind_cpu_input("A", (qc + C.ZERO).astype(np.uint8))
    io.bind_output("Y", "cpu", 0, np.float32, [m, p], out.ctypes.data)
    sess.run_with_iobinding(io)
    out[:, codes.rows:] = -np.inf
    return out


def prepare(codes: C.Int8Codes, background: bool = False) -> None:
    """Check the product (``works``) and build the session for ``codes`` now (about a second per million rows of
    width 128: reading and packing the codes), not at the first search; ``background``: on a thread of its own,
    while ``busy`` says so."""
    if not background:
        if works(codes.shape[1]):
            _session(codes)
        return
    with _session_lock:
        if codes in _sessions or codes in _building:
            return
        _building.add(codes)

    def build() -> None:
        try:
            if works(codes.shape[1]):
                _session(codes)
        except Exception:   # the search that needs it builds it again, and reports the error
            pass
        finally:
            with _session_lock:
                _building.discard(codes)

    threading.Thread(target=build, name="clip-mini-int8-session", daemon=True).start()


def busy(codes: C.Int8Codes) -> bool:
    """Whether the session for ``codes`` is being built in the background (``prepare``): a search now would wait."""
    return codes in _building


def _session(codes: C.Int8Codes):
    """The session multiplying queries by ``codes`` (built once per codes object, kept while it lives). Built
    outside the lock: a search of other codes does not wait for it."""
    with _session_lock:
        sess = _sessions.get(codes)
    if sess is None:
        with _build_lock:   # one build at a time (each reads and packs all the codes)
            with _session_lock:
                sess = _sessions.get(codes)
            if sess is None:
                sess = _build(codes.codes, codes.scales, codes, groups.cores(), _signed.get(codes.shape[1], False))
                with _session_lock:
                    _sessions[codes] = sess
    return sess


def _build(matrix: np.ndarray, scales: np.ndarray, codes: C.Int8Codes | None, threads: int, signed: bool = False):
    """A session computing ``Y = (A - 128) @ (matrix - 128) * scales`` for 8-bit query codes A (Q, d): the
    codes (d, P) and scales (P,) a constant operand, read from the sidecar file where ``codes`` has one (external
    data: nothing copied through Python), else embedded. ``signed``: the codes enter the product as int8 (the
    stored bytes xor 128, folded into a constant once, when the session is made), so onnxruntime runs its u8 x s8
    kernel: VNNI's instruction where the CPU has it, exact there, twice as fast as u8 x u8 or more; ``works``
    takes it only where ``_check_product`` finds it exact (AVX2's u8 x s8 instruction saturates)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    d, p = matrix.shape
    external = codes is not None and codes.path is not None
    if external:
        consts = [_external("B", TensorProto.UINT8, [d, p], codes.path.name, 0, d * p),
                  _external("S", TensorProto.FLOAT, [p], codes.path.name, codes.scales_offset, 4 * p)]
    else:
        consts = [numpy_helper.from_array(np.ascontiguousarray(matrix, np.uint8), "B"),
                  numpy_helper.from_array(np.ascontiguousarray(scales, np.float32), "S")]
    nodes, zero_b = [], "zero"
    if signed:   # B -> int8(B xor 128) = the codes themselves; constant inputs: folded when the session is made
        consts[0].name = "B_stored"
        consts.append(numpy_helper.from_array(np.array(np.int8(0)), "zero_s8"))
        nodes += [helper.make_node("BitwiseXor", ["B_stored", "zero"], ["B_flipped"]),
                  helper.make_node("Cast", ["B_flipped"], ["B"], to=TensorProto.INT8)]
        zero_b = "zero_s8"
    nodes.append(helper.make_node("MatMulIntegerToFloat", ["A", "B", "one", "S", "zero", zero_b], ["Y"],
                                  domain="com.microsoft"))
    graph = helper.make_graph(
        nodes, "int8_scores", [helper.make_tensor_value_info("A", TensorProto.UINT8, ["m", d])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", p])],
        initializer=consts + [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                              numpy_helper.from_array(np.array(C.ZERO, np.uint8), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    # worker threads that spin between calls take the cores the rest of the search (and a server) needs
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if external:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(codes.path.parent))
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _external(name: str, dtype: int, dims: list[int], location: str, offset: int, length: int):
    from onnx import TensorProto

    t = TensorProto()
    t.name, t.data_type, t.data_location = name, dtype, TensorProto.EXTERNAL
    t.dims.extend(dims)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _check_product(make, dim: int) -> None:
    """Refuse a machine where the product is not exact over the codes' whole range: rows and queries at the
    extremes (every pair 127 x 127 of either sign, alternating, random), for numbers of queries and of rows
    that take the kernel's different register tiles and edges. ``make(codes (d, P) uint8, scales (P,))`` returns a
    session (``_build``).

    Raises:
        RuntimeError: the product differs from numpy's exact one.
    """
    rng = np.random.default_rng(0)
    alt = np.where(np.arange(dim) % 2, 255, 1)
    cols = [np.full(dim, 255), np.full(dim, 1), alt, 256 - alt, rng.integers(1, 256, dim)]
    matrix = np.array([cols[i % len(cols)] for i in range(67)], np.uint8).T          # (d, 67)
    sess = make(np.ascontiguousarray(matrix), np.ones(matrix.shape[1], np.float32))
    for m in (1, 2, 3, 4, 7, 8, 16, 33, 64):
        A = np.array([cols[(j + 2) % len(cols)] for j in range(m)], np.uint8)
        got = sess.run(["Y"], {"A": A})[0]
        want = (A.astype(np.int64) - C.ZERO) @ (matrix.astype(np.int64) - C.ZERO)   # exact, then one rounding
        if not np.array_equal(got, want.astype(np.float32)):
            raise RuntimeError(f"onnxruntime's int8 product is not exact here (width {dim}, {m} queries): the "
                               "int8 exact-search kernel cannot run")
