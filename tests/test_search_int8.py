"""The int8 exact-search kernel (``search.exact_int8``) and its sidecar of codes (``search.codes``).

The kernel gives the float32 brute-force top-K of the rows as stored, ties by row id, as every kernel does (random,
clustered and near-tied rows, exact duplicates across chunks and groups, k past a group's 16 rows and past the group
pass's limit, a partial last chunk, one worker or two, queries in several blocks); its error bound holds on
adversarial rows and queries, and is not loose where it matters (a query along a row's residual reaches its row
term); an inexact integer product is refused; the sidecar is made once, beside the rows or in the user cache,
reused (by another process too, read-only through the page cache), made again when the rows change, and never used
stale or damaged; an index commit writes it and removes an old generation's; ``auto`` picks the kernel only where
the codes are at hand."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clip_mini.retrieval import search as S
from clip_mini.retrieval.rows import BF16Rows, encode
from clip_mini.retrieval.search import codes as C, dispatch, exact_int8, groups

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A user cache of the test's own (checksum stamps, codes of read-only rows), and no codes remembered from
    another test."""
    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(C, "_known", {})


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _reference(rows, q, k):
    """float32 scores of the rows as stored (float64 products rounded once), best first, ties by row id."""
    sims = (q.astype(np.float64) @ np.asarray(rows, np.float32).astype(np.float64).T).astype(np.float32)
    order = np.lexsort((np.broadcast_to(np.arange(sims.shape[1]), sims.shape), -sims), axis=1)[:, :k]
    return np.take_along_axis(sims, order, 1), order


def _rows(kind: str, storage: str, n: int, d: int, seed: int):
    """Rows and queries. "random": unit rows; "clustered": a third of the rows near-ties around one point, 41
    copies of row 10 spread over chunks and groups (one of them the last row). Queries: row 10, the centre, random
    ones, one of length 3."""
    rng = np.random.default_rng(seed)
    centre = _unit(rng, 1, d)[0]
    emb = _unit(rng, n, d)
    if kind == "clustered":
        emb[::3] = centre + 0.01 * rng.standard_normal((len(emb[::3]), d))
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        copies = np.unique(np.linspace(11, n - 1, 40).astype(int))
        emb[copies] = emb[10]
    q = _unit(rng, 7, d)
    q[0], q[1] = emb[10], centre
    q[6] *= 3.0
    rows = BF16Rows(encode(emb, "bfloat16")) if storage == "bfloat16" else emb.astype(np.float16)
    return rows, q


def _check(rows, q, k, **kw):
    s, i = S.exact_search(rows, q, k, kernel="int8", **kw)
    ref_s, ref_i = _reference(rows, q, k)
    np.testing.assert_array_equal(i, ref_i)
    np.testing.assert_array_equal(s, ref_s)


# -- exactness -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("n", [1024, 5003, 40_000])
@pytest.mark.parametrize("k", [1, 10, 40])
def test_int8_pass_equals_float32_brute_force(kind, storage, workers, n, k, monkeypatch):
    monkeypatch.setattr(exact_int8, "CHUNK", 2048)   # several chunks of group maxima, the last one partial
    monkeypatch.setattr(exact_int8, "MAX_CHUNK", 2048)
    monkeypatch.setattr(groups, "cores", lambda: workers)   # the product's threads
    rows, q = _rows(kind, storage, n, 64, seed=n + k)
    _check(rows, q, k)


@pytest.mark.parametrize("n, k", [(500, 5), (1000, 1000), (3000, 300)])
def test_short_list_pass_is_exact_where_the_group_pass_does_not_run(n, k, monkeypatch):
    """Fewer rows than a block, or k past ``groups.MAX_K``: per-query short lists over the same int8 scores."""
    rows, q = _rows("clustered", "float16", n, 48, seed=k)
    assert not groups.usable(n, k) or n < groups.BLOCK
    _check(rows, q, k)


