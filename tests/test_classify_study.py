"""The zero-shot sorting study (benchmarks/studies/classify_flickr8k.py): its caption labelling rule, the split
check, and its section of RESULTS.md."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import results_md  # noqa: E402
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


def _result(shapes: bool) -> dict:
    row = lambda p, acc, rec: {"prompts": p, "images": 5, "accuracy": acc, "mean_class_recall": rec,  # noqa: E731
                               "recall": {"dog": 1.0, "rock climber": None, "snow": 0.25}}
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
