"""The zero-shot sorting study (benchmarks/studies/classify_flickr8k.py): its caption labelling rule, the split
check, ``--final`` (the test split read only inside a ledger line written first; val and test pooled), and its
section of RESULTS.md."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import results_md  # noqa: E402
from benchmarks.studies import classify_flickr8k as study  # noqa: E402
from benchmarks.studies.classify_flickr8k import (FLICKR_CLASSES, check_same_split, keyword_pattern,  # noqa: E402
                                                  label_photo, label_photos, take)

CLASSES = {"dog": ("dog", "dogs"), "snow": ("snow", "skiing"), "rock climber": ("climbing", "rock wall")}
OTHER = ["A man stands .", "People outside .", "Someone smiles .", "A street .", "Two women talk ."]


def photo(*named: str) -> list[str]:
    """Five captions: ``named`` first, the rest naming no class."""
    return list(named) + OTHER[:5 - len(named)]


PHOTOS = {
    "three_dogs": photo("A dog runs .", "Two DOGS play .", "a brown dog.", ),
    "two_dogs": photo("A dog runs .", "A dog jumps ."),
    "substrings": photo("A dog runs .", "A dog jumps .", "A man eats a hotdog .", "He doggedly climbs .",
                        "underdogs win"),
    "repeats_in_one_caption": photo("A dog, a dog and more dogs .", "A dog jumps ."),
    "dog_in_snow": photo("A dog in the snow .", "A dog runs in snow .", "A black dog in the snow .", "Snow falls ."),
    "five_dogs_three_snow": photo("A dog in the snow .", "A dog in snow .", "A dog skiing .", "A dog .", "Dogs ."),
    "phrase": photo("A man on a rock wall .", "A rock\twall and a man .", "Rock  Wall ."),
    "phrase_plural": photo("Rock walls .", "rock walls", "A rock wall ."),
    "nothing": photo(),
}


def test_a_class_named_by_three_of_five_captions_labels_the_photo():
    pats = {c: keyword_pattern(k) for c, k in CLASSES.items()}
    assert label_photo(PHOTOS["three_dogs"], pats) == ("dog", ["dog"])   # case-insensitive, plural keyword
    assert label_photo(PHOTOS["two_dogs"], pats) == (None, [])
    assert label_photo(PHOTOS["phrase"], pats) == ("rock climber", ["rock climber"])   # any whitespace in a phrase


def test_keywords_match_whole_words_and_count_once_per_caption():
    pats = {c: keyword_pattern(k) for c, k in CLASSES.items()}
    assert label_photo(PHOTOS["substrings"], pats) == (None, [])      # hotdog, doggedly, underdogs: no votes
    assert label_photo(PHOTOS["repeats_in_one_caption"], pats) == (None, [])   # 2 captions, not 4 mentions
    assert label_photo(PHOTOS["phrase_plural"], pats) == (None, [])   # "rock walls" is not "rock wall"


def test_two_classes_at_the_threshold_leave_the_photo_out_even_with_a_majority():
    pats = {c: keyword_pattern(k) for c, k in CLASSES.items()}
    assert label_photo(PHOTOS["dog_in_snow"], pats) == (None, ["dog", "snow"])        # 3 and 4 votes
    assert label_photo(PHOTOS["five_dogs_three_snow"], pats) == (None, ["dog", "snow"])   # 5 against 3


def test_label_photos_counts_labelled_unlabelled_and_ambiguous():
    labels, counts = label_photos(PHOTOS, CLASSES)
    assert labels == {"three_dogs": "dog", "phrase": "rock climber"}
    assert counts == {"photos": 9, "labelled": 2, "unlabelled": 5, "ambiguous": 2,
                      "per_class": {"dog": 1, "snow": 0, "rock climber": 1}}
    # two votes are enough at --min-votes 2: then "two_dogs" is a dog and "substrings" too (its two real dogs)
    labels2, counts2 = label_photos(PHOTOS, CLASSES, min_votes=2)
    assert labels2["two_dogs"] == "dog" and labels2["substrings"] == "dog"
    assert "phrase_plural" not in labels2 and counts2["ambiguous"] == 2
    with pytest.raises(ValueError):
        label_photos(PHOTOS, CLASSES, min_votes=0)


def test_no_keyword_of_the_study_votes_for_two_classes():
    pats = {c: keyword_pattern(k) for c, k in FLICKR_CLASSES.items()}
    for c, words in FLICKR_CLASSES.items():
        for w in words:
            assert [d for d, p in pats.items() if p.search(w)] == [c], w
    assert 6 <= len(FLICKR_CLASSES) <= 10


def test_take_with_a_limit_draws_every_class_in_turn():
    truth = {f"d{i}": "dog" for i in range(10)} | {"s0": "snow", "s1": "snow", "r0": "rock"}
    assert take(truth, ["dog", "snow", "rock"], None) == sorted(truth)
    assert take(truth, ["dog", "snow", "rock"], 4) == sorted(["d0", "s0", "r0", "d1"])
    assert take(truth, ["dog", "snow", "rock"], 100) == sorted(truth)


def test_a_model_whose_run_split_differently_is_refused(tmp_path):
    from clip_mini.config import load_config
    from clip_mini.eval.scoring import EvalError

    cfg = load_config(ROOT / "configs/flickr8k-vit.yaml")
    text = (ROOT / "configs/flickr8k-vit.yaml").read_text()
    (tmp_path / "best").mkdir()
    (tmp_path / "config.yaml").write_text(text)
    assert check_same_split(str(tmp_path / "best"), cfg) == str(tmp_path / "config.yaml")
    (tmp_path / "config.yaml").write_text(text.replace("  seed: 0\n", "  seed: 1\n", 1))
    with pytest.raises(EvalError, match="data.seed=1"):
        check_same_split(str(tmp_path / "best"), cfg)
    assert check_same_split(str(tmp_path / "elsewhere" / "best"), cfg) is None   # no run config beside it


def _result(shapes: bool, final: bool = False) -> dict:
    recall = {"dog": 1.0, "rock climber": None, "snow": 0.25}
    row = lambda p, acc, rec, n=5: {"prompts": p, "images": n, "accuracy": acc,  # noqa: E731
                                    "mean_class_recall": rec, "recall": recall}
    out = {"benchmark": "classify_flickr8k", "command": "python benchmarks/studies/classify_flickr8k.py --model photos",
           "implementation": "clip_mini.eval.classify.classify_files -> Embedder.classify",
           "machine": {"cpu_model": "Intel Xeon", "isa": ["amx_bf16"]}, "model": {"name": "photos"},
           "flickr8k": {"val_photos": 500, "labelled": 236, "unlabelled": 215, "ambiguous": 49,
                        "rule": {"min_votes": 3}, "labels": ["dog", "rock climber", "snow"],
                        "scored": {"dog": 1, "rock climber": 0, "snow": 4},
                        "rows": [row("single", 0.6123, 0.6251), row("ensemble", 0.7789, 0.7011)]},
           "shapes": {"skipped": "no --demo-model given"}}
    if shapes:
        out["shapes"] = {"model": {"name": "runs/tiny/best"}, "sets": [
            {"set": "val", "attribute": "colour", "labels": ["red", "blue"], "rows": [row("single", 0.9412, 0.9)]}]}
    if final:
        out["flickr8k"]["test"] = {"photos": 1000, "labelled": 470, "unlabelled": 430, "ambiguous": 100,
                                   "scored": {"dog": 3, "rock climber": 1, "snow": 3},
                                   "rows": [row("single", 0.5, 0.51, 7), row("ensemble", 0.6, 0.61, 7)]}
        out["flickr8k"]["pooled"] = {"photos": 1500, "labelled": 706,
                                     "scored": {"dog": 4, "rock climber": 1, "snow": 7},
                                     "rows": [row("single", 0.55, 0.56, 12), row("ensemble", 0.65, 0.66, 12)]}
    return out


@pytest.mark.parametrize("shapes", [False, True])
def test_results_md_renders_the_study_from_its_json(tmp_path, monkeypatch, shapes):
    (tmp_path / "studies").mkdir()
    (tmp_path / results_md.CLASSIFY).write_text(json.dumps(_result(shapes)))
    monkeypatch.setattr(results_md, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(results_md, "_cache", {})
    doc = results_md.Doc()
    results_md.classify_study(doc)
    text = doc.text()
    assert "236 photos get one class; 215 get none and 49 get two or more" in text
    assert "| Flickr8k val, 3 caption classes | single | 5 | 0.612 | 0.625 | `photos` | AMX Xeon |" in text
    assert "| Flickr8k val, 3 caption classes | ensemble | 5 | 0.779 | 0.701 |" in text
    assert "| rock climber | 0 | - | - |" in text and "| snow | 4 | 0.250 | 0.250 |" in text
    assert ("| shapes val, colour (2) | single | 5 | 0.941 | 0.900 | `runs/tiny/best` |" in text) == shapes
    assert ("not scored in this run (no --demo-model given)" in text) == (not shapes)
    keys = {s.key for srcs in doc.sources for s in srcs}
    assert "flickr8k.rows.1.accuracy" in keys and "flickr8k.rows.0.recall.[snow]" in keys
    assert "No train or test photo is used." in text and "Flickr8k test" not in text   # val only: as before


def test_results_md_shows_the_test_and_pooled_rows_of_a_final_run(tmp_path, monkeypatch):
    (tmp_path / "studies").mkdir()
    (tmp_path / results_md.CLASSIFY).write_text(json.dumps(_result(False, final=True)))
    monkeypatch.setattr(results_md, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(results_md, "_cache", {})
    doc = results_md.Doc()
    results_md.classify_study(doc)
    text = doc.text()
    assert "Scored: 5 val photos, 7 test photos, 12 val and test pooled" in text
    assert "the 1000 test photos are labelled by the same rule" in text and "No train photo is used." in text
    assert "| Flickr8k val, 3 caption classes | single | 5 | 0.612 | 0.625 | `photos` |" in text
    assert "| Flickr8k test (`--final`), 3 caption classes | ensemble | 7 | 0.600 | 0.610 | `photos` |" in text
    assert "| Flickr8k val + test, 3 caption classes | single | 12 | 0.550 | 0.560 | `photos` |" in text
    assert "| class | photos, val | recall, single, val | recall, ensemble, val | photos, test |" in text
    assert "| snow | 4 | 0.250 | 0.250 | 3 | 0.250 | 0.250 | 7 | 0.250 | 0.250 |" in text
    keys = {s.key for srcs in doc.sources for s in srcs}
    assert {"flickr8k.test.rows.1.accuracy", "flickr8k.pooled.rows.0.images", "flickr8k.pooled.scored.[snow]"} <= keys


# -- --final: the test split only inside a ledger line ------------------------------------------------------------
def _captions(cls: str, n: int = 3) -> list[str]:
    return [f"A picture with a {cls} ."] * n + ["Something ."] * (5 - n)


# val: two dogs, a snow photo, a water photo, one unlabelled; test: a street photo too (no val photo of a street)
VAL = {"val/dog_0.jpg": _captions("dog"), "val/dog_1.jpg": _captions("dog", 5), "val/snow_0.jpg": _captions("snow"),
       "val/water_0.jpg": _captions("water"), "val/none_0.jpg": _captions("cat")}
TEST = {"test/dog_0.jpg": _captions("dog"), "test/snow_0.jpg": _captions("snow"),
        "test/snow_1.jpg": _captions("snow", 4), "test/water_0.jpg": _captions("water"),
        "test/street_0.jpg": _captions("street"), "test/none_0.jpg": _captions("cat")}
WRONG = {"val/dog_1.jpg": "snow", "test/snow_1.jpg": "water"}   # what the fake model gets wrong


def _frame(photos):
    import pandas as pd

    return pd.DataFrame([{"path": p, "caption": c} for p, caps in photos.items() for c in caps])


class _Embedder:
    """A stand-in for the photo model: a photo's class is its file name's (``WRONG`` aside). Each call records the
    splits it was shown and the ledger's lines at that moment."""
    precision = "fp32"

    def __init__(self, log, ledger_path):
        self.log, self.ledger_path = log, ledger_path

    def classify(self, paths, labels, template, top, on_error, show_progress):
        self.log.append(("classify", {Path(p).parent.name for p in paths}, _lines(self.ledger_path)))
        key = {str(Path(p).resolve()): p for p in TEST | VAL}
        rows = []
        for p in paths:
            name = key.get(str(Path(p).resolve()), p)
            label = WRONG.get(name, Path(name).name.split("_")[0])
            rows.append({"path": p, "label": label if label in labels else labels[0]})
        return rows, {}


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def fake_flickr(monkeypatch, ledger_path):
    """The study's Flickr8k part on VAL and TEST through the fake model; returns the log of splits read (with the
    ledger's lines when "test" was read) and of classify calls."""
    import clip_mini.data
    import clip_mini.embed

    log = []

    class Splits(dict):
        def __getitem__(self, key):
            log.append(("read", key, _lines(ledger_path)))
            return super().__getitem__(key)

    monkeypatch.setattr(clip_mini.data, "load_splits",
                        lambda cfg, **kw: Splits(train=_frame({}), val=_frame(VAL), test=_frame(TEST)))
    monkeypatch.setattr(clip_mini.embed, "load", lambda *a, **kw: _Embedder(log, ledger_path))
    return log