def test_many_queries_run_in_blocks_with_the_same_result(monkeypatch):
    rows, q = _rows("clustered", "float16", 9000, 32, seed=3)
    q = np.concatenate([q, q[::-1] * 0.5])
    whole = S.exact_search(rows, q, 10, kernel="int8")
    monkeypatch.setattr(exact_int8, "MAX_QUERIES", 3)   # blocks of 3 queries
    calls = []
    scorer = exact_int8.scorer
    monkeypatch.setattr(exact_int8, "scorer", lambda codes, qs, r: calls.append(len(qs)) or scorer(codes, qs, r))
    blocked = S.exact_search(rows, q, 10, kernel="int8")
    assert sorted(set(calls)) == [2, 3]   # 14 queries: four blocks of 3, one of 2 (a scorer per worker each)
    np.testing.assert_array_equal(blocked[1], whole[1])
    np.testing.assert_array_equal(blocked[0], whole[0])
    _check(rows, q, 10)


def test_zero_query_and_zero_rows_are_exact():
    rows, q = _rows("random", "float16", 3000, 32, seed=5)
    rows[100:200] = 0
    q[2] = 0
    _check(rows, q, 20)


# -- the error bound -------------------------------------------------------------------------------------------------
def _approximate(codes, q):
    """The kernel's own approximate scores (N, Q), each query scaled as ``exact_int8.normalized``."""
    return exact_int8.scores(codes, np.ascontiguousarray(q, np.float32))


def _adversarial(d, rng):
    """Rows that stress the quantization: one large coordinate over small ones (the scale is set by the large one,
    the small ones round to a few levels), values at half-steps of the grid, a single spike, mixed magnitudes."""
    rows = []
    for big in (0.999, 0.9, 0.7, 0.5):
        x = np.full(d, np.sqrt((1 - big ** 2) / (d - 1)), np.float32)
        x[0] = big
        rows += [x, x * np.where(np.arange(d) % 2, 1, -1)]
    half = (np.arange(d) % 7 + 0.5) / 127
    rows += [half / np.linalg.norm(half), np.eye(d, dtype=np.float32)[3]]
    mixed = rng.standard_normal(d).astype(np.float32) * np.geomspace(1, 1e-3, d).astype(np.float32)
    rows.append(mixed / np.linalg.norm(mixed))
    rows = np.array(rows, np.float32)
    return np.concatenate([rows, _unit(rng, 2000, d)]).astype(np.float16)


@pytest.mark.parametrize("d", [16, 64, 257, 1100])
def test_margin_is_never_violated_on_adversarial_rows_and_queries(d):
    rng = np.random.default_rng(d)
    rows = _adversarial(d, rng)
    codes = C.build(rows)
    x = rows.astype(np.float64)
    resid = x - _decoded(codes)
    worst = resid[np.argmax(np.linalg.norm(resid, axis=1))]
    spike = np.zeros(d, np.float32)
    spike[5] = 1
    q = np.concatenate([_unit(rng, 20, d), rows[:12].astype(np.float32), spike[None],
                        (worst / np.linalg.norm(worst)).astype(np.float32)[None], 3 * _unit(rng, 2, d),
                        np.full((1, d), 1 / np.sqrt(d), np.float32)])
    approx = _approximate(codes, q).astype(np.float64)
    exact = x @ exact_int8.normalized(q)[0].T   # in the approximate scores' units: each query's largest part 127
    half = exact_int8.margins(q, codes).astype(np.float64) / 2   # the bound on |approximate - exact|
    err = np.abs(approx - exact)
    assert (err <= half[None, :]).all(), float((err - half).max())
    # not vacuous: the query along the worst row's residual gets most of the row term from that row
    j = 20 + 12 + 1
    qn = np.linalg.norm(exact_int8.normalized(q[j:j + 1])[0])
    assert err[:, j].max() >= 0.5 * qn * codes.row_error, (err[:, j].max(), qn * codes.row_error)


