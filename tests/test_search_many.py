"""Many queries at once: the group-maxima pass of the numpy and onnxruntime kernels (``search.groups``) and the
float32 many-queries pass of the torch kernel give the float32 brute-force top-K of the rows as stored, ties by row
id (clustered near-ties, exact duplicates across chunks and groups, a padded last chunk, more results than groups,
queries longer than 1, one worker or two); the group maxima bound what they stand for; and ``auto`` picks, per
query count, the kernel ``benchmarks/speed/bench_search_many.py`` measured fastest on this CPU kind."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from clip_mini.retrieval import search as S
from clip_mini.retrieval.rows import BF16Rows, encode
from clip_mini.retrieval.search import bounds, exact_numpy, exact_ort, groups

ROOT = Path(__file__).resolve().parents[1]


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _reference(rows, q, k):
    """float32 scores of the rows as stored (float64 products rounded once: equal rows score equally), best first,
    ties by row id."""
    sims = (q.astype(np.float64) @ np.asarray(rows, np.float32).astype(np.float64).T).astype(np.float32)
    order = np.lexsort((np.broadcast_to(np.arange(sims.shape[1]), sims.shape), -sims), axis=1)[:, :k]
    return np.take_along_axis(sims, order, 1), order


def _rows(storage: str, n: int, d: int, seed: int):
    """Unit rows, a third of them near-ties around one point, 41 copies of row 10 spread over chunks and groups
    (one of them the last row), and queries: row 10, the centre, random ones, and one of length 3."""
    rng = np.random.default_rng(seed)
    centre = _unit(rng, 1, d)[0]
    emb = _unit(rng, n, d)
    emb[::3] = centre + 0.01 * rng.standard_normal((len(emb[::3]), d))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    copies = np.unique(np.linspace(11, n - 1, 40).astype(int))
    emb[copies] = emb[10]
    q = _unit(rng, 7, d)
    q[0], q[1] = emb[10], centre
    q[6] *= 3.0   # not unit: the margin scales with the query's length
    rows = BF16Rows(encode(emb, "bfloat16")) if storage == "bfloat16" else emb.astype(np.float16)
    return rows, q, np.concatenate([[10], copies])


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("n", [1024, 5003, 40_000])
def test_group_pass_equals_float32_brute_force(storage, kernel, workers, n, monkeypatch):
    monkeypatch.setattr(exact_numpy, "GROUPED_MIN_ROWS", 0)
    monkeypatch.setattr(exact_ort, "GROUPED_MIN_ROWS", 0)
    monkeypatch.setattr(exact_numpy, "_GROUPED_CHUNK", 2048)   # several chunks, the last one padded
    monkeypatch.setattr(exact_ort, "_GROUPED_CHUNK", 2048)
    monkeypatch.setattr(groups, "cores", lambda: workers)
    if kernel == "numpy":   # the numpy kernel runs one worker (BLAS threads itself): ask the helper for two
        real = groups.search
        monkeypatch.setattr(groups, "search", lambda *a, workers=None: real(*a, workers=None))
    calls = []
    real_candidates = groups.candidates
    monkeypatch.setattr(groups, "candidates", lambda *a: calls.append(1) or real_candidates(*a))
    rows, q, copies = _rows(storage, n, 32, seed=n)
    for k in (1, 10, 60, 256):   # 256 = groups.MAX_K; n=1024 has 64 groups, fewer than k: every row a candidate
        scores, ids = S.exact_search(rows, q, k=k, kernel=kernel)
        ref_s, ref_i = _reference(rows, q, k)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_array_equal(scores, ref_s)
    assert calls, "the group pass did not run"
    scores, ids = S.exact_search(rows, q[:1], k=len(copies), kernel=kernel)
    assert ids[0].tolist() == copies.tolist() and scores[0, 0] == scores[0, -1]


@pytest.mark.parametrize("kernel", ["numpy", "onnxruntime"])
def test_many_queries_run_in_blocks_with_the_same_result(kernel, monkeypatch):
    """Group maxima for more queries than ``GMAX_BYTES`` holds: the queries run in blocks (here 7 queries in blocks
    of 3), each a pass over the rows; the answer is the same."""
    monkeypatch.setattr(exact_numpy, "GROUPED_MIN_ROWS", 0)
    monkeypatch.setattr(exact_ort, "GROUPED_MIN_ROWS", 0)
    rows, q, _ = _rows("float16", 5003, 32, seed=9)
    per_query = 4 * (-(-len(rows) // groups.GROUP) + groups.BLOCK)
    monkeypatch.setattr(groups, "GMAX_BYTES", 3 * per_query)
    monkeypatch.setattr(groups, "MIN_BLOCK_QUERIES", 2)
    passes = []
    real = groups.candidates
    monkeypatch.setattr(groups, "candidates", lambda gmax, *a: passes.append(gmax.shape[1]) or real(gmax, *a))
    scores, ids = S.exact_search(rows, q, k=10, kernel=kernel)
    ref_s, ref_i = _reference(rows, q, 10)
    np.testing.assert_array_equal(ids, ref_i)
    np.testing.assert_array_equal(scores, ref_s)
    assert passes == [3, 3, 1]


@pytest.mark.parametrize("kernel", ["numpy", "onnxruntime"])
def test_group_pass_is_the_default_from_its_size_and_for_k_up_to_max_k(kernel, monkeypatch):
    module = exact_numpy if kernel == "numpy" else exact_ort
    rng = np.random.default_rng(3)
    rows = _unit(rng, module.GROUPED_MIN_ROWS, 16).astype(np.float16)
    q = _unit(rng, 5, 16)
    calls = []
    real = groups.search
    monkeypatch.setattr(groups, "search", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    for k in (10, groups.MAX_K, groups.MAX_K + 1):
        scores, ids = S.exact_search(rows, q, k=k, kernel=kernel)
        ref_s, ref_i = _reference(rows, q, k)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_array_equal(scores, ref_s)
    assert calls == [10, groups.MAX_K]   # a larger k: the per-query short lists
    calls.clear()
    S.exact_search(rows[:-1], q, k=10, kernel=kernel)
    assert calls == []


def test_group_maxima_bound_every_row_of_their_group(monkeypatch):
    """The strided layout: group j of a chunk holds rows j, j + C/16, ...; its maximum is theirs, and a
    super-group's maximum is that of its 64 groups (checked against a direct computation)."""
    rng = np.random.default_rng(4)
    n, d, chunk = 5000, 16, 2048
    rows = _unit(rng, n, d).astype(np.float16)
    q = _unit(rng, 3, d)
    seen = {}
    real = groups.candidates

    def spy(gmax, smax, k, margin, chunk_, n_):
        seen.update(gmax=gmax.copy(), smax=smax.copy(), chunk=chunk_)
        return real(gmax, smax, k, margin, chunk_, n_)

    monkeypatch.setattr(groups, "candidates", spy)
    groups.search(rows, q, 5, lambda r, qs: exact_numpy._scorer(rows, qs, r), bounds.margin(0.0, 0, d), chunk)
    sims = np.asarray(rows, np.float32) @ q.T   # (n, Q)
    gmax, smax = seen["gmax"], seen["smax"]
    assert seen["chunk"] == chunk and len(gmax) == 3 * chunk // groups.GROUP
    for g in range(len(gmax)):
        r = groups.group_rows(np.array([g]), chunk, n)[0]
        r = r[r >= 0]
        want = sims[r].max(0) if len(r) else np.full(3, -np.inf, np.float32)
        np.testing.assert_allclose(gmax[g], want, atol=1e-6)
    per_super = chunk // groups.BLOCK
    for s in range(len(smax)):
        c, u = divmod(s, per_super)
        g = c * (chunk // groups.GROUP) + u + np.arange(groups.SUPER) * per_super
        np.testing.assert_array_equal(smax[s], gmax[g].max(0))


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [150, 3001, 20_000])
def test_torch_fp32_many_query_pass_is_exact(storage, n, monkeypatch):
    """The torch kernel's many-queries pass in float32 (a CPU without native bf16): exact top-K, ties by row id."""
    pytest.importorskip("torch")
    from clip_mini.retrieval.search import exact_torch as T

    monkeypatch.setattr(T, "_FP32", True)
    monkeypatch.setattr(T, "_FP32_CHUNK", 1000)   # several chunks, not whole groups (rounded down to 992)
    monkeypatch.setattr(T, "_SUPER", 4)
    rows, q, copies = _rows(storage, n, 32, seed=n)
    q = q[:6]   # unit queries (the torch kernel's bound assumes them)
    for k in (1, 10, 40):
        scores, ids = S.exact_search(rows, q, k=k, kernel="torch")
        ref_s, ref_i = _reference(rows, q, k)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_array_equal(scores, ref_s)


