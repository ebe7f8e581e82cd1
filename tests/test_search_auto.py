"""`index --faiss ... --recall-target`: the faiss search parameter is tuned, stored in the manifest and used by
search; bad search input (wrong dimension, empty query, damaged faiss or ONNX file, another model's index) is a
clear error naming the file, exit status 2, and nothing in the index or model directory changes."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clip_mini.cli.main import main
from clip_mini.fileio.atomic import sha256_file
from clip_mini.retrieval import faiss_auto as FA
from clip_mini.retrieval.search import build_faiss, faiss_available

from conftest import write_images

pytestmark = pytest.mark.skipif(not faiss_available(), reason="faiss not installed")


def _clustered(n: int, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((50, d)).astype(np.float32)
    x = centres[rng.integers(0, 50, n)] + 0.7 * rng.standard_normal((n, d)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def test_proxy_queries_sit_at_the_stated_cosine():
    emb = _clustered(500)
    q = FA.proxy_queries(emb, 50, cosine=0.5)
    assert np.allclose(np.linalg.norm(q, axis=1), 1, atol=1e-5)
    best = (q @ emb.astype(np.float32).T).max(1)
    assert (best >= 0.5 - 1e-3).all()   # at least the row each was made from


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_tune_reaches_the_target_with_the_smallest_step(kind):
    emb = _clustered(4000)
    index = build_faiss(emb, kind)
    params = FA.tune(index, kind, emb, recall_target=0.9)
    name = "efSearch" if kind == "hnsw" else "nprobe"
    assert params["reached"] and params["recall_at_10"] >= 0.9 and FA.get_param(index, kind) == params[name]
    smaller = [s for s in FA.STEPS[kind] if s < params[name]]
    if smaller:   # the step below missed the target (else tune would have stopped there)
        FA.set_param(index, kind, smaller[-1])
        from clip_mini.retrieval.search import exact_search, faiss_search

        q = FA.proxy_queries(emb)
        recall = FA.recall_at(faiss_search(index, q, 10)[1], exact_search(emb, q, 10)[1])
        assert recall < 0.9
    with pytest.raises(ValueError, match="recall target"):
        FA.tune(index, kind, emb, recall_target=1.5)


@pytest.fixture(scope="module")
def tuned_index(model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_images(folder, 12)
    out = folder.parent / (folder.name + "-index")
    assert main(["index", "--model", str(model_dir), "--images", str(folder), "--out", str(out), "--faiss", "ivf",
                 "--recall-target", "0.99", "--quiet"]) == 0
    return out


def test_tuned_parameter_is_stored_and_used(tuned_index, capsys):
    from clip_mini import EmbeddingIndex

    manifest = json.loads((tuned_index / "manifest.json").read_text())
    params = manifest["faiss_params"]
    assert manifest["faiss_kind"] == "ivf" and params["recall_target"] == 0.99 and params["reached"]
    index = EmbeddingIndex.load(tuned_index)
    assert index.faiss_index().nprobe == params["nprobe"]
    assert main(["search", "--index", str(tuned_index), "a red circle", "--backend", "faiss", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 10


def _snapshot(*folders: Path) -> dict:
    return {p: sha256_file(p) for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


def test_bad_recall_target_exit_2(model_dir, tmp_path, capsys):
    write_images(tmp_path / "p", 3)
    assert main(["index", "--model", str(model_dir), "--images", str(tmp_path / "p"), "--out", str(tmp_path / "i"),
                 "--recall-target", "1.5", "--quiet"]) == 2
    assert "--recall-target must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "i").exists()


def test_bad_search_input_exit_2_and_nothing_written(tuned_index, model_dir, other_model_dir, tmp_path, capsys):
    from clip_mini import EmbeddingIndex
    from clip_mini.retrieval.format import EmbeddingIndexError

    index_dir = shutil.copytree(tuned_index, tmp_path / "index")
    before = _snapshot(index_dir, model_dir)

    def fails(args, *needles):
        assert main(["search", "--index", str(index_dir), *args]) == 2
        err = capsys.readouterr().err
        for needle in needles:
            assert needle in err, err

    fails(["   "], "the text query is empty")
    fails(["a dog", "--model", str(other_model_dir)], "was built with model", "not comparable")
    # A faiss file damaged after the manifest was written: named, whether the checksum or faiss itself notices.
    faiss_file = index_dir / json.loads((index_dir / "manifest.json").read_text())["files"]["faiss"]
    good = faiss_file.read_bytes()
    faiss_file.write_bytes(good[: len(good) // 2])
    fails(["a dog", "--backend", "faiss"], str(faiss_file), "corrupt")
    index = EmbeddingIndex.load(index_dir)
    manifest = index.manifest
    manifest["checksums"][faiss_file.name] = sha256_file(faiss_file)   # as if the manifest agreed with it
    index._faiss = None
    with pytest.raises(EmbeddingIndexError, match=r"is not a readable faiss index"):
        index.search(np.ones(index.dim, np.float32), 5, backend="faiss")
    faiss_file.write_bytes(good)
    with pytest.raises(EmbeddingIndexError, match=r"queries must be \(n, 32\)"):
        EmbeddingIndex.load(index_dir).search(np.ones(31, np.float32), 5)
    # The ONNX copy of the model damaged: the search names the file and leaves it as it is.
    onnx = model_dir / "onnx" / "text.onnx"
    good_onnx = onnx.read_bytes()
    onnx.write_bytes(good_onnx[:-100])
    before[onnx] = sha256_file(onnx)
    try:
        fails(["a dog"], str(onnx), "is corrupt")
        assert _snapshot(index_dir, model_dir) == before
    finally:
        onnx.write_bytes(good_onnx)