def _decoded(codes):
    """(N, d) float64: what the codes stand for, scales[r] * (codes[r] - 128)."""
    return codes.scales.astype(np.float64)[:, None] * (codes.codes.astype(np.float64) - C.ZERO)


def test_stored_residual_figures_are_the_rows_own():
    rng = np.random.default_rng(0)
    rows = _adversarial(40, rng)
    codes = C.build(rows)
    x = rows.astype(np.float64)
    approx = _decoded(codes)
    assert np.abs(codes.codes.astype(int) - C.ZERO).max() <= C.LEVELS and codes.codes.min() >= 1
    assert codes.codes.shape == rows.shape and codes.scales.shape == (len(rows),) and codes.shape == rows.shape
    assert codes.row_error >= np.linalg.norm(x - approx, axis=1).max()
    assert codes.code_norm >= np.linalg.norm(approx, axis=1).max()
    assert codes.row_error <= 1.001 * np.linalg.norm(x - approx, axis=1).max()
    q = _unit(rng, 5, 40)
    qn, qc = exact_int8.normalized(q)
    assert np.abs(qc).max() == exact_int8.QUERY_LEVELS and np.allclose(np.abs(qn).max(axis=1), 127)
    np.testing.assert_allclose(qn / np.linalg.norm(qn, axis=1, keepdims=True), q, rtol=1e-6, atol=1e-7)


def test_non_finite_rows_have_no_codes():
    rows = np.ones((10, 4), np.float16)
    rows[3, 1] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        S.exact_search(rows, np.ones(4, np.float32) / 2, 3, kernel="int8")


def _product(A, Q, S, out, saturating: bool) -> None:
    """A product's stand-in: the stored codes less 128 times the query codes, times the scales; ``saturating``: as
    AVX2's u8 x s8 instruction would compute it (the codes unsigned, the queries signed), int16 pair sums clipped."""
    A, Q = A.astype(np.int64), Q.astype(np.int64)
    if not saturating:
        D = (A - C.ZERO) @ Q
    else:
        prod = A[:, :, None] * Q[None, :, :]                             # (c, d, m)
        pairs = np.clip(prod[:, 0::2] + prod[:, 1::2], -32768, 32767)     # int16 pair sums
        D = pairs.sum(axis=1) - C.ZERO * Q.sum(axis=0)[None, :]
    out[:] = (D * S[:, None]).astype(np.float32)


def test_an_inexact_integer_product_is_refused(monkeypatch):
    """A product whose int16 pair sums saturate (AVX2's u8 x s8 instruction with 8-bit queries) is caught by the
    check before any search, and then neither ``auto`` nor a forced search uses the kernel."""
    exact_int8._check_product(lambda A, Q, S_, out: _product(A, Q, S_, out, False), 24)   # exact
    with pytest.raises(RuntimeError, match="not exact"):
        exact_int8._check_product(lambda A, Q, S_, out: _product(A, Q, S_, out, True), 24)

    def fake(saturates):
        return lambda signed, Q: (lambda A, S_, out: _product(A, Q, S_, out, saturates(signed)))

    monkeypatch.setattr(exact_int8, "_checked", {})
    monkeypatch.setattr(exact_int8, "_product", fake(lambda signed: True))
    assert not exact_int8.works(24)
    with pytest.raises(ValueError, match="does not run here"):
        S.exact_search(np.ones((10, 24), np.float16), np.ones(24, np.float32), 3, kernel="int8")
    # the u8 x s8 product where it is exact (VNNI), else the u8 x u8 one (AVX2: its u8 x s8 instruction saturates)
    for signed_exact in (True, False):
        monkeypatch.setattr(exact_int8, "_checked", {})
        monkeypatch.setattr(exact_int8, "_signed", {})
        monkeypatch.setattr(exact_int8, "_product", fake(lambda signed: signed and not signed_exact))
        assert exact_int8.works(24) and exact_int8._signed[24] is signed_exact


