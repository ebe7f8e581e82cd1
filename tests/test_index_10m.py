"""Indexes past RAM, on a small stand-in (the 10M-row run is benchmarks/speed/bench_index_10m.py): exact search over an
on-disk memory map equals brute force, IVF-PQ with exact re-ranking returns exact scores and finds the true
neighbours, its codes are a fraction of the float16 rows, and ``faiss: auto`` picks it above IVFPQ_THRESHOLD."""
import numpy as np
import pytest

from clip_mini.retrieval import search as S
from clip_mini.retrieval.build import faiss_kind
from clip_mini.retrieval.format import commit, writer_lock
from clip_mini.retrieval.reader import IndexReader

faiss = pytest.importorskip("faiss", reason="faiss is not installed: pip install 'clip-mini[faiss]'")

N, D = 20_000, 64


@pytest.fixture(scope="module", autouse=True)
def one_faiss_thread():
    # OpenMP threads spin-wait: on a shared, busy machine one thread trains k-means much faster than two
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> np.ndarray:
    """N clustered unit rows, float16, written to disk and opened as a memory map (as an index stores them)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, D)).astype(np.float32)[rng.integers(0, 200, N)]
    x += 0.5 * rng.standard_normal((N, D), dtype=np.float32)
    path = tmp_path_factory.mktemp("big") / "embeddings-1.npy"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(N, D))
    mm[:] = x / np.linalg.norm(x, axis=1, keepdims=True)
    mm.flush()
    del mm
    return np.load(path, mmap_mode="r")


def _queries(rows, n=20):
    q = np.asarray(rows[np.arange(0, N, N // n)[:n]], np.float32)
    q += 0.05 * np.random.default_rng(1).standard_normal(q.shape, dtype=np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def test_exact_search_over_a_memory_map_equals_brute_force(rows):
    assert isinstance(rows, np.memmap)
    q = _queries(rows)
    scores, ids = S.exact_search(rows, q, 10, chunk_rows=3000)   # many chunks, as over a 10M-row file
    full = q @ np.asarray(rows, np.float32).T
    want = np.argsort(-full, axis=1, kind="stable")[:, :10]
    np.testing.assert_allclose(scores, np.take_along_axis(full, want, 1), rtol=0, atol=1e-5)
    assert (ids == want).mean() > 0.99   # equal scores may swap places


def test_ivfpq_reranked_scores_are_exact_and_find_the_true_neighbours(rows):
    index = S.build_faiss(rows, "ivfpq")
    assert index.code_size == D // 8   # 8 bytes a row against 128 for the float16 row
    q = _queries(rows)
    scores, ids = S.faiss_search(index, q, 10, rerank=rows)
    exact = q @ np.asarray(rows, np.float32).T
    np.testing.assert_allclose(scores, np.take_along_axis(exact, ids, 1), rtol=0, atol=1e-5)
    _, true_ids = S.exact_search(rows, q, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, true_ids)])
    _, raw = S.faiss_search(index, q, 10)
    raw_recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(raw, true_ids)])
    assert recall >= 0.9 and recall >= raw_recall, (recall, raw_recall)


def test_ivfpq_refuses_too_few_rows(rows):
    with pytest.raises(ValueError, match="at least"):
        S.build_faiss(rows[:5000], "ivfpq")


def test_auto_picks_ivfpq_above_its_threshold_and_the_reader_reranks(rows, tmp_path, monkeypatch):
    assert faiss_kind("auto", None, S.FAISS_THRESHOLD - 1) is None
    assert faiss_kind("auto", None, S.FAISS_THRESHOLD) == "hnsw"
    assert faiss_kind("auto", None, S.IVFPQ_THRESHOLD) == "ivfpq"
    monkeypatch.setattr(S, "FAISS_THRESHOLD", 10_000)
    monkeypatch.setattr(S, "IVFPQ_THRESHOLD", 15_000)
    kind = faiss_kind("auto", None, N)
    assert kind == "ivfpq"
    path = tmp_path / "ix"
    path.mkdir()
    np.save(path / "embeddings-1.npy", np.asarray(rows))
    items = {"path": [f"/img/{i}.jpg" for i in range(N)], "size": [1] * N, "mtime_ns": [0] * N,
             "sha256": [f"{i:064x}" for i in range(N)], "caption": [""] * N}
    with writer_lock(path):
        commit(path, 1, items, {"model_fingerprint": "m", "source": None, "shard": None, "model_dir": None}, kind,
               progress=False)
    index = IndexReader.load(path)
    assert index.manifest["faiss_kind"] == "ivfpq"
    q = _queries(rows, 5)
    s_auto, i_auto = index.search(q, 10)            # auto: faiss above the (patched) threshold, re-ranked
    s_exact, i_exact = index.search(q, 10, backend="exact")
    np.testing.assert_allclose(s_auto, np.take_along_axis(q @ np.asarray(rows, np.float32).T, i_auto, 1), atol=1e-5)
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(i_auto, i_exact)]) >= 0.9


def test_faiss_auto_keeps_to_the_memory_budget(monkeypatch):
    from clip_mini.retrieval.format import EmbeddingIndexError

    monkeypatch.setattr(S, "faiss_available", lambda: True)
    n, dim = 800_000, 256   # between FAISS_THRESHOLD and IVFPQ_THRESHOLD: HNSW if it fits
    hnsw, ivfpq = S.faiss_memory("hnsw", n, dim), S.faiss_memory("ivfpq", n, dim)
    assert ivfpq < hnsw / 10   # PQ codes: a few percent of the float32 rows HNSW keeps
    assert faiss_kind("auto", None, n, dim, memory_budget=hnsw) == "hnsw"
    assert faiss_kind("auto", None, n, dim, memory_budget=hnsw - 1) == "ivfpq"   # HNSW no longer fits
    with pytest.raises(EmbeddingIndexError, match="memory budget.*--faiss none"):
        faiss_kind("auto", None, n, dim, memory_budget=ivfpq - 1)
    monkeypatch.setattr("clip_mini.retrieval.build.available_memory", lambda: 2 * hnsw)   # default: half of it
    assert faiss_kind("auto", None, n, dim) == "hnsw"
    monkeypatch.setattr("clip_mini.retrieval.build.available_memory", lambda: 2 * hnsw - 2)
    assert faiss_kind("auto", None, n, dim) == "ivfpq"
    assert faiss_kind("hnsw", None, n, dim, memory_budget=1) == "hnsw"   # an explicit kind is the user's call


def test_reranked_ties_go_by_row_id_and_short_candidate_lists_are_padded():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((8, D)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    rows = np.repeat(base, 5, axis=0).astype(np.float16)   # every row five times: five-way exact ties
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(D), D, 8, faiss.METRIC_INNER_PRODUCT)
    index.train(np.asarray(rows, np.float32))
    index.add(np.asarray(rows, np.float32))
    index.nprobe = 1   # one list: fewer candidates than RERANK * k, so faiss pads with -1
    q = np.asarray(rows[::5], np.float32)[np.arange(37) % 8]   # 37 queries: more than one rerank block
    scores, ids = S.faiss_search(index, q, 10, rerank=rows)
    for qi, (s, i) in enumerate(zip(scores, ids)):
        found = i[i >= 0]
        assert len(found) >= 5 and np.all(np.isneginf(s[i < 0]))   # padding: id -1 with score -inf, at the end
        assert np.all(np.diff(s[i >= 0]) <= 0)
        own = (qi % 8) * 5
        assert list(found[:5]) == list(range(own, own + 5))   # the five equal rows, in row-id order
