"""The "nothing matches" cut-off: calibrated on a model's val split (clip_mini.eval.cutoff), saved with the model,
applied by search (clip_mini.retrieval.cutoff; clip-mini search --cutoff / --min-score, EmbeddingIndex.hits and
clip-mini serve share one rule: nothing unless the best hit reaches one cosine, then the hits reaching another)."""
import json
from pathlib import Path

import numpy as np
import pytest

from clip_mini.errors import QueryError
from clip_mini.eval.cutoff import calibrate, fit_rule, score_rule, search_cases, true_and_removed
from clip_mini.retrieval.cutoff import Cutoff, check_cutoff, model_cutoff, resolve_cutoff, split_hits


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_true_scores_ranks_and_the_best_other_image():
    sim = np.array([[0.9, 0.5, 0.1], [0.4, 0.4, 0.8], [0.2, 0.7, 0.7]])
    true, rank, removed = true_and_removed(sim, np.array([0, 1, 2]))
    assert true.tolist() == [0.9, 0.4, 0.7]
    assert rank.tolist() == [0, 2, 1]          # ties count against the query
    assert removed.tolist() == [0.5, 0.8, 0.7]


def _synthetic(seed=0, noise=0.35):
    rng = np.random.default_rng(seed)
    img = _unit(rng.normal(size=(200, 16))).astype(np.float32)
    ids = np.repeat(np.arange(200), 3)
    txt = _unit(img[ids] + rng.normal(scale=noise, size=(600, 16))).astype(np.float32)   # captions near their image
    return img, txt, ids


def test_calibration_keeps_the_asked_share_of_top_k_cases_with_the_highest_best_hit_floor():
    img, txt, ids = _synthetic()
    out = calibrate(img, txt, ids)
    true, rank, removed = true_and_removed(txt @ img.T, ids)
    best, top = np.maximum(true, removed), rank < 5
    hit, floor = out["cutoff_cosine"], out["cutoff_best_cosine"]
    assert floor >= hit and (true[top] >= hit).mean() >= 0.98          # the per-hit floor keeps 98% of the photos
    listed = top & (best >= floor) & (true >= hit)
    assert out["cutoff_kept"] >= 0.9 and np.isclose(out["cutoff_kept"], listed.sum() / top.sum())
    assert np.isclose(out["cutoff_empty"], (removed < floor).mean())
    # the highest such floor: the next best score up loses a case, and with it the 90%
    higher = np.sort(best[top & (true >= hit)])
    higher = higher[higher > floor + 1e-6][0]
    assert (top & (best >= higher) & (true >= hit)).sum() / top.sum() < 0.9
    # the old one-cosine rule: every hit must reach the cosine that keeps 90%; the best-hit floor answers more of
    # the photo-removed searches with nothing at the same share kept
    old = calibrate(img, txt, ids, hit_keep=None)
    assert old["cutoff_cosine"] == old["cutoff_best_cosine"] and old["cutoff_kept"] >= 0.9
    assert np.isclose(old["cutoff_kept"], (true[top] >= old["cutoff_cosine"]).mean())
    assert (true[top] >= old["cutoff_cosine"]).mean() - 0.9 < 0.01    # not more than needed
    assert out["cutoff_empty"] > old["cutoff_empty"]
    looser = calibrate(img, txt, ids, keep=0.5)
    assert looser["cutoff_best_cosine"] > floor and looser["cutoff_empty"] >= out["cutoff_empty"]


def test_a_rule_fitted_on_one_half_scores_the_other_the_same_way():
    img, txt, ids = _synthetic(seed=1)
    cases = search_cases(img, txt, ids)
    half = ids % 2 == 0
    fitted = fit_rule(type(cases)(*(x[half] for x in cases)))
    scored = score_rule(type(cases)(*(x[half] for x in cases)), fitted["cutoff_cosine"], fitted["cutoff_best_cosine"])
    assert np.isclose(scored["kept"], fitted["cutoff_kept"]) and np.isclose(scored["empty_when_removed"],
                                                                           fitted["cutoff_empty"])
    other = score_rule(type(cases)(*(x[~half] for x in cases)), fitted["cutoff_cosine"], fitted["cutoff_best_cosine"])
    assert 0.8 < other["kept"] <= 1.0 and 0.0 <= other["empty_when_removed"] <= 1.0
    assert calibrate(img[:1], txt, np.zeros(len(txt), dtype=int)) == {}     # one image: nothing to calibrate