def _run(tmp_path, *more) -> dict:
    study.main(["--model", "photos", "--captions", str(tmp_path / "captions.csv"),
                "--result", str(tmp_path / "classify.json"), *more])
    return json.loads((tmp_path / "classify.json").read_text())


def test_without_final_the_test_split_is_not_read(tmp_path, fake_flickr, ledger_path):
    out = _run(tmp_path)
    fl = out["flickr8k"]
    assert [e[1] for e in fake_flickr if e[0] == "read"] == ["val"]
    assert all(e[1] == {"val"} for e in fake_flickr if e[0] == "classify")
    assert not ledger_path.exists()
    assert fl["test_split"] == "not read (run without --final)" and "test" not in fl and "pooled" not in fl
    assert fl["labels"] == ["dog", "water", "snow"] and fl["scored"] == {"dog": 2, "water": 1, "snow": 1}
    assert [(r["prompts"], r["images"], r["accuracy"]) for r in fl["rows"]] == [("single", 4, 0.75),
                                                                                  ("ensemble", 4, 0.75)]
    assert sorted(x.name for x in tmp_path.glob("*.png")) == ["classify_flickr8k_ensemble.png",
                                                               "classify_flickr8k_single.png"]   # as before


def test_final_writes_its_ledger_line_before_the_test_split_is_read_and_pools_val_and_test(
        tmp_path, fake_flickr, ledger_path):
    val_only = _run(tmp_path / "val_only")["flickr8k"]
    out = _run(tmp_path, "--final")
    fl = out["flickr8k"]

    reads = [e for e in fake_flickr if e[0] == "read"]
    assert [e[1] for e in reads] == ["val", "val", "test"]   # the val-only run, then the --final one
    (line,) = reads[-1][2]   # the line was out, and open, when "test" was read
    assert line["status"] == "scoring" and line["test"] is None
    assert line["source"] == "benchmarks/studies/classify_flickr8k.py --final"
    assert line["benchmark"] == "classify_flickr8k" and line["variant"] == "builtin:photos"
    assert line["model"]["name"] == "photos" and "test photos" in line["scored"]
    for _, splits, lines in (e for e in fake_flickr if e[0] == "classify" and "test" in e[1]):
        assert splits == {"test"} and [x["status"] for x in lines] == ["scoring"]

    (done,) = _lines(ledger_path)   # one look, completed with the test numbers
    assert done["id"] == line["id"] == fl["ledger"]["id"] and done["status"] == "done"
    assert done["test"] == {r["prompts"]: {"accuracy": r["accuracy"], "mean_class_recall": r["mean_class_recall"],
                                           "images": r["images"]} for r in fl["test"]["rows"]}
    assert done["test_images"] == 4

    assert fl["rows"] == val_only["rows"] and fl["scored"] == val_only["scored"]   # val as without --final
    test = fl["test"]
    assert (test["photos"], test["labelled"], test["unlabelled"], test["outside_val_classes"]) == (6, 4, 1, 1)
    assert test["scored"] == {"dog": 1, "water": 1, "snow": 2}   # the street photo: no val class, left out
    assert [(r["images"], r["accuracy"]) for r in test["rows"]] == [(4, 0.75), (4, 0.75)]
    pooled = fl["pooled"]
    assert pooled["photos"] == 11 and pooled["labelled"] == fl["labelled"] + test["labelled"] == 8
    assert pooled["scored"] == {c: fl["scored"][c] + test["scored"][c] for c in fl["labels"]}
    for v, t, p in zip(fl["rows"], test["rows"], pooled["rows"]):
        assert v["prompts"] == t["prompts"] == p["prompts"] and p["templates"] == v["templates"]
        assert p["images"] == v["images"] + t["images"] == 8
        assert p["confusion"] == (np.asarray(v["confusion"]) + np.asarray(t["confusion"])).tolist()
        assert p["accuracy"] == 0.75 and p["recall"] == {"dog": 0.6667, "water": 1.0, "snow": 0.6667}
    assert {x.name for x in tmp_path.glob("*.png")} == {
        f"classify_flickr8k{g}_{p}.png" for g in ("", "_test", "_pooled") for p in ("single", "ensemble")}


