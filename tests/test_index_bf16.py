"""bfloat16 row storage (clip-mini index --dtype bfloat16): encoding, exact search kernels, the index format,
incremental builds, conversions between storage dtypes, faiss and the server's float32 copy."""
import json

import numpy as np
import pytest
import torch

from clip_mini.retrieval import search as S
from clip_mini.retrieval.search import bounds, exact_torch
from clip_mini.retrieval.files import scan_images
from clip_mini.retrieval.index import EmbeddingIndex, EmbeddingIndexError
from clip_mini.retrieval.rows import BF16Rows, bf16_bits_to_f32, encode, f32_to_bf16_bits

from conftest import write_images
from test_index import _build, embedder  # noqa: F401 (fixture)


def _unit(n, d, seed):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_bf16_bits_round_to_nearest_even_like_torch():
    x = np.concatenate([_unit(500, 64, 0).ravel(), np.float32([0.0, -0.0, 1.0, -1.0, 1e-30, 3.0e38])])
    # halfway cases: the low 16 bits exactly 0x8000, with an even and an odd kept bit
    halfway = np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32)
    x = np.concatenate([x, halfway])
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(f32_to_bf16_bits(x), want)
    np.testing.assert_array_equal(bf16_bits_to_f32(want), torch.from_numpy(want.view(np.int16))
                                  .view(torch.bfloat16).float().numpy())


def test_bf16rows_reads_as_float32():
    rows = _unit(20, 16, 1)
    view = BF16Rows(encode(rows, "bfloat16"))
    assert view.shape == (20, 16) and len(view) == 20
    assert view[3:5].dtype == np.float32 and view[[1, 7]].shape == (2, 16)
    np.testing.assert_allclose(np.asarray(view), rows, atol=4e-3)
    with pytest.raises(ValueError, match="uint16"):
        BF16Rows(rows)


def _stored_brute_force(view: BF16Rows, q: np.ndarray, k: int):
    s = np.asarray(view, np.float64) @ q.astype(np.float64).T          # (N, Q) over the stored values
    out_s, out_i = [], []
    for j in range(q.shape[0]):
        order = np.lexsort((np.arange(len(s)), -s[:, j].astype(np.float32)))[:k]
        out_s.append(s[order, j].astype(np.float32))
        out_i.append(order)
    return np.array(out_s), np.array(out_i)


@pytest.mark.parametrize("kernel", ["numpy", "torch"])
@pytest.mark.parametrize("nq", [1, 9], ids=["mv", "mm"])
def test_exact_search_over_bf16_rows_is_exact_for_the_stored_values(kernel, nq):
    rows = _unit(40_000, 64, 2)
    rows[1000] = rows[20_000] = rows[39_999] = rows[5]   # ties: equal stored rows, ordered by row id
    view = BF16Rows(encode(rows, "bfloat16"))
    q = _unit(nq, 64, 3)
    q[0] = rows[5]
    scores, ids = S.exact_search(view, q, k=10, kernel=kernel)
    want_s, want_i = _stored_brute_force(view, q, 10)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_allclose(scores, want_s, atol=1e-6)
    assert list(ids[0, :4]) == [5, 1000, 20_000, 39_999]


def test_bf16_margin_bounds_torch_approximate_scores():
    # the torch kernel's short list is safe only if its bf16 products stay within half its margin of exact
    # (the proven bound: query and result rounded to bf16, about 2 * 2^-8)
    rows = _unit(20_000, 256, 4)
    bits = encode(rows, "bfloat16")
    E = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    q = _unit(8, 256, 5)
    exact = bf16_bits_to_f32(bits).astype(np.float64) @ q.astype(np.float64).T
    qb = torch.from_numpy(q).bfloat16()
    mv = torch.stack([torch.mv(E, qb[j]) for j in range(8)]).float().numpy().T
    mm = (qb @ E.T).float().numpy().T
    mm_t = (E @ qb.T).float().numpy()   # rows by queries, as the many-queries pass computes it
    for approx in (mv, mm, mm_t):
        assert np.abs(approx - exact).max() < bounds.margin(bounds.BF16_U, 2, 256) / 2
    # float16 rows: converted to bf16 by torch (row, query and result rounded), or, where the CPU has native bf16,
    # float32 chunks rounded by oneDNN inside the product (row and query; the result stays float32)
    half = rows.astype(np.float16)
    exact = half.astype(np.float64) @ q.astype(np.float64).T
    converted = (torch.from_numpy(half).float().bfloat16() @ qb.T).float().numpy()
    assert np.abs(converted - exact).max() < bounds.margin(bounds.BF16_U, 3, 256) / 2
    if exact_torch._implicit_bf16(torch):
        with exact_torch._matmul_precision(torch, "bf16"):
            implicit = (torch.from_numpy(half).float() @ torch.from_numpy(q).T).numpy()
        # oneDNN may round the operands to bf16 (AMX) or keep float32 (an EPYC without AMX does): either is in bounds
        assert np.abs(implicit - exact).max() < bounds.margin(bounds.BF16_U, 2, 256) / 2