def test_the_rule_lists_nothing_unless_the_best_hit_reaches_its_floor():
    rule = Cutoff(hit=0.45, best=0.55)
    assert rule.split([0.60, 0.50, 0.40]) == [True, True, False]   # the best passes: hits down to 0.45
    assert rule.split([0.54, 0.53, 0.52]) == [False] * 3           # a flat run below 0.55: nothing
    assert rule.split([]) == [] and split_hits([0.1, 0.0], None) == [True, True]


def test_the_model_cut_off_comes_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"trained": {"val": {"cutoff_cosine": 0.31,
                                                                         "cutoff_best_cosine": 0.42}}}))
    assert model_cutoff(tmp_path) == Cutoff(hit=0.31, best=0.42)
    assert resolve_cutoff("auto", None, tmp_path) == Cutoff(hit=0.31, best=0.42)
    assert resolve_cutoff("auto", 0.5, tmp_path) == Cutoff(0.5, 0.5, "min_score")   # a score of your own wins
    assert resolve_cutoff("none", None, tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"trained": {"val": {"cutoff_cosine": 0.31}}}))
    assert model_cutoff(tmp_path) == Cutoff(hit=0.31, best=0.31)      # calibrated before the best-hit floor
    (tmp_path / "config.json").write_text(json.dumps({"trained": {"val": {}}}))
    assert resolve_cutoff("auto", None, tmp_path) is None              # an uncalibrated model: no cut-off
    assert model_cutoff(tmp_path / "missing") is None
    with pytest.raises(QueryError, match="min_score"):
        check_cutoff("0.3")


def test_a_built_in_models_cutoff_json_applies_to_the_package_it_was_measured_on(tmp_path, monkeypatch):
    from clip_mini.builtin import registry

    package = tmp_path / "packages" / "pics"
    package.mkdir(parents=True)
    (package / "manifest.json").write_text("{}")
    monkeypatch.setattr(registry, "BUILTIN_ROOT", tmp_path / "packages")
    built = tmp_path / "cache" / "pics-f1"
    built.mkdir(parents=True)
    (built / "config.json").write_text(json.dumps({"builtin": "pics", "builtin_fingerprint": "f1",
                                                   "trained": {"val": {"cutoff_cosine": 0.5}}}))
    assert model_cutoff(built) == Cutoff(0.5, 0.5)                     # no cutoff.json: the trainer's
    (package / "cutoff.json").write_text(json.dumps({"calibrated_for": "f1", "cutoff_cosine": 0.46,
                                                     "cutoff_best_cosine": 0.56}))
    assert model_cutoff(built) == Cutoff(0.46, 0.56)
    (package / "cutoff.json").write_text(json.dumps({"calibrated_for": "f0", "cutoff_cosine": 0.46,
                                                     "cutoff_best_cosine": 0.56}))
    assert model_cutoff(built) == Cutoff(0.5, 0.5)                     # measured on another package: not used


# -- on real files: a photo that stands out is listed, a flat run of near-equal photos is not ----------------------
@pytest.fixture(scope="module")
def flat_run(model_dir, tmp_path_factory):
    """Six photos; the query is photo 0 itself. With it indexed it scores 1 and the others a flat run just below;
    a model whose rule puts the best-hit floor between the two and the per-hit floor inside the run."""
    from conftest import write_images

    from clip_mini.model.clip import CLIPModel
    from clip_mini.retrieval.index import EmbeddingIndex

    root = tmp_path_factory.mktemp("flat")
    photos = write_images(root / "photos", 6, seed=2)
    probe = EmbeddingIndex.build(root / "probe", model_dir, photos, progress=False)
    [scores] = probe.hits(images=[str(photos[0])], k=6)
    others = sorted(h["score"] for h in scores if h["path"] != str(photos[0]))
    assert scores[0]["path"] == str(photos[0]) and scores[0]["score"] > others[-1] + 0.01   # it stands out
    assert others[-1] - others[0] < 0.1                                                     # the rest: a flat run
    rule = {"cutoff_cosine": round((others[1] + others[2]) / 2, 6),                  # drops the 2 weakest others
            "cutoff_best_cosine": round((others[-1] + scores[0]["score"]) / 2, 6)}
    out = {"photos": photos, "rule": rule}
    for name, val in (("model", rule), ("old_model", {"cutoff_cosine": rule["cutoff_cosine"]})):
        out[name] = root / name
        CLIPModel.from_pretrained(model_dir).save_pretrained(out[name], extra={"trained": {"val": val}})
        for which, files in (("present", photos), ("removed", photos[1:])):
            out[f"{name}_{which}"] = root / f"{name}_{which}"
            EmbeddingIndex.build(out[f"{name}_{which}"], out[name], files, progress=False)
    return out