def test_the_products_this_machine_runs_are_exact():
    """Both products on the machine's own onnxruntime, chunks of stored codes read in place: the u8 x s8 one where
    ``works`` takes it, and the u8 x u8 one, each equal to numpy's integer product times the scales."""
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(3)
    A = rng.integers(1, 256, (300, 40)).astype(np.uint8)
    Q = rng.integers(-127, 128, (40, 9))
    scales = rng.random(300).astype(np.float32)
    want = (((A.astype(np.int64) - C.ZERO) @ Q).astype(np.float32) * scales[:, None]).astype(np.float32)
    assert exact_int8.works(40)
    for signed in (False, True) if exact_int8._signed[40] else (False,):
        got = np.empty((300, 9), np.float32)
        exact_int8._product(signed, Q)(A, scales, got)
        np.testing.assert_array_equal(got, want)
        part = np.empty((7, 9), np.float32)   # a chunk in the middle of the codes, as the group pass reads it
        exact_int8._product(signed, Q)(A[100:107], scales[100:107], part)
        np.testing.assert_array_equal(part, want[100:107])


# -- the sidecar -----------------------------------------------------------------------------------------------------
def _saved(path: Path, rows: np.ndarray) -> np.ndarray:
    np.save(path, rows)
    return np.load(path, mmap_mode="r")


def test_sidecar_is_made_once_beside_the_rows_and_reused(tmp_path, monkeypatch):
    rows, q = _rows("clustered", "float16", 6000, 32, seed=1)
    mm = _saved(tmp_path / "embeddings-1.npy", rows)
    assert not C.ready(mm)
    _check(mm, q, 10)
    side, meta_path = tmp_path / "embeddings-1.int8", tmp_path / "embeddings-1.int8.json"
    assert side.is_file() and meta_path.is_file()
    meta = json.loads(meta_path.read_text())
    from clip_mini.fileio.atomic import sha256_file

    assert meta["source_sha256"] == sha256_file(tmp_path / "embeddings-1.npy")
    assert meta["sha256"] == sha256_file(side) and meta["rows"] == 6000 and meta["dim"] == 32
    assert C.ready(mm)
    stamp = os.stat(side)
    # a fresh process's view (nothing remembered): read from the file, never made again
    monkeypatch.setattr(C, "_known", {})
    monkeypatch.setattr(C, "write", lambda *a, **k: pytest.fail("the sidecar was made again"))
    codes = C.for_rows(mm)
    assert codes.path == side and not codes.codes.flags.writeable and not codes.scales.flags.writeable
    assert str(side) in Path("/proc/self/maps").read_text()   # memory-mapped: page-cache pages, not a copy
    _check(mm, q, 10)
    assert os.stat(side).st_mtime_ns == stamp.st_mtime_ns and os.stat(side).st_ino == stamp.st_ino


def test_sidecar_is_made_again_when_the_rows_change(tmp_path):
    path = tmp_path / "embeddings-1.npy"
    rows, q = _rows("random", "float16", 5000, 32, seed=2)
    _check(_saved(path, rows), q, 10)
    first = json.loads((tmp_path / "embeddings-1.int8.json").read_text())
    other, _ = _rows("clustered", "float16", 5000, 32, seed=9)   # same shape, other values: a new file
    mm = _saved(path, other)
    assert not C.ready(mm)   # the old codes belong to other rows
    _check(mm, q, 10)
    second = json.loads((tmp_path / "embeddings-1.int8.json").read_text())
    assert second["source_sha256"] != first["source_sha256"]
    # the same file rewritten in place (same inode): its identity changed, so the codes are checked again
    with open(path, "r+b") as f:
        f.seek(-64, 2)
        f.write(np.full(32, 0.5, np.float16).tobytes())
    mm = np.load(path, mmap_mode="r")
    assert not C.ready(mm)
    _check(mm, q, 10)