def test_torch_kernel_multiplies_in_float32_exactly_where_bf16_is_not_native(monkeypatch):
    pytest.importorskip("torch")
    from clip_mini.runtime import isa
    from clip_mini.retrieval.search import exact_torch as T

    monkeypatch.setattr(isa, "cpu_native_bf16", lambda: False)
    assert T._fp32_products()
    monkeypatch.setattr(isa, "cpu_native_bf16", lambda: True)
    assert not T._fp32_products()


# -- auto against the measurement ------------------------------------------------------------------------------
def _measured():
    from clip_mini.runtime.isa import cpu_kind

    path = ROOT / f"benchmarks/results/speed/search_many_{cpu_kind()}.json"
    if not path.exists():
        pytest.skip(f"no {path.name} for this CPU kind")
    return json.loads(path.read_text())


@pytest.mark.parametrize("where", ["torch_free", "torch_loaded"])
def test_auto_picks_the_kernel_measured_fastest_here(where, monkeypatch):
    """On this CPU kind, ``auto`` picks (today's rule, not only the one recorded) the kernel the benchmark
    measured fastest for each query count, or one within 10% of it (timing noise), and every kernel's answer was
    the numpy kernel's."""
    data = _measured()
    monkeypatch.setattr(S.exact_faiss, "faiss_scan_available", lambda: True)
    if where == "torch_loaded":
        monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    else:
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    for key, row in data[where].items():
        m = int(key[1:])
        pick = S.auto_kernel(data["rows"], m, True, int8=data.get("int8_codes", False),
                             int8_signed=data.get("int8_signed", False))
        assert pick == row["kernel"], (key, pick, row["kernel"])
        fastest = row[row["fastest_forced"]]["p50_ms"]
        assert row[pick]["p50_ms"] <= 1.1 * fastest, (key, pick, row["fastest_forced"])
        assert row["picked_vs_fastest"] <= 1.1, key
        assert all(arm["same_ids_as_numpy"] for arm in row.values() if isinstance(arm, dict))
