"""EmbeddingIndex mechanics with an untrained tiny model: format, incremental and resumed builds, shards,
deduplication, bad files, corruption and model-mismatch detection, writer lock."""
import json
import shutil

import numpy as np
import pytest

import clip_mini
from clip_mini.retrieval.index import EmbeddingIndex, EmbeddingIndexError
from clip_mini.retrieval.format import writer_lock
from clip_mini.retrieval.files import scan_images
from clip_mini.retrieval.build import _Work, work_key
from clip_mini.retrieval.shards import merge_indexes

from conftest import write_images


@pytest.fixture(scope="module")
def embedder(model_dir):
    return clip_mini.load(model_dir)


def _build(path, embedder, folder, **kw):
    kw.setdefault("progress", False)
    return EmbeddingIndex.build(path, embedder, scan_images(folder), **kw)


def _assert_same_index(a: EmbeddingIndex, b: EmbeddingIndex):
    assert a.items["path"] == b.items["path"]
    assert a.items["sha256"] == b.items["sha256"]
    assert len(set(a.items["path"])) == len(a)   # no duplicates
    # Rows are embedded in different batches in the two runs; fp16 storage hides most, not all, of the noise.
    np.testing.assert_allclose(np.asarray(a.embeddings, np.float32), np.asarray(b.embeddings, np.float32),
                               atol=2e-3)


