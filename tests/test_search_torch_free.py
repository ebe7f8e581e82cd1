"""The torch-free exact-search kernels: faiss (a scalar-quantizer flat index over the stored float16 / bfloat16
bytes) and onnxruntime (chunked conversion and product). Their top-K is the float32 brute-force top-K of the rows
as stored (ties by row id, k above the row count, near-ties that overflow a short list), faiss's approximate scores
stay inside the bound its short list relies on, faiss reads the rows in place, and ``auto`` picks faiss for one
query and onnxruntime for many in a process that has not imported torch."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clip_mini.retrieval import search as S
from clip_mini.retrieval.rows import BF16Rows, encode
from clip_mini.retrieval.search import bounds, exact_faiss, exact_ort, shortlist

needs_faiss = pytest.mark.skipif(not S.faiss_scan_available(), reason="faiss >= 1.11 not installed")
ROOT = Path(__file__).resolve().parents[1]


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _reference(rows, q, k):
    """float32 scores of the rows as stored (float64 products rounded once: equal rows score equally), best first,
    ties by row id."""
    stored = np.asarray(rows, np.float32).astype(np.float64)
    sims = (q.astype(np.float64) @ stored.T).astype(np.float32)
    order = np.lexsort((np.broadcast_to(np.arange(sims.shape[1]), sims.shape), -sims), axis=1)[:, :k]
    return np.take_along_axis(sims, order, 1), order


def _rows(storage: str, n: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    centre = _unit(rng, 1, d)[0]
    emb = _unit(rng, n, d)
    emb[::4] = centre + 0.01 * rng.standard_normal((len(emb[::4]), d))   # a quarter of near-ties around one point
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb[n // 2:n // 2 + 45] = emb[3]   # 46 identical rows, spread over both halves' boundary region
    emb[n - 1] = emb[3]                # and one in the last row
    q = _unit(rng, 5, d)
    q[0], q[1] = emb[3], centre
    rows = BF16Rows(encode(emb, "bfloat16")) if storage == "bfloat16" else emb.astype(np.float16)
    return rows, q


KERNEL_CASES = [pytest.param("faiss", t, marks=needs_faiss) for t in (1, 2, 3)] + [("onnxruntime", 1)]


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel,threads", KERNEL_CASES)
@pytest.mark.parametrize("extra", [32, 2])   # 2: near-ties overflow the short lists -> range search / second pass
@pytest.mark.parametrize("d", [24, 48])      # faiss's bf16 scan rounds the query at d % 16 == 0 only
def test_kernel_equals_float32_brute_force(storage, kernel, threads, extra, d, monkeypatch):
    # rows split into parts for < threads queries
    monkeypatch.setattr(exact_faiss, "_scan_threads", lambda faiss: threads)
    monkeypatch.setattr(shortlist, "SCAN_EXTRA", extra)
    monkeypatch.setattr(exact_ort, "_ORT_CHUNK", 700)   # several chunks, a partial last one
    n = 5003
    rows, q = _rows(storage, n, d, seed=threads)
    for nq in (1, 2, 5):
        for k in (1, 10, 60, n + 7):   # k above the row count: every row, in order
            scores, ids = S.exact_search(rows, q[:nq], k=k, kernel=kernel)
            ref_s, ref_i = _reference(rows, q[:nq], min(k, n))
            np.testing.assert_array_equal(ids, ref_i)
            np.testing.assert_array_equal(scores, ref_s)
    # query 0 is row 3 itself: its 48 copies come first, by row id
    scores, ids = S.exact_search(rows, q[:1], k=48, kernel=kernel)
    assert ids[0].tolist() == [3] + list(range(n // 2, n // 2 + 45)) + [n - 1] + ids[0, 47:].tolist()
    assert scores[0, 0] == scores[0, 46]


@pytest.mark.parametrize("kernel", [pytest.param("faiss", marks=needs_faiss), "onnxruntime"])
def test_kernel_on_a_memory_map_small_and_single_row(tmp_path, kernel):
    rng = np.random.default_rng(3)
    np.save(tmp_path / "e.npy", _unit(rng, 700, 16).astype(np.float16))
    mm = np.load(tmp_path / "e.npy", mmap_mode="r")
    q = _unit(rng, 1, 16)[0]   # a (d,) query
    scores, ids = S.exact_search(mm, q, k=5, kernel=kernel)
    ref_s, ref_i = _reference(mm, q[None], 5)
    np.testing.assert_array_equal(ids, ref_i)
    np.testing.assert_array_equal(scores, ref_s)
    one = np.asarray(mm[:1])
    scores, ids = S.exact_search(one, q, k=3, kernel=kernel)
    assert ids.tolist() == [[0]] and scores.shape == (1, 1)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        S.exact_search(np.asarray(mm, np.float32), q, k=3, kernel=kernel)


@needs_faiss
def test_faiss_scan_reads_the_rows_in_place():
    import faiss

    rows = _unit(np.random.default_rng(0), 100, 8).astype(np.float16)
    view = exact_faiss._scan_view(faiss, rows, bf16=False)
    assert not view.codes.is_owned and view.ntotal == 100
    before = view.search(rows[:1].astype(np.float32), 1)[1][0, 0]
    rows[7] = rows[0] * np.float16(1.0)
    rows[0] = -rows[0]   # changing the array changes what faiss reads: the index holds no copy
    assert before == 0 and view.search(rows[7:8].astype(np.float32), 1)[1][0, 0] == 7


@needs_faiss
@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [24, 256])   # faiss's SIMD path depends on the width (bf16: d % 16)
def test_margin_bounds_the_faiss_scan_scores(storage, d):
    """The short list is safe only if faiss's scores stay within half the margin of the exact ones: faiss decodes
    the 16-bit codes exactly and accumulates in float32, rounding the query where ``_scan_rounds_query`` finds it
    does (a faiss build with fp16 arithmetic, or rounding the probe misses, would fail here, not silently lose
    results)."""
    import faiss

    rng = np.random.default_rng(4)
    emb = _unit(rng, 20_000, d)
    bits = encode(emb, storage) if storage == "bfloat16" else emb.astype(np.float16)
    stored = np.asarray(BF16Rows(bits) if storage == "bfloat16" else bits, np.float32).astype(np.float64)
    q = _unit(rng, 4, d)
    view = exact_faiss._scan_view(faiss, bits, bf16=storage == "bfloat16")
    approx, ids = view.search(q, 20_000)
    exact = np.take_along_axis(q.astype(np.float64) @ stored.T, ids, 1)
    err = np.abs(approx - exact).max()
    rounds = exact_faiss._scan_rounds_query(faiss, storage == "bfloat16", d)
    assert err <= bounds.margin(bounds.BF16_U if storage == "bfloat16" else bounds.FP16_U, int(rounds), d) / 2, err
    if not rounds:   # float32 query: the error is the accumulation's alone
        assert err <= bounds.margin(0.0, 0, d) / 2, err


@needs_faiss
def test_auto_picks_torch_free_kernels_without_torch(tmp_path):
    """A process that never imported torch (a cold `clip-mini search`) gets the faiss kernel for one query and
    onnxruntime's for many, and their results."""
    rng = np.random.default_rng(6)
    n = max(S.FAISS_SCAN_MIN_ROWS, S.ORT_MIN_ROWS) + 10
    np.save(tmp_path / "e.npy", _unit(rng, n, 32).astype(np.float16))
    np.save(tmp_path / "q.npy", _unit(rng, 40, 32))
    code = (
        "import sys, numpy as np\n"
        "from clip_mini.retrieval import search as S\n"
        "from clip_mini.retrieval.search import exact_faiss, exact_ort, exact_torch\n"
        f"e = np.load({str(tmp_path / 'e.npy')!r}, mmap_mode='r'); q = np.load({str(tmp_path / 'q.npy')!r})\n"
        "calls = []\n"
        "for module in (exact_faiss, exact_ort, exact_torch):\n"
        "    name, real = module.__name__.rsplit('.', 1)[1], module.search\n"
        "    module.search = lambda *a, name=name, real=real: calls.append(name) or real(*a)\n"
        "for m in (1, 40):\n"
        "    s, i = S.exact_search(e, q[:m], 10)\n"
        "    ref = S.exact_search(e, q[:m], 10, kernel='numpy')\n"
        "    assert (i == ref[1]).all() and np.allclose(s, ref[0], atol=1e-6)\n"
        "print(*calls, 'torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["exact_faiss", "exact_ort", "False"]


@pytest.mark.parametrize("kind", ["amx", "avx512_bf16", "no_bf16"])
def test_auto_kernel_choices(kind, monkeypatch):
    from clip_mini.retrieval.search import dispatch

    native_bf16, amx = kind != "no_bf16", kind == "amx"
    monkeypatch.setattr(dispatch, "cpu_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(dispatch, "cpu_amx", lambda: amx)
    monkeypatch.setattr(exact_faiss, "faiss_scan_available", lambda: True)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    few = S.FAISS_SCAN_MAX_QUERIES_NO_TORCH if native_bf16 else S.FAISS_SCAN_MAX_QUERIES_NO_BF16
    assert S.auto_kernel(1_000_000, 1, True) == S.auto_kernel(1_000_000, few, True) == "faiss"
    assert S.auto_kernel(1_000_000, few + 1, True) == "onnxruntime"
    assert S.auto_kernel(1000, 64, True) == "numpy"        # a small matrix: not worth a session
    assert S.auto_kernel(1_000_000, 1, False) == "numpy"   # float32 rows: no 16-bit codes to scan
    # the int8 pass where its codes are at hand, on a CPU without AMX; with AMX torch's bf16 products are faster
    # (VNNI's u8 x s8 product from INT8_MIN_QUERIES; without VNNI, its u8 x u8 one, INT8_MIN/MAX_QUERIES_U8)
    for m in (S.INT8_MIN_QUERIES, 64):
        assert (S.auto_kernel(1_000_000, m, True, int8=True) == "int8") is (not amx)
    assert S.auto_kernel(1_000_000, S.INT8_MIN_QUERIES - 1, True, int8=True) == "faiss"
    for m in (S.INT8_MIN_QUERIES_U8, S.INT8_MAX_QUERIES_U8):
        assert (S.auto_kernel(1_000_000, m, True, int8=True, int8_signed=False) == "int8") is (not amx)
    assert S.auto_kernel(1_000_000, S.INT8_MAX_QUERIES_U8 + 1, True, int8=True, int8_signed=False) != "int8"
    monkeypatch.setitem(sys.modules, "torch", object())
    assert S.auto_kernel(1_000_000, 1, True) == "faiss"
    if amx:   # torch's bf16 products
        assert S.auto_kernel(1_000_000, S.FAISS_SCAN_MAX_QUERIES, True) == "faiss"
        assert S.auto_kernel(1_000_000, S.FAISS_SCAN_MAX_QUERIES + 1, True) == "torch"
    else:     # onnxruntime's float32 pass, torch loaded or not (AVX512-BF16 alone: faster than torch's bf16)
        assert S.auto_kernel(1_000_000, few, True) == "faiss"
        assert S.auto_kernel(1_000_000, few + 1, True) == "onnxruntime"
        with monkeypatch.context() as m:   # no onnxruntime: torch's pass
            m.setattr(exact_ort, "ort_available", lambda: False)
            assert S.auto_kernel(1_000_000, S.FAISS_SCAN_MAX_QUERIES + 1, True) == "torch"
    monkeypatch.setattr(exact_faiss, "faiss_scan_available", lambda: False)
    assert S.auto_kernel(1_000_000, 1, True) == ("torch" if amx else "onnxruntime")