@pytest.mark.parametrize("damage", ["codes", "scales", "meta_rows", "swapped"])
def test_stale_or_damaged_sidecar_is_never_used(tmp_path, damage):
    path = tmp_path / "embeddings-1.npy"
    rows, q = _rows("clustered", "float16", 5000, 32, seed=4)
    mm = _saved(path, rows)
    C.for_rows(mm)
    side, meta_path = tmp_path / "embeddings-1.int8", tmp_path / "embeddings-1.int8.json"
    meta = json.loads(meta_path.read_text())
    original = dict(meta)
    if damage in ("codes", "scales"):   # one byte: a code pushed far off, or a scale halved
        raw = bytearray(side.read_bytes())
        at = 5000 * 32 // 2 if damage == "codes" else meta["scales_offset"] + 4 * 7 + 3
        raw[at] ^= 0x40
        side.write_bytes(bytes(raw))
    elif damage == "meta_rows":   # a description that lies about the bound
        meta["row_error"] = 0.0
        meta_path.write_text(json.dumps(meta))
    else:   # a pair whose codes are another rows file's (a half-replaced sidecar)
        other = _saved(tmp_path / "other.npy", _rows("random", "float16", 5000, 32, seed=7)[0])
        C.for_rows(other)
        side.write_bytes((tmp_path / "other.int8").read_bytes())
    C._known.clear()
    assert C.load(side, mm.shape, original["source_sha256"]) is None
    _check(mm, q, 10)   # made again, and exact
    fresh = json.loads(meta_path.read_text())
    assert C.load(side, mm.shape, fresh["source_sha256"]) is not None
    assert fresh["row_error"] == original["row_error"] > 0   # the figures the bound rests on, made again


def test_rows_in_a_folder_that_refuses_the_sidecar_keep_it_in_the_user_cache(tmp_path):
    rows, q = _rows("random", "float16", 4000, 32, seed=6)
    mm = _saved(tmp_path / "embeddings-1.npy", rows)
    (tmp_path / "embeddings-1.int8").mkdir()   # the name is taken: nothing can be written there (even as root)
    _check(mm, q, 10)
    cached = list((tmp_path / "cache" / "int8").glob("*.int8"))
    assert len(cached) == 1 and C.for_rows(mm).path == cached[0]
    C._known.clear()
    assert C.ready(mm)   # found there again


def test_part_of_a_file_or_rows_in_memory_get_no_sidecar(tmp_path):
    rows, q = _rows("random", "float16", 4000, 32, seed=8)
    mm = _saved(tmp_path / "embeddings-1.npy", rows)
    assert C.source_file(mm) == tmp_path / "embeddings-1.npy"
    assert C.source_file(mm[:2000]) is None and C.source_file(mm[1:]) is None
    assert C.source_file(np.array(mm)) is None
    _check(mm[1000:], q, 10)
    _check(np.array(mm), q, 10)
    assert not (tmp_path / "embeddings-1.int8").exists()
    assert not C.ready(np.array(mm))


