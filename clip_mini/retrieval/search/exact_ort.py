"""The onnxruntime exact-search kernel (many queries without torch: onnxruntime is a core dependency, loaded anyway
for the query towers).

Each cache-sized chunk is converted and multiplied by the queries in one call (MLAS's float16 cast is several times
numpy's). A large matrix keeps only group maxima of the scores (``groups``: one worker thread per core, each
running its own chunks through a one-thread session, so no chunk waits on a thread team); a small one each query's
top ``k + 32``; the short list is re-scored exactly, as the numpy kernel's.
"""
from __future__ import annotations

import numpy as np

from clip_mini.retrieval.rows import BF16Rows, bf16_bits_to_f32
from clip_mini.retrieval.search import bounds, groups, shortlist

_ORT_CHUNK = 4096   # rows per call: the float32 copy of a chunk stays in the L2 cache between Cast and Gemm
GROUPED_MIN_ROWS = 65_536   # from here the group-maxima pass
# rows per call in that pass (two workers, 1M rows, 8 or 64 queries: 2,048 and 4,096 within 2%, 8,192 10-20% slower)
_GROUPED_CHUNK = 4096
_ort_sessions: dict = {}


def ort_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def _ort_session(dim: int, float16: bool, rows_first: bool = False):
    """A session computing Q @ E.T (``rows_first``: E @ Q.T) for a chunk E of rows: float16 rows cast to float32
    inside (MLAS converts with F16C, several times numpy's float16 cast), float32 rows (bf16 widened by
    ``bf16_bits_to_f32``) as they are. A ``rows_first`` session runs on its caller's thread alone (the group pass
    runs one caller per core)."""
    key = (dim, float16, rows_first)
    if key not in _ort_sessions:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        rows = "Ef" if float16 else "E"
        nodes = [helper.make_node("Gemm", [rows, "Q"] if rows_first else ["Q", rows], ["S"], transB=1)]
        if float16:
            nodes.insert(0, helper.make_node("Cast", ["E"], ["Ef"], to=TensorProto.FLOAT))
        graph = helper.make_graph(
            nodes, "scores",
            [helper.make_tensor_value_info("E", TensorProto.FLOAT16 if float16 else TensorProto.FLOAT, ["n", dim]),
             helper.make_tensor_value_info("Q", TensorProto.FLOAT, ["m", dim])],
            [helper.make_tensor_value_info("S", TensorProto.FLOAT, ["n", "m"] if rows_first else ["m", "n"])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        so = ort.SessionOptions()
        if rows_first:
            so.intra_op_num_threads = 1
        # worker threads that spin between calls take the cores the merge (and any other process) needs; on a
        # busy machine spinning made the whole search several times slower
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        _ort_sessions[key] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return _ort_sessions[key]


def search(embeddings, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 scores chunk by chunk from onnxruntime (conversion and product in one call, into one reused output
    buffer), then the short list and exact re-scoring every kernel shares (``shortlist.floor_and_rescore``)."""
    bf16 = isinstance(embeddings, BF16Rows)
    if not bf16 and embeddings.dtype != np.float16:
        raise ValueError(f"the onnxruntime exact-search kernel reads float16 or bfloat16 rows, not {embeddings.dtype}")
    # 16-bit rows widen to float32 exactly and the query is float32: only the accumulation rounds
    margin = bounds.margin(0.0, 0, embeddings.shape[1])
    if len(embeddings) >= GROUPED_MIN_ROWS and groups.usable(len(embeddings), k):
        _ort_session(embeddings.shape[1], not bf16, rows_first=True)   # built once, before the worker threads
        return groups.search(embeddings, queries, k, lambda rows, q: _scorer(embeddings, q, bf16, rows), margin,
                             _GROUPED_CHUNK)
    return shortlist.floor_and_rescore(embeddings, queries, k, lambda q: _chunks(embeddings, q, bf16), margin)


def _scorer(embeddings, queries: np.ndarray, bf16: bool, rows: int) -> groups.Score:
    """A ``groups.Score`` with its own binding (and widening buffer for bf16 rows): (rows, Q) scores written
    straight into the caller's block."""
    dim = embeddings.shape[1]
    sess = _ort_session(dim, not bf16, rows_first=True)
    io = sess.io_binding()
    io.bind_cpu_input("Q", queries)
    wide = np.empty((min(rows, len(embeddings)), dim), np.float32) if bf16 else None

    def score(start: int, stop: int, out: np.ndarray) -> None:
        c = stop - start
        if bf16:
            chunk = bf16_bits_to_f32(embeddings.bits[start:stop], out=wide[:c])
        else:
            chunk = np.ascontiguousarray(embeddings[start:stop])
        io.bind_cpu_input("E", chunk)
        io.bind_output("S", "cpu", 0, np.float32, [c, len(queries)], out.ctypes.data)
        sess.run_with_iobinding(io)

    return score


def _chunks(embeddings, queries: np.ndarray, bf16: bool):
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

