"""Search back ends against brute force, faiss against exact, and recall@K against a hand computation."""
import numpy as np
import pytest

from clip_mini.search import build_faiss, exact_search, faiss_available, faiss_search


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _brute(emb16, q, k):
    sims = q @ emb16.astype(np.float32).T
    order = np.lexsort((np.broadcast_to(np.arange(sims.shape[1]), sims.shape), -sims), axis=1)[:, :k]
    return np.take_along_axis(sims, order, 1), order


@pytest.mark.parametrize("chunk_rows", [7, 64, 100000])
def test_exact_matches_brute_force(chunk_rows):
    rng = np.random.default_rng(0)
    emb = _unit(rng, 1000, 16).astype(np.float16)
    q = _unit(rng, 9, 16)
    scores, ids = exact_search(emb, q, k=10, chunk_rows=chunk_rows)
    ref_s, ref_i = _brute(emb, q, 10)
    np.testing.assert_array_equal(ids, ref_i)
    np.testing.assert_allclose(scores, ref_s, rtol=1e-6, atol=1e-6)
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    assert (np.diff(scores, axis=1) <= 0).all()


def test_exact_on_memmap(tmp_path):
    rng = np.random.default_rng(1)
    np.save(tmp_path / "e.npy", _unit(rng, 300, 8).astype(np.float16))
    emb = np.load(tmp_path / "e.npy", mmap_mode="r")
    q = _unit(rng, 1, 8)[0]   # a single (d,) query
    scores, ids = exact_search(emb, q, k=5, chunk_rows=50)
    ref_s, ref_i = _brute(np.asarray(emb), q[None], 5)
    np.testing.assert_array_equal(ids, ref_i)


def test_k_larger_than_index_and_ties():
    emb = np.ones((4, 3), np.float16) / np.sqrt(3).astype(np.float16)   # four identical rows
    scores, ids = exact_search(emb, np.ones(3, np.float32) / np.sqrt(3), k=10, chunk_rows=2)
    assert ids.tolist() == [[0, 1, 2, 3]]   # k clipped to N; ties broken by row id
    assert scores.shape == (1, 4)


@pytest.mark.parametrize("k", [0, -3, 2.5, True])
def test_bad_k_rejected(k):
    with pytest.raises(ValueError, match="k must be a positive integer"):
        exact_search(np.zeros((3, 4), np.float16), np.zeros(4, np.float32), k=k)


def test_query_dimension_checked():
    with pytest.raises(ValueError, match=r"queries must be \(n, 4\)"):
        exact_search(np.zeros((3, 4), np.float16), np.zeros((2, 5), np.float32), k=1)


@pytest.mark.skipif(not faiss_available(), reason="faiss not installed")
@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_faiss_agrees_with_exact(kind):
    rng = np.random.default_rng(2)
    centres = _unit(rng, 20, 32)
    emb = centres[rng.integers(0, 20, 2000)] + 0.3 * rng.standard_normal((2000, 32)).astype(np.float32)
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float16)
    q = _unit(rng, 16, 32)
    index = build_faiss(emb, kind)
    if kind == "ivf":
        index.nprobe = index.nlist   # probing every list makes IVF-Flat exact
    s_f, i_f = faiss_search(index, q, k=10)
    s_e, i_e = exact_search(emb, q, k=10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(i_f, i_e)])
    assert recall >= (1.0 if kind == "ivf" else 0.95)
    np.testing.assert_allclose(s_f[:, 0], s_e[:, 0], atol=1e-4)


def test_recall_at_k_matches_hand_computation():
    """3 images x 3 captions: caption j belongs to image j; similarities chosen so each rank is known."""
    from clip_mini.evaluate import retrieval_metrics

    # sim[text, image] = text_features @ image_features.T; build features from the matrix via identity images.
    image_features = np.eye(3, dtype=np.float32)
    text_features = np.array([[0.9, 0.1, 0.0],    # caption 0 -> image 0 ranked 1st
                              [0.8, 0.1, 0.5],    # caption 1 -> image 1 ranked 3rd
                              [0.2, 0.3, 0.6]],   # caption 2 -> image 2 ranked 1st
                             dtype=np.float32)
    m = retrieval_metrics(image_features, text_features, [0, 1, 2], ks=(1, 2, 3))
    assert m["t2i_r1"] == pytest.approx(2 / 3)
    assert m["t2i_r2"] == pytest.approx(2 / 3)
    assert m["t2i_r3"] == pytest.approx(1.0)
    assert m["t2i_medr"] == 1.0
    # image -> text, columns of the same matrix: image 0 best caption is 0 (0.9); image 1: captions score
    # 0.1, 0.1, 0.3 -> its caption 1 ties caption 0 for 2nd, and a tie counts against it: 3rd; image 2:
    # caption 2 (0.6) is 1st.
    assert m["i2t_r1"] == pytest.approx(2 / 3)
    assert m["i2t_r2"] == pytest.approx(2 / 3)
    assert m["i2t_r3"] == pytest.approx(1.0)
