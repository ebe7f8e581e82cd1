"""The "nothing matches" cut-off: calibrated on a model's val split (clip_mini.eval.cutoff), saved with the model,
applied by search (clip_mini.retrieval.cutoff; clip-mini search --cutoff / --min-score)."""
import json
from pathlib import Path

import numpy as np
import pytest

from clip_mini.errors import QueryError
from clip_mini.eval.cutoff import calibrate, true_and_removed
from clip_mini.retrieval.cutoff import check_cutoff, model_cutoff, resolve_min_score


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_true_scores_ranks_and_the_best_other_image():
    sim = np.array([[0.9, 0.5, 0.1], [0.4, 0.4, 0.8], [0.2, 0.7, 0.7]])
    true, rank, removed = true_and_removed(sim, np.array([0, 1, 2]))
    assert true.tolist() == [0.9, 0.4, 0.7]
    assert rank.tolist() == [0, 2, 1]          # ties count against the query
    assert removed.tolist() == [0.5, 0.8, 0.7]


def test_calibration_keeps_the_asked_share_of_top_k_hits():
    rng = np.random.default_rng(0)
    img = _unit(rng.normal(size=(200, 16))).astype(np.float32)
    ids = np.repeat(np.arange(200), 3)
    txt = _unit(img[ids] + rng.normal(scale=0.35, size=(600, 16))).astype(np.float32)   # captions near their image
    out = calibrate(img, txt, ids)
    assert out["cutoff_kept"] >= 0.9
    true, rank, removed = true_and_removed(txt @ img.T, ids)
    top = true[rank < 5]
    assert np.isclose(out["cutoff_kept"], (top >= out["cutoff_cosine"]).mean())
    assert np.isclose(out["cutoff_empty"], (removed < out["cutoff_cosine"]).mean())
    assert (top >= out["cutoff_cosine"]).mean() - 0.9 < 0.01        # not more than needed: the lowest that keeps 90%
    looser = calibrate(img, txt, ids, keep=0.5)
    assert looser["cutoff_cosine"] > out["cutoff_cosine"] and looser["cutoff_empty"] >= out["cutoff_empty"]


def test_the_model_cut_off_comes_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"trained": {"val": {"cutoff_cosine": 0.31}}}))
    assert model_cutoff(tmp_path) == 0.31
    assert resolve_min_score("auto", None, tmp_path) == 0.31
    assert resolve_min_score("auto", 0.5, tmp_path) == 0.5           # a score of your own wins
    assert resolve_min_score("none", None, tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"trained": {"val": {}}}))
    assert resolve_min_score("auto", None, tmp_path) is None          # an uncalibrated model: no cut-off
    assert model_cutoff(tmp_path / "missing") is None
    with pytest.raises(QueryError, match="min_score"):
        check_cutoff("0.3")


