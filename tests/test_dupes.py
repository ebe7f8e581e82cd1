"""clip-mini dupes: planted copies of shapes images are grouped with their originals, from the index alone.

The session's tiny trained model tells colours apart far better than shapes (two different-shape images of one
colour can score 0.99), so the originals here differ in colour: one single-object image per colour. Its planted
copies score >= 0.96 with their originals and different colours <= 0.9, hence ``--threshold 0.95`` (the default
threshold belongs to photo models: ``benchmarks/studies/dupes_planted.py``).
"""
from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest

from benchmarks.lib.planted import pair_scores, plant_copies
from clip_mini.cli.main import main


THRESHOLD = "0.95"


def _distinct_originals(shapes_dir, n: int) -> list:
    """``n`` single-object images of different colours (see the module docstring)."""
    seen, out = set(), []
    with open(shapes_dir / "labels.csv", newline="") as f:
        for r in csv.DictReader(f):
            key = r["colour"]
            if r["split"] == "train" and key not in seen and r["n_objects"] == "1":
                seen.add(key)
                out.append(shapes_dir / "images" / r["image"])
            if len(out) == n:
                break
    return out


@pytest.fixture(scope="module")
def planted_index(shapes_dir, trained_model_dir, tmp_path_factory):
    from clip_mini.retrieval.index import EmbeddingIndex

    root = tmp_path_factory.mktemp("dupes")
    photos = root / "photos"
    photos.mkdir()
    originals = _distinct_originals(shapes_dir, 6)
    for p in originals:
        shutil.copy2(p, photos / p.name)
    planted = plant_copies([photos / p.name for p in originals[:4]], photos / "copies", copies_each=3)
    (photos / "broken.png").write_bytes(b"not a png")
    index = EmbeddingIndex.build(root / "index", str(trained_model_dir), photos, workers=0)
    return root / "index", planted, index


def test_dupes_finds_planted_copies(planted_index, tmp_path, capsys):
    index_dir, planted, index = planted_index
    assert "broken.png" not in " ".join(index.items["path"])   # the unreadable file was skipped at index time
    grid = tmp_path / "dupes.png"
    assert main(["dupes", "--index", str(index_dir), "--threshold", THRESHOLD, "--json", "--grid", str(grid),
                 "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    groups = [g["paths"] for g in out["groups"]]
    scores = pair_scores(groups, planted)
    assert scores["true_pairs"] == 4 * 6 and scores["recall"] == 1.0 and scores["precision"] == 1.0, scores
    assert all(0 < g["similarity"] <= 1 for g in out["groups"])
    assert [g["similarity"] for g in out["groups"]] == sorted((g["similarity"] for g in out["groups"]), reverse=True)
    from PIL import Image

    assert Image.open(grid).size[1] > 100


def test_dupes_faiss_range_search_matches_exact(planted_index):
    pytest.importorskip("faiss")
    from clip_mini.retrieval.dupes import find_duplicates

    _, _, index = planted_index
    rows = np.asarray(index.embeddings, np.float32)
    for threshold in (0.5, 0.95):
        exact = find_duplicates(rows, threshold, "exact")
        approx = find_duplicates(rows, threshold, "faiss")
        assert [g.rows for g in approx] == [g.rows for g in exact]
        assert np.allclose([g.similarity for g in approx], [g.similarity for g in exact], atol=1e-5)


def test_dupes_text_output_and_threshold_one(planted_index, capsys):
    index_dir, _, _ = planted_index
    assert main(["dupes", "--index", str(index_dir), "--threshold", "1", "-q"]) == 0
    assert capsys.readouterr().out == ""   # no two distinct images are identical
    assert main(["dupes", "--index", str(index_dir), "--threshold", THRESHOLD]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("group 1  similarity ") and "dupes: " in captured.err


@pytest.mark.parametrize("bad", ["1.5", "0", "-0.2", "nan", "high"])
def test_dupes_refuses_threshold_outside_0_1(planted_index, bad, capsys):
    index_dir, _, _ = planted_index
    with pytest.raises(SystemExit) as e:
        main(["dupes", "--index", str(index_dir), "--threshold", bad])
    assert e.value.code == 2
    assert "--threshold" in capsys.readouterr().err


def test_dupes_library_checks():
    from clip_mini.retrieval.dupes import EmbeddingIndexError, find_duplicates

    with pytest.raises(EmbeddingIndexError, match="threshold"):
        find_duplicates(np.eye(3, dtype=np.float32), 1.2)
    with pytest.raises(EmbeddingIndexError, match="backend"):
        find_duplicates(np.eye(3, dtype=np.float32), 0.9, "annoy")
    assert find_duplicates(np.eye(1, 3, dtype=np.float32), 0.9) == []
    x = np.eye(4, dtype=np.float16)
    x[3] = x[0]
    [g] = find_duplicates(x, 0.99)
    assert g.rows == [0, 3] and g.similarity == pytest.approx(1.0)


def test_dupes_missing_index(tmp_path, capsys):
    assert main(["dupes", "--index", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
