"""Search back ends against brute force, faiss against exact, recall@K against a hand computation, and text search
with the trained fixture on held-out and compositional images."""
from pathlib import Path

import numpy as np
import pytest

from clip_mini.retrieval.search import build_faiss, exact_search, faiss_available, faiss_search


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
    from clip_mini.eval.metrics import retrieval_metrics

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


# -- search quality on images the trained fixture never saw ------------------------------------------------------
def _objects(shapes_dir) -> dict[str, set]:
    """Image name -> its (colour, shape) pairs, from the generator's labels.csv."""
    import csv

    with open(shapes_dir / "labels.csv", newline="") as f:
        return {r["image"]: {(r["colour"], r["shape"]), (r["colour2"], r["shape2"])} for r in csv.DictReader(f)}


def _precision_recall(index, objects, colour, shape, query, k=10) -> tuple[float, float]:
    """Precision@k, and recall at R (R = the number of relevant images in the index: R-precision)."""
    from pathlib import Path

    relevant = {p for p in index.items["path"] if (colour, shape) in objects[Path(p).name]}
    hits = index.search_text(query, k=max(k, len(relevant)))
    precision = np.mean([p in relevant for p, _ in hits[:k]])
    recall = len(relevant & {p for p, _ in hits[:len(relevant)]}) / len(relevant)
    return float(precision), recall


@pytest.fixture(scope="module")
def heldout_index(trained_model_dir, heldout_images, tmp_path_factory):
    from clip_mini.retrieval.index import EmbeddingIndex

    return EmbeddingIndex.build(tmp_path_factory.mktemp("indexes") / "heldout", trained_model_dir, heldout_images,
                                progress=False)


@pytest.mark.slow
def test_text_search_finds_colour_and_shape_in_heldout_images(heldout_index, shapes_dir, shapes_splits):
    from clip_mini.data.synthetic import COLOURS, HELD_OUT, SHAPES

    objects = _objects(shapes_dir)
    trained_on = set(shapes_splits["train"]["image"])
    indexed = {Path(p).name for p in heldout_index.items["path"]}
    assert len(indexed) == 600 and not indexed & trained_on   # the val and test images, none trained on
    scores = [_precision_recall(heldout_index, objects, c, s, f"a large {c} {s} in the center")
              for c in COLOURS for s in SHAPES if (c, s) not in HELD_OUT]
    precision, recall = np.mean(scores, axis=0)
    print(f"held-out precision@10 {precision:.3f}, R-precision {recall:.3f}")
    # Each (colour, shape) is in about 5% of the images, so chance is ~0.05 for both.
    assert precision >= 0.45 and recall >= 0.2, scores   # measured: 0.65 and 0.30