def test_final_is_refused_with_a_limit(tmp_path, fake_flickr, ledger_path):
    with pytest.raises(SystemExit):
        _run(tmp_path, "--final", "--limit", "2")
    assert not ledger_path.exists() and not fake_flickr


CAPTIONS = ROOT.parent / "shared/data/flickr8k/captions.csv"


@pytest.mark.skipif(not CAPTIONS.is_file(), reason="Flickr8k is not in ../shared/data")
def test_on_flickr8k_the_study_without_final_reads_val_only(tmp_path, monkeypatch, ledger_path):
    """The real splits (the fake model only): val's photos are labelled, test is never read."""
    import clip_mini.data
    import clip_mini.embed

    real, reads = clip_mini.data.load_splits, []

    class Splits(dict):
        def __getitem__(self, key):
            reads.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(clip_mini.data, "load_splits", lambda cfg, **kw: Splits(real(cfg, **kw)))
    monkeypatch.setattr(clip_mini.embed, "load", lambda *a, **kw: _Embedder([], ledger_path))
    fl = study.main(["--model", "photos", "--limit", "20", "--result", str(tmp_path / "c.json")])["flickr8k"]
    assert reads == ["val"] and not ledger_path.exists() and "test" not in fl
    assert fl["val_photos"] == 500 and fl["labelled"] + fl["unlabelled"] + fl["ambiguous"] == 500
    assert 6 <= len(fl["labels"]) <= 10 and fl["rows"][0]["images"] == 20