# -- on a trained model: the shapes data ----------------------------------------------------------------------
def _objects(shapes_dir):
    import csv

    with open(shapes_dir / "labels.csv", newline="") as f:
        return {r["image"]: {(r["colour"], r["shape"]), (r["colour2"], r["shape2"])} for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def calibrated(trained_model_dir, shapes_splits, tmp_path_factory):
    """The trained tiny model with its cut-off calibrated on the shapes val split, as the trainer saves it."""
    from clip_mini.data import build_eval_transform
    from clip_mini.eval.validation import evaluate_model
    from clip_mini.model.clip import CLIPModel

    model = CLIPModel.from_pretrained(trained_model_dir)
    val = evaluate_model(model, shapes_splits["val"], build_eval_transform(model.preprocess))
    assert {"cutoff_cosine", "cutoff_kept", "cutoff_empty"} <= set(val)
    out = tmp_path_factory.mktemp("models") / "calibrated"
    model.save_pretrained(out, extra={"trained": {"val": val}})
    return out, val


@pytest.fixture(scope="module")
def two_indexes(calibrated, heldout_images, shapes_dir, tmp_path_factory):
    """The held-out shapes indexed twice: every image, and every image without a red object."""
    import shutil

    from clip_mini.cli.main import main

    objects = _objects(shapes_dir)
    no_red = tmp_path_factory.mktemp("nored") / "images"
    no_red.mkdir()
    for p in heldout_images.iterdir():
        if not any(c == "red" for c, _ in objects[p.name]):
            shutil.copy2(p, no_red / p.name)
    out = {}
    for name, folder in (("all", heldout_images), ("no_red", no_red)):
        out[name] = tmp_path_factory.mktemp("indexes") / name
        assert main(["index", "--model", str(calibrated[0]), "--images", str(folder), "--out", str(out[name]),
                     "--quiet"]) == 0
    return out, objects


def _search(index, query, capsys, *more):
    from clip_mini.cli.main import main

    capsys.readouterr()
    code = main(["search", "--index", str(index), query, "-k", "16", "--json", *more])
    out, err = capsys.readouterr()
    return code, json.loads(out)["results"] if out else [], err


@pytest.mark.slow
def test_the_default_cut_off_says_no_good_match_when_no_photo_has_the_colour(calibrated, two_indexes, capsys):
    indexes, objects = two_indexes
    with capsys.disabled():
        print(f"calibrated on val: {({k: round(v, 3) for k, v in calibrated[1].items() if k.startswith('cutoff')})}")
    code, hits, err = _search(indexes["all"], "a large red circle", capsys)
    reds = [any(c == "red" for c, _ in objects[Path(h["path"]).name]) for h in hits]
    assert code == 0 and len(hits) >= 8 and all(reds)           # what passes is red
    code, hits, err = _search(indexes["no_red"], "a large red circle", capsys)
    assert code == 1 and hits == [] and "no good match" in err and "--cutoff none" in err
    code, hits, _ = _search(indexes["no_red"], "a large red circle", capsys, "--cutoff", "none")
    assert code == 0 and len(hits) == 16                  # asked to, it lists the nearest anyway
    code, hits, _ = _search(indexes["no_red"], "a large red circle", capsys, "--min-score=-1")
    assert code == 0 and len(hits) == 16                  # every cosine is >= -1
    # the Python API: the same cut-off, on request
    from clip_mini import EmbeddingIndex

    [api] = EmbeddingIndex.load(indexes["no_red"]).hits(texts=["a large red circle"], k=16, cutoff="auto")
    assert api == [] and api.below == 16 and api.min_score == pytest.approx(calibrated[1]["cutoff_cosine"])


def test_a_bad_cut_off_is_refused_before_the_index_opens(tmp_path, capsys):
    from clip_mini.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["search", "--index", str(tmp_path / "nope"), "a dog", "--cutoff", "maybe"])
    assert stop.value.code == 2 and "--cutoff" in capsys.readouterr().err


# -- clip-mini serve: the same cut-off in the API ----------------------------------------------------------------
def test_the_server_applies_the_model_cut_off_and_says_what_fell_below(model_dir, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from conftest import write_images

    from clip_mini.model.clip import CLIPModel
    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.serve.app import ServeConfig, create_app

    strict = tmp_path / "strict"   # a model whose calibrated cut-off no cosine reaches
    CLIPModel.from_pretrained(model_dir).save_pretrained(strict, extra={"trained": {"val": {"cutoff_cosine": 1.5}}})
    images = write_images(tmp_path / "photos", 6, seed=2)
    EmbeddingIndex.build(tmp_path / "index", strict, images, progress=False)
    cfg = ServeConfig(index=str(tmp_path / "index"), allowed_hosts=["testserver"])
    with TestClient(create_app(cfg)) as client:
        answer = client.get("/api/search", params={"q": "a red circle", "k": 4}).json()
        assert answer["results"] == [] and answer["below"] == 4 and answer["min_score"] == 1.5
        assert answer["best_below"] <= 1.0
        answer = client.get("/api/search", params={"q": "a red circle", "k": 4, "cutoff": "none"}).json()
        assert len(answer["results"]) == 4 and answer["below"] == 0 and answer["min_score"] is None
        answer = client.get("/api/search", params={"q": "a red circle", "k": 4, "min_score": -1}).json()
        assert len(answer["results"]) == 4 and answer["min_score"] == -1
        bad = client.get("/api/search", params={"q": "a red circle", "cutoff": "sometimes"})
        assert bad.status_code == 400 and "cut-off" in bad.json()["error"]