def test_another_process_maps_the_same_sidecar(tmp_path):
    """Two processes (two server workers) share the codes read-only: the second opens the first's file."""
    rows, q = _rows("random", "float16", 4000, 32, seed=11)
    path = tmp_path / "embeddings-1.npy"
    mm = _saved(path, rows)
    C.for_rows(mm)
    side = tmp_path / "embeddings-1.int8"
    before = os.stat(side)
    script = (f"import numpy as np, sys; from pathlib import Path; from clip_mini.retrieval.search import codes as C;"
              f"c = C.for_rows(np.load({str(path)!r}, mmap_mode='r'), make=False);"
              f"maps = Path('/proc/self/maps').read_text(); print(c is not None and str(c.path) in maps and "
              f"not c.codes.flags.writeable)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    after = os.stat(side)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_commit_writes_the_sidecar_and_drops_an_old_generations(tmp_path, monkeypatch):
    from clip_mini.retrieval.format import commit, writer_lock

    monkeypatch.setattr(C, "MIN_ROWS", 1000)
    index = tmp_path / "index"
    for gen in (1, 2, 3):
        n = 1500 + gen
        rows, _ = _rows("random", "float16", n, 16, seed=gen)
        items = {"path": [f"/photos/{i:05d}.jpg" for i in range(n)], "size": [1] * n, "mtime_ns": [0] * n,
                 "sha256": ["0" * 64] * n, "caption": [""] * n}
        with writer_lock(index):
            index.mkdir(exist_ok=True)
            np.save(index / f"embeddings-{gen}.npy", rows)
            commit(index, gen, items, {"model_fingerprint": "x"}, progress=False)
        assert (index / f"embeddings-{gen}.int8").is_file() and (index / f"embeddings-{gen}.int8.json").is_file()
    assert not (index / "embeddings-1.int8").exists() and not (index / "embeddings-1.int8.json").exists()
    assert (index / "embeddings-2.int8").exists()
    mm = np.load(index / "embeddings-3.npy", mmap_mode="r")
    assert C.ready(mm)


# -- auto ------------------------------------------------------------------------------------------------------------
def test_auto_picks_int8_only_where_the_codes_are_at_hand(tmp_path, monkeypatch):
    # auto's int8 rule is for CPUs without AMX: on one that has it, the test takes that decision
    monkeypatch.setattr(dispatch, "cpu_amx", lambda: False)
    monkeypatch.setattr(dispatch, "INT8_MIN_ROWS", 1000)
    monkeypatch.setattr(dispatch, "ORT_MIN_ROWS", 1000)
    rows, _ = _rows("random", "float16", 3000, 32, seed=12)
    mm = _saved(tmp_path / "embeddings-1.npy", rows)
    m = max(dispatch.INT8_MIN_QUERIES, 2)
    q = _unit(np.random.default_rng(1), m, 32)
    dispatch.searches.clear()
    S.exact_search(mm, q[:m], 5)
    assert dispatch.searches["int8"] == 0 and not (tmp_path / "embeddings-1.int8").exists()   # auto makes none
    monkeypatch.setattr(exact_int8, "_checked", {})
    assert S.prepare(mm)   # what a server does when it opens a generation: the product's check on its own thread
    for _ in range(600):
        if exact_int8.checked(32) is not None:
            break
        S.exact_search(mm, q[:m], 5)   # meanwhile the other kernels answer
        time.sleep(0.05)
    dispatch.searches.clear()
    S.exact_search(mm, q[:m], 5)
    assert dispatch.searches["int8"] == 1
    assert S.auto_kernel(3000, m, True, int8=True) == "int8"
    assert S.auto_kernel(3000, m, True, int8=False) != "int8"
    assert S.auto_kernel(3000, m, False, int8=True) == "numpy"   # float32 rows: one product, no codes
    assert not S.prepare(np.array(mm))   # rows in memory: no sidecar, nothing made


def test_auto_picks_the_kernel_measured_fastest_with_codes():
    """Where ``bench_search_many.py`` measured with the codes at hand, ``auto`` picks (today's rule) what it
    recorded, within 10% of the fastest forced kernel, and the int8 kernel's answer was the numpy kernel's."""
    from clip_mini.runtime.isa import cpu_kind

    path = ROOT / f"benchmarks/results/speed/search_many_{cpu_kind()}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if not data.get("int8_codes"):
        pytest.skip(f"no measurement with int8 codes for this CPU kind ({path.name})")
    for where in ("torch_free", "torch_loaded"):
        for key, row in data[where].items():
            assert row["int8"]["same_ids_as_numpy"] and row["int8"]["recall_at_10_by_score"] == 1.0, (where, key)
            assert row[row["kernel"]]["p50_ms"] <= 1.1 * row[row["fastest_forced"]]["p50_ms"], (where, key)