class _CountingEmbedder:
    """Wraps an Embedder, counting the images whose tower features reach the image head (every indexing path,
    the bf16 tower copy included, ends in ``project_image``)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, 0
        model = inner.model
        self._orig = model.project_image

        def project_image(features, *a, **k):
            self.seen += len(features)
            return self._orig(features, *a, **k)

        model.project_image = project_image

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def restore(self):
        del self.inner.model.project_image


def test_build_load_search_roundtrip(tmp_path, embedder, image_folder):
    index = _build(tmp_path / "idx", embedder, image_folder)
    assert len(index) == 12 and index.dim == embedder.dim
    loaded = EmbeddingIndex.load(tmp_path / "idx")
    assert loaded.embeddings.dtype == np.float16
    norms = np.linalg.norm(np.asarray(loaded.embeddings, np.float32), axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=2e-3)
    assert loaded.items["path"] == sorted(loaded.items["path"])
    q = embedder.encode_image([loaded.items["path"][5]])
    scores, ids = loaded.search(q, k=3)
    assert ids[0, 0] == 5 and scores[0, 0] == pytest.approx(1.0, abs=2e-3)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["model_fingerprint"] == embedder.fingerprint and manifest["count"] == 12


def test_rebuild_without_changes_is_a_no_op(tmp_path, embedder, image_folder):
    first = _build(tmp_path / "idx", embedder, image_folder)
    counting = _CountingEmbedder(embedder)
    try:
        again = _build(tmp_path / "idx", counting, image_folder)
    finally:
        counting.restore()
    assert counting.seen == 0
    assert again.manifest["generation"] == first.manifest["generation"]


def test_incremental_equals_one_pass(tmp_path, embedder, image_folder):
    _build(tmp_path / "inc", embedder, image_folder)
    (image_folder / "img000.png").unlink()                                  # deleted
    write_images(image_folder, 1, seed=9, prefix="img001")                  # img001000.png: new
    write_images(image_folder / "tmp", 1, seed=7, prefix="x")
    shutil.move(image_folder / "tmp" / "x000.png", image_folder / "img002.png")   # changed content
    shutil.rmtree(image_folder / "tmp")
    counting = _CountingEmbedder(embedder)
    try:
        inc = _build(tmp_path / "inc", counting, image_folder)
    finally:
        counting.restore()
    assert counting.seen == 2   # only the new and the changed file
    one = _build(tmp_path / "one", embedder, image_folder)
    _assert_same_index(inc, one)
    assert str(image_folder / "img000.png") not in inc.items["path"]
    assert inc.manifest["generation"] == 2


def test_add_keeps_rows_and_skips_known_content(tmp_path, embedder, image_folder):
    files = scan_images(image_folder)
    index = EmbeddingIndex.build(tmp_path / "idx", embedder, files[:6], progress=False)
    counting = _CountingEmbedder(embedder)
    try:
        index = index.add(counting, files[4:], progress=False)
    finally:
        counting.restore()
    assert counting.seen == 6 and len(index) == 12


def test_identical_files_embedded_once(tmp_path, embedder, image_folder):
    src = image_folder / "img003.png"
    for i in range(3):
        shutil.copy(src, image_folder / f"copy{i}.png")
    counting = _CountingEmbedder(embedder)
    try:
        index = _build(tmp_path / "idx", counting, image_folder)
    finally:
        counting.restore()
    assert len(index) == 15 and counting.seen == 12
    rows = [i for i, p in enumerate(index.items["path"]) if "copy" in p or p.endswith("img003.png")]
    emb = np.asarray(index.embeddings)
    assert all((emb[r] == emb[rows[0]]).all() for r in rows)


def test_resume_after_interruption_equals_one_pass(tmp_path, embedder, image_folder, monkeypatch):
    calls = {"n": 0}
    append = _Work.append

    def failing_append(self, *a, **k):
        calls["n"] += 1
        append(self, *a, **k)
        if calls["n"] == 2:
            raise KeyboardInterrupt   # as if killed right after the second chunk was saved

    monkeypatch.setattr(_Work, "append", failing_append)
    with pytest.raises(KeyboardInterrupt):
        _build(tmp_path / "idx", embedder, image_folder, batch_size=2, flush_every=4)
    monkeypatch.setattr(_Work, "append", append)
    assert not (tmp_path / "idx" / "manifest.json").exists()
    counting = _CountingEmbedder(embedder)
    try:
        resumed = _build(tmp_path / "idx", counting, image_folder, batch_size=2, flush_every=4)
    finally:
        counting.restore()
    assert counting.seen == 12 - 8   # two chunks of 4 were kept
    assert not (tmp_path / "idx" / ".work").exists()
    _assert_same_index(resumed, _build(tmp_path / "one", embedder, image_folder))


def test_bad_images_skipped_with_report(tmp_path, embedder, image_folder):
    (image_folder / "empty.png").write_bytes(b"")
    (image_folder / "text.jpg").write_text("not an image")
    good = (image_folder / "img001.png").read_bytes()
    (image_folder / "cut.png").write_bytes(good[: len(good) // 2])
    index = _build(tmp_path / "idx", embedder, image_folder)
    assert len(index) == 12
    report = (tmp_path / "idx" / "skipped.csv").read_text()
    for name in ("empty.png", "text.jpg", "cut.png"):
        assert name in report
    assert "empty file" in report


def test_fingerprint_mismatch_refused(tmp_path, embedder, other_model_dir, image_folder):
    index = _build(tmp_path / "idx", embedder, image_folder)
    other = clip_mini.load(other_model_dir)
    assert other.fingerprint != embedder.fingerprint
    with pytest.raises(EmbeddingIndexError, match="built with model"):
        _build(tmp_path / "idx", other, image_folder)
    with pytest.raises(EmbeddingIndexError, match="not comparable"):
        index.check_model(other.fingerprint)


def test_corrupt_manifest_detected(tmp_path, embedder, image_folder):
    _build(tmp_path / "idx", embedder, image_folder)
    mpath = tmp_path / "idx" / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["count"] = 11
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(EmbeddingIndexError, match="manifest.json is corrupt"):
        EmbeddingIndex.load(tmp_path / "idx")
    mpath.write_text("{ truncated")
    with pytest.raises(EmbeddingIndexError, match="not valid JSON"):
        EmbeddingIndex.load(tmp_path / "idx")


def test_corrupt_embeddings_detected(tmp_path, embedder, image_folder):
    index = _build(tmp_path / "idx", embedder, image_folder)
    emb = tmp_path / "idx" / index.manifest["files"]["embeddings"]
    data = bytearray(emb.read_bytes())
    data[-5] ^= 0xFF
    emb.write_bytes(bytes(data))
    with pytest.raises(EmbeddingIndexError, match="embeddings-1.npy is corrupt"):
        EmbeddingIndex.load(tmp_path / "idx")
    emb.write_bytes(bytes(data[:40]))   # header damaged too: caught even without checksums
    with pytest.raises(EmbeddingIndexError, match="corrupt"):
        EmbeddingIndex.load(tmp_path / "idx", verify=False)


def test_missing_index_and_empty_inputs(tmp_path, embedder):
    with pytest.raises(EmbeddingIndexError, match="does not exist"):
        EmbeddingIndex.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert scan_images(tmp_path / "empty") == []
    with pytest.raises(EmbeddingIndexError, match="no images to index"):
        EmbeddingIndex.build(tmp_path / "idx", embedder, [], progress=False)
    with pytest.raises(EmbeddingIndexError, match="image folder not found"):
        scan_images(tmp_path / "missing")


def test_search_argument_errors(tmp_path, embedder, image_folder):
    index = _build(tmp_path / "idx", embedder, image_folder)
    q = np.zeros(index.dim, np.float32)
    for k in (0, -1):
        with pytest.raises(EmbeddingIndexError, match="k must be a positive integer"):
            index.search(q, k=k)
    with pytest.raises(EmbeddingIndexError, match="unknown search backend"):
        index.search(q, backend="annoy")
    with pytest.raises(EmbeddingIndexError, match="queries must be"):
        index.search(np.zeros(index.dim + 1, np.float32))


def test_shards_merge_equals_one_pass(tmp_path, embedder, image_folder):
    for i in range(3):
        _build(tmp_path / "idx", embedder, image_folder, shard=(i, 3))
    with pytest.raises(EmbeddingIndexError, match="need every shard"):
        shutil.move(tmp_path / "idx" / "shards" / "2-of-3", tmp_path / "away")
        merge_indexes(tmp_path / "idx", progress=False)
    shutil.move(tmp_path / "away", tmp_path / "idx" / "shards" / "2-of-3")
    sizes = [len(EmbeddingIndex.load(tmp_path / "idx" / "shards" / f"{i}-of-3")) for i in range(3)]
    assert sum(sizes) == 12
    merged = EmbeddingIndex.merge(tmp_path / "idx", progress=False)
    _assert_same_index(merged, _build(tmp_path / "one", embedder, image_folder))


def test_second_writer_refused(tmp_path, embedder, image_folder):
    (tmp_path / "idx").mkdir()
    with writer_lock(tmp_path / "idx"):
        with pytest.raises(EmbeddingIndexError, match="being written by another process"):
            _build(tmp_path / "idx", embedder, image_folder)


def test_faiss_backend_stored_and_agrees(tmp_path, embedder, image_folder):
    pytest.importorskip("faiss")
    index = _build(tmp_path / "idx", embedder, image_folder, faiss="hnsw")
    assert "faiss" in index.manifest["files"]
    q = np.asarray(index.embeddings[:4], np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    s_e, i_e = index.search(q, k=5, backend="exact")
    s_f, i_f = EmbeddingIndex.load(tmp_path / "idx").search(q, k=5, backend="faiss")
    np.testing.assert_array_equal(i_e[:, 0], i_f[:, 0])
    np.testing.assert_allclose(s_e, s_f, atol=1e-4)


def test_convenience_api_from_model_dir_and_folder(tmp_path, model_dir, image_folder):
    index = EmbeddingIndex.build(tmp_path / "idx", model_dir, image_folder, progress=False)
    assert len(index) == 12 and index.manifest["model_dir"] == str(model_dir.resolve())
    hits = index.search_text("a red circle", k=3)
    assert len(hits) == 3 and all(isinstance(p, str) and isinstance(s, float) for p, s in hits)
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    path, score = index.search_image(index.items["path"][7], k=1)[0]
    assert path == index.items["path"][7] and score == pytest.approx(1.0, abs=2e-3)
    with pytest.raises(EmbeddingIndexError, match="no images found"):
        EmbeddingIndex.build(tmp_path / "idx2", model_dir, tmp_path / "idx")   # a folder without images


def test_an_embedder_that_names_its_device_as_a_string_indexes(tmp_path, embedder, image_folder):
    # A duck-typed embedder of the user's own may say device = "cpu"; the default decode workers read it
    # (the 100k-file benchmark's stub embedder does), which once failed with "'str' object has no attribute 'type'".
    class _StringDevice(_CountingEmbedder):
        device = "cpu"

    wrapped = _StringDevice(embedder)
    try:
        index = _build(tmp_path / "idx", wrapped, image_folder)
    finally:
        wrapped.restore()
    assert len(index) == 12 and wrapped.seen >= 12


def test_flip_average_rows_are_recorded_and_fixed_per_index(tmp_path, embedder, image_folder):
    import torch

    from clip_mini.data import load_image
    from clip_mini.model.clip import ImageForward

    index = _build(tmp_path / "idx", embedder, image_folder, flip_average=True)
    assert index.flip_average and index.manifest["flip_average"] is True
    pixels = torch.stack([embedder.transform(load_image(p)) for p in index.items["path"]])
    want = ImageForward(embedder.model, "fp32", "cpu", flip_average=True)(pixels).numpy()
    rows = np.asarray(index.embeddings, np.float32)
    np.testing.assert_allclose(rows, want, atol=2e-3)   # fp16 storage
    plain = _build(tmp_path / "plain", embedder, image_folder)
    assert plain.manifest["flip_average"] is False
    assert np.abs(np.asarray(plain.embeddings, np.float32) - rows).max() > 1e-2
    # the same setting again: nothing is embedded, no new generation
    counting = _CountingEmbedder(embedder)
    try:
        again = _build(tmp_path / "idx", counting, image_folder, flip_average=True)
    finally:
        counting.restore()
    assert counting.seen == 0 and again.manifest["generation"] == index.manifest["generation"]
    # the other setting is refused, as another model is: the rows would mix two kinds
    with pytest.raises(EmbeddingIndexError, match="built with flip averaging.*--flip-average"):
        _build(tmp_path / "idx", embedder, image_folder)
    with pytest.raises(EmbeddingIndexError, match="built without flip averaging"):
        _build(tmp_path / "plain", embedder, image_folder, flip_average=True)
    np.testing.assert_array_equal(np.asarray(EmbeddingIndex.load(tmp_path / "idx").embeddings, np.float32), rows)
    # an index from before the option records nothing: plain rows
    del plain.manifest["flip_average"]
    assert plain.flip_average is False
    plain.check_flip_average(False)


def test_flip_average_keys_unfinished_work_and_merges_and_image_queries(tmp_path, embedder, image_folder):
    work = _Work(tmp_path / "w", work_key(embedder.fingerprint, True))
    work.append(["h"], np.ones((1, embedder.dim), np.float32), {})
    assert "h" in _Work(tmp_path / "w", work_key(embedder.fingerprint, True)).rows   # resumed
    assert not _Work(tmp_path / "w", work_key(embedder.fingerprint, False)).rows      # another kind: dropped
    for i in range(2):
        _build(tmp_path / "idx", embedder, image_folder, shard=(i, 2), flip_average=True)
    merged = merge_indexes(tmp_path / "idx", progress=False)
    assert merged.flip_average
    _build(tmp_path / "mixed", embedder, image_folder, shard=(0, 2), flip_average=True)
    _build(tmp_path / "mixed", embedder, image_folder, shard=(1, 2))
    with pytest.raises(EmbeddingIndexError, match="flip averaging"):
        merge_indexes(tmp_path / "mixed", progress=False)
    # an image query on a flip-averaged index is flip-averaged too: a file finds its own row at cosine ~1
    index = EmbeddingIndex.load(tmp_path / "idx")
    path = index.items["path"][3]
    assert index.engine().flip_average
    (hits,) = index.hits(images=[path], k=1)
    assert hits[0]["path"] == path and hits[0]["score"] == pytest.approx(1.0, abs=2e-3)