def test_a_photo_that_stands_out_is_listed_and_a_flat_run_is_not(flat_run, capsys):
    from clip_mini.cli.main import main
    from clip_mini.retrieval.index import EmbeddingIndex

    query, rule = str(flat_run["photos"][0]), flat_run["rule"]
    [hits] = EmbeddingIndex.load(flat_run["model_present"]).hits(images=[query], k=6, cutoff="auto")
    assert hits[0]["path"] == query and len(hits) == 4 and hits.below == 2          # itself + the run's top 3
    assert (hits.min_score, hits.min_best) == (rule["cutoff_cosine"], rule["cutoff_best_cosine"])
    [hits] = EmbeddingIndex.load(flat_run["model_removed"]).hits(images=[query], k=6, cutoff="auto")
    assert hits == [] and hits.below == 5 and hits.best_below["score"] < rule["cutoff_best_cosine"]
    # the old one-cosine rule lists the flat run: each of its photos reaches the per-hit floor
    [old] = EmbeddingIndex.load(flat_run["old_model_removed"]).hits(images=[query], k=6, cutoff="auto")
    assert len(old) == 3 and old.min_best == old.min_score == rule["cutoff_cosine"]
    # clip-mini search: the same rule
    capsys.readouterr()
    assert main(["search", "--index", str(flat_run["model_removed"]), "--image", query, "-k", "6", "--json"]) == 1
    out, err = capsys.readouterr()
    answer = json.loads(out)
    assert answer["results"] == [] and answer["min_best"] == rule["cutoff_best_cosine"]
    assert "no good match" in err and f"{rule['cutoff_best_cosine']:.3f} for the best hit" in err
    assert main(["search", "--index", str(flat_run["model_present"]), "--image", query, "-k", "6", "--json"]) == 0
    out, err = capsys.readouterr()
    [api] = EmbeddingIndex.load(flat_run["model_present"]).hits(images=[query], k=6, cutoff="auto")
    assert [h["path"] for h in json.loads(out)["results"]] == [h["path"] for h in api]
    assert "2 more of the top 6 fall below the model's cut-off" in err
    assert main(["search", "--index", str(flat_run["model_removed"]), "--image", query, "-k", "6", "--json",
                 "--min-score", str(rule["cutoff_cosine"])]) == 0                   # --min-score: every hit, alone
    assert len(json.loads(capsys.readouterr()[0])["results"]) == 3


def test_the_server_applies_the_same_rule(flat_run):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from clip_mini.serve.app import ServeConfig, create_app

    query, rule = flat_run["photos"][0], flat_run["rule"]
    for which, listed, below in (("present", 4, 2), ("removed", 0, 5)):
        cfg = ServeConfig(index=str(flat_run[f"model_{which}"]), allowed_hosts=["testserver"])
        with TestClient(create_app(cfg)) as client:
            answer = client.post("/api/search/image", params={"k": 6},
                                 files={"file": (query.name, query.read_bytes(), "image/png")}).json()
        assert len(answer["results"]) == listed and answer["below"] == below, answer
        assert (answer["min_score"], answer["min_best"]) == (rule["cutoff_cosine"], rule["cutoff_best_cosine"])


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
    assert {"cutoff_cosine", "cutoff_best_cosine", "cutoff_kept", "cutoff_empty"} <= set(val)
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
    assert api.min_best == pytest.approx(calibrated[1]["cutoff_best_cosine"])


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
        assert answer["results"] == [] and answer["below"] == 4 and answer["min_score"] == answer["min_best"] == 1.5
        assert answer["best_below"] <= 1.0
        answer = client.get("/api/search", params={"q": "a red circle", "k": 4, "cutoff": "none"}).json()
        assert len(answer["results"]) == 4 and answer["below"] == 0 and answer["min_score"] is None
        assert answer["min_best"] is None
        answer = client.get("/api/search", params={"q": "a red circle", "k": 4, "min_score": -1}).json()
        assert len(answer["results"]) == 4 and answer["min_score"] == answer["min_best"] == -1
        bad = client.get("/api/search", params={"q": "a red circle", "cutoff": "sometimes"})
        assert bad.status_code == 400 and "cut-off" in bad.json()["error"]