def test_bf16_index_format_search_and_conversions(tmp_path, embedder, image_folder):
    fp16 = _build(tmp_path / "fp16", embedder, image_folder)
    bf16 = _build(tmp_path / "bf16", embedder, image_folder, dtype="bfloat16")
    manifest = json.loads((tmp_path / "bf16" / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["format_version"] == 4
    assert np.load(tmp_path / "bf16" / manifest["files"]["embeddings"]).dtype == np.uint16
    assert json.loads((tmp_path / "fp16" / "manifest.json").read_text())["format_version"] == 4
    loaded = EmbeddingIndex.load(tmp_path / "bf16")
    assert isinstance(loaded.embeddings, BF16Rows)
    np.testing.assert_allclose(np.asarray(loaded.embeddings), np.asarray(fp16.embeddings, np.float32), atol=4e-3)
    q = embedder.encode_image([loaded.items["path"][5]])
    scores, ids = loaded.search(q, k=3)
    assert ids[0, 0] == 5 and scores[0, 0] == pytest.approx(1.0, abs=8e-3)

    # adding keeps bfloat16; asking for float16 rewrites every row, and back again
    write_images(image_folder / "more", 2, seed=7, prefix="more")
    added = EmbeddingIndex.load(tmp_path / "bf16").add(embedder, scan_images(image_folder / "more"),
                                                       progress=False)
    assert isinstance(added.embeddings, BF16Rows) and len(added) == 14
    np.testing.assert_array_equal(added.embeddings.bits[:5], loaded.embeddings.bits[:5])   # old rows bit for bit
    as16 = _build(tmp_path / "bf16", embedder, image_folder, dtype="float16")
    assert as16.embeddings.dtype == np.float16 and as16.manifest["dtype"] == "float16"
    np.testing.assert_allclose(np.asarray(as16.embeddings, np.float32), np.asarray(added.embeddings), atol=1e-3)
    back = _build(tmp_path / "bf16", embedder, image_folder, dtype="bfloat16")
    np.testing.assert_array_equal(back.embeddings.bits, added.embeddings.bits)   # bf16 -> fp16 -> bf16 is lossless
    with pytest.raises(EmbeddingIndexError, match="--dtype"):
        _build(tmp_path / "bf16", embedder, image_folder, dtype="int8")


def test_bf16_index_with_a_lying_manifest_is_refused(tmp_path, embedder, image_folder):
    _build(tmp_path / "idx", embedder, image_folder)
    m = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    m["dtype"] = "bfloat16"
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EmbeddingIndexError, match="manifest_sha256"):   # a hand edit is caught first
        EmbeddingIndex.load(tmp_path / "idx", verify=False)
    from clip_mini.retrieval.format import _manifest_digest

    m.pop("manifest_sha256")
    m["manifest_sha256"] = _manifest_digest(m)   # a consistent manifest that still lies about the rows
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EmbeddingIndexError, match=r"embeddings-\d+\.npy holds float16"):
        EmbeddingIndex.load(tmp_path / "idx", verify=False)


def test_bf16_merge_faiss_and_server_copy(tmp_path, embedder, image_folder):
    for i in range(2):
        _build(tmp_path / "idx", embedder, image_folder, shard=(i, 2), dtype="bfloat16")
    merged = EmbeddingIndex.merge(tmp_path / "idx", progress=False)
    assert isinstance(merged.embeddings, BF16Rows) and len(merged) == 12
    one = _build(tmp_path / "one", embedder, image_folder, dtype="bfloat16")
    np.testing.assert_allclose(np.asarray(merged.embeddings), np.asarray(one.embeddings), atol=8e-3)

    from clip_mini.serve.generations import _search_rows32

    rows32 = np.asarray(one.embeddings, dtype=np.float32)
    q = rows32[:3] / np.linalg.norm(rows32[:3], axis=1, keepdims=True)
    s_r, i_r = _search_rows32(rows32, q, 4)
    s_e, i_e = one.search(q, k=4, backend="exact")
    np.testing.assert_array_equal(i_r, i_e)
    np.testing.assert_allclose(s_r, s_e, atol=1e-5)

    pytest.importorskip("faiss")
    hnsw = _build(tmp_path / "f", embedder, image_folder, dtype="bfloat16", faiss="hnsw")
    s_f, i_f = EmbeddingIndex.load(tmp_path / "f").search(q, k=4, backend="faiss")
    np.testing.assert_array_equal(i_f[:, 0], i_e[:, 0])
    assert hnsw.manifest["dtype"] == "bfloat16"


def test_cli_index_dtype_and_search(tmp_path, model_dir, image_folder, capsys):
    from clip_mini.cli.main import main

    out = tmp_path / "idx"
    assert main(["index", "--model", str(model_dir), "--images", str(image_folder), "--out", str(out),
                 "--dtype", "bfloat16", "--quiet"]) == 0
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bfloat16"
    capsys.readouterr()
    assert main(["search", "--index", str(out), "red", "-k", "3", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 3 and results[0]["score"] >= results[2]["score"]
    # re-indexing without --dtype keeps bfloat16
    assert main(["index", "--model", str(model_dir), "--images", str(image_folder), "--out", str(out),
                 "--quiet"]) == 0
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("n,k", [(50_000, 50), (300, 10), (20_000, 1)])
def test_torch_bf16_many_queries_match_brute_force_on_clustered_rows(n, k):
    # tight clusters: many rows within the bf16 margin of each other, the case the running floor must not cut
    rng = np.random.default_rng(n)
    centres = _unit(20, 64, 6)
    rows = centres[rng.integers(0, 20, n)] + 0.02 * rng.standard_normal((n, 64)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    view = BF16Rows(encode(rows, "bfloat16"))
    q = centres[:12] + 0.01 * rng.standard_normal((12, 64)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    scores, ids = S.exact_search(view, q, k=k, kernel="torch")
    want_s, want_i = _stored_brute_force(view, q, k)
    np.testing.assert_allclose(scores, want_s, atol=1e-6)
    np.testing.assert_array_equal(ids, want_i)