@pytest.mark.slow
def test_compositional_split_pairs_never_seen_in_training(trained_model_dir, shapes_dir, heldout_images, tmp_path,
                                                          capsys):
    """compositional_test.csv: images whose first object is a (colour, shape) pair no training caption names."""
    import json
    import shutil

    from clip_mini.cli.main import main
    from clip_mini.data import read_captions
    from clip_mini.data.synthetic import HELD_OUT
    from clip_mini.retrieval.index import EmbeddingIndex

    folder = tmp_path / "images"
    shutil.copytree(heldout_images, folder)
    comp, _ = read_captions(shapes_dir / "compositional_test.csv")
    for p in comp["path"].unique():
        shutil.copy2(p, folder / Path(p).name)
    index = EmbeddingIndex.build(tmp_path / "index", trained_model_dir, folder, progress=False)
    objects = _objects(shapes_dir)
    scores = [_precision_recall(index, objects, c, s, t.format(c=c, s=s)) for c, s in sorted(HELD_OUT)
              for t in ("a {c} {s}", "a large {c} {s} in the center", "a small {c} {s} on the left")]
    precision, recall = np.mean(scores, axis=0)
    print(f"compositional precision@10 {precision:.3f}, R-precision {recall:.3f}")
    # Each held-out pair is in ~9% of these images; measured: 0.70 and 0.40.
    assert precision >= 0.45 and recall >= 0.25, scores
    # `make demo`'s held-out evaluation: the whole compositional file as one split (val and test sizes 0 leave
    # every image in "train", the split's name only; this model never trained on any of them).
    config = tmp_path / "comp.yaml"
    capsys.readouterr()
    config.write_text(f"data:\n  captions: {shapes_dir / 'compositional_test.csv'}\n  val: 0\n  test: 0\n"
                      "  cache: false\n")
    assert main(["eval", "--model", str(trained_model_dir), "--data", str(config), "--split", "train", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["n_images"] == comp["image"].nunique() == 300 and m["n_captions"] == len(comp)
    assert m["t2i_r10"] > 0.4 and m["i2t_r10"] > 0.3   # chance 10/300; measured 0.70 and 0.54


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [150, 3001])
@pytest.mark.parametrize("mode", ["bf16", "implicit", "wide"])
def test_grouped_many_query_pass_is_exact(storage, n, mode, monkeypatch):
    """The many-queries pass keeps only each group's maximum, and filters groups by super-group maxima first:
    clustered near-ties spread over many groups, a partial last group, fewer super-groups (n=3001: 47) than one
    k asked for (k=40 still fits; n=150: fewer groups than k) must still give the exact top-K, with float16 rows
    converted to bf16 by torch, (``implicit``, where the CPU has native bf16) rounded inside oneDNN's product, or
    (``wide``, what a CPU without native bf16 does) widened to float32 for a float32 product."""
    pytest.importorskip("torch")
    from clip_mini.retrieval.rows import BF16Rows, encode
    from clip_mini.retrieval.search import exact_torch as T

    monkeypatch.setattr(T, "_BF16_CHUNK", 200)        # several chunks, not whole groups (rounded down to 192)
    monkeypatch.setattr(T, "_BF16_ROWS_CHUNK", 200)
    monkeypatch.setattr(T, "_IMPLICIT_CHUNK", 200)
    monkeypatch.setattr(T, "_FP32_CHUNK", 200)
    monkeypatch.setattr(T, "_SUPER", 4)               # 47 super-groups of 4 groups, the last one padded
    monkeypatch.setattr(T, "_IMPLICIT_BF16", mode == "implicit")
    monkeypatch.setattr(T, "_FP32", mode == "wide")
    rng = np.random.default_rng(11)
    centre = _unit(rng, 1, 32)[0]
    emb = _unit(rng, n, 32)
    emb[::3] = centre + 0.01 * rng.standard_normal((len(emb[::3]), 32))   # a third within ~0.01 of each other
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb[n - 1] = emb[n - 2] = emb[0]   # exact ties, one of them in the partial last group
    q = _unit(rng, 12, 32)
    q[0] = emb[0]
    q[1] = centre
    rows = BF16Rows(encode(emb, "bfloat16")) if storage == "bfloat16" else emb.astype(np.float16)
    stored = np.asarray(rows, np.float32)
    # float64 reference: bf16 rounding makes some rows equal, and float32 BLAS may round equal rows differently
    sims = (q.astype(np.float64) @ stored.astype(np.float64).T).astype(np.float32)
    order = np.lexsort((np.broadcast_to(np.arange(n), sims.shape), -sims), axis=1)
    for k in (1, 10, 40):
        scores, ids = exact_search(rows, q, k=k, kernel="torch")
        ref_i = order[:, :k]
        ref_s = np.take_along_axis(sims, ref_i, 1)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_allclose(scores, ref_s, atol=1e-6)
    assert ids[0, :3].tolist() == [0, n - 2, n - 1]


@pytest.mark.parametrize("native", [False, True])
def test_many_queries_multiply_in_float32_without_native_bf16(native, monkeypatch):
    """Where the CPU has no native bf16 (AVX2 only) a bf16 product is emulated, an order of magnitude slower than
    float32 (bench_serve.py --arm 1m, no-bf16 EPYC): the pass multiplies in float32 there, and only there."""
    pytest.importorskip("torch")
    import torch

    from clip_mini.runtime import isa
    from clip_mini.retrieval.search import exact_torch as T

    monkeypatch.setattr(isa, "cpu_native_bf16", lambda: native)
    assert T._FP32 is None and T._fp32_products() is (not native)
    products = []
    real = torch.Tensor.__matmul__

    def recorded(a, b):
        products.append((a.dtype, b.dtype))
        return real(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", recorded)
    monkeypatch.setattr(T, "_IMPLICIT_BF16", False)
    rng = np.random.default_rng(2)
    emb = _unit(rng, 2000, 16).astype(np.float16)
    q = _unit(rng, 6, 16)   # more than _MV_MAX_QUERIES: the many-queries pass
    scores, ids = exact_search(emb, q, k=5, kernel="torch")
    ref_s, ref_i = _brute(emb, q, 5)
    np.testing.assert_array_equal(ids, ref_i)
    pass_dtypes = set(products[:1])   # the pass's first product (re-scoring multiplies float32 either way)
    assert pass_dtypes == ({(torch.bfloat16, torch.bfloat16)} if native else {(torch.float32, torch.float32)})


@pytest.mark.parametrize("n_queries", [1, 3, 9])
def test_torch_kernel_matches_float32_brute_force(n_queries, monkeypatch, tmp_path):
    pytest.importorskip("torch")
    from clip_mini.retrieval.search import exact_torch as T

    # Small chunks so several chunks, their merge and the near-tie fallback all run on a small matrix.
    monkeypatch.setattr(T, "_BIG_CHUNK", 700)
    monkeypatch.setattr(T, "_BF16_CHUNK", 300)   # not whole groups of _GROUP rows: rounded down
    monkeypatch.setattr(T, "_IMPLICIT_CHUNK", 300)
    monkeypatch.setattr(T, "_FP32_CHUNK", 300)
    monkeypatch.setattr(T, "_SUPER", 3)          # the 41 tied rows below fill one super-group's groups
    rng = np.random.default_rng(5)
    emb = _unit(rng, 3000, 24)
    emb[1000:1040] = emb[7]   # 41 identical rows: ties broken by row id, and one chunk holds more near-ties
    q = _unit(rng, n_queries, 24)   # than its short list, which forces the exact fallback
    q[0] = emb[7]
    np.save(tmp_path / "e.npy", emb.astype(np.float16))
    mm = np.load(tmp_path / "e.npy", mmap_mode="r")
    for k in (1, 10, 50):
        scores, ids = exact_search(mm, q, k=k, kernel="torch")
        ref_s, ref_i = _brute(np.asarray(mm), q, k)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_allclose(scores, ref_s, atol=1e-6)
    assert ids[0, :41].tolist() == [7] + list(range(1000, 1040))
    with pytest.raises(ValueError, match="unknown exact-search kernel"):
        exact_search(mm, q, kernel="fp16")


# -- ties: every exact kernel, and the server's float32 copy, rank equal scores by row id -------------------------
def _served(rows, q, k):
    """``clip-mini serve``'s exact search over its float32 copy of a generation's rows."""
    from clip_mini.serve.generations import _search_rows32

    return _search_rows32(np.asarray(rows, np.float32), q, k)


def _reference(rows, q, k):
    """The float32 top-K of the rows as stored, best first, ties by row id (float64 products rounded once, so equal
    rows score equally; a float32 BLAS product may round them differently by where they fall in its blocks)."""
    sims = (q.astype(np.float64) @ np.asarray(rows, np.float32).astype(np.float64).T).astype(np.float32)
    order = np.lexsort((np.broadcast_to(np.arange(sims.shape[1]), sims.shape), -sims), axis=1)[:, :k]
    return np.take_along_axis(sims, order, 1), order


def _stored(emb: np.ndarray, storage: str):
    from clip_mini.retrieval.rows import BF16Rows, encode

    return BF16Rows(encode(emb, "bfloat16")) if storage == "bfloat16" else emb.astype(storage)


def _scan_available() -> bool:
    from clip_mini.retrieval import search as S

    return S.faiss_scan_available()


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


TIE_KERNELS = ["numpy", "onnxruntime", "auto", "served",
               pytest.param("torch", marks=pytest.mark.skipif(not _torch_installed(), reason="torch not installed")),
               pytest.param("faiss", marks=pytest.mark.skipif(not _scan_available(), reason="faiss >= 1.11 missing"))]


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kernel", TIE_KERNELS)
def test_every_kernel_ranks_ties_by_row_id(kernel, storage):
    """100 identical rows give rows 0-4 for k=5, rows tied every 5th give 0, 5, 10, ..., and clustered near-ties
    give the brute-force top-K, from every exact kernel (``auto`` included: numpy for small or float32 matrices)
    and from the server's float32 copy, for one query and for several."""
    if storage == "float32" and kernel in ("onnxruntime", "torch", "faiss"):
        pytest.skip(f"the {kernel} kernel reads float16 or bfloat16 rows")

    def search(rows, q, k):
        return _served(rows, q, k) if kernel == "served" else exact_search(rows, q, k=k, kernel=kernel)

    rng = np.random.default_rng(7)
    d = 24
    one = _unit(rng, 1, d)
    scores, ids = search(_stored(np.repeat(one, 100, axis=0), storage), one, 5)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] and len(set(scores[0].tolist())) == 1
    emb = _unit(rng, 300, d)
    emb[::5] = one
    q = np.concatenate([one, _unit(rng, 5, d)])
    for nq in (1, 6):
        scores, ids = search(_stored(emb, storage), q[:nq], 5)
        assert ids[0].tolist() == [0, 5, 10, 15, 20]
    centre = _unit(rng, 1, d)[0]
    emb = _unit(rng, 3000, d)
    emb[::3] = centre + 0.01 * rng.standard_normal((1000, d))   # a third within ~0.01 of each other
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb[1500:1540] = emb[9]   # 41 identical rows
    rows = _stored(emb, storage)
    q = np.concatenate([np.asarray(rows[9:10], np.float32), centre[None], _unit(rng, 4, d)])
    for nq in (1, 6):
        for k in (1, 5, 50):
            scores, ids = search(rows, q[:nq], k)
            ref_s, ref_i = _reference(rows, q[:nq], k)
            np.testing.assert_array_equal(ids, ref_i)
            np.testing.assert_array_equal(scores, ref_s)
    assert ids[0, :41].tolist() == [9] + list(range(1500, 1540))
    scores, ids = search(_stored(np.zeros((0, d), np.float32), storage), q, 5)   # an empty index
    assert scores.shape == ids.shape == (6, 0)
