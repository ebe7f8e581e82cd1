"""The pointing game (benchmarks/quality/explain_pointing.py): its box, hit and chance helpers on small arrays, the
photos' boxes file, the scoring with fixed maps and with a real tiny model on generated shapes (and on real photos
where Flickr8k is present), the rebuild command read off a run, the whole script, and its RESULTS.md section."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import results_md  # noqa: E402
from benchmarks.quality import explain_pointing as ep  # noqa: E402
from conftest import FLICKR8K  # noqa: E402

IMAGES = FLICKR8K / "images"


# ---------------------------------------------------------------------------------------------------- helpers

def test_percent_boxes_scale_to_the_map_pixels():
    assert ep.scale_boxes([(10, 20, 60, 70)], height=10, width=20) == [(2.0, 2.0, 12.0, 7.0)]
    assert ep.scale_boxes([(0, 0, 100, 100), (50, 25, 75, 50)], height=8, width=4) == [
        (0.0, 0.0, 4.0, 8.0), (2.0, 2.0, 3.0, 4.0)]


def test_a_pixel_is_in_a_box_when_its_centre_is_edges_included():
    mask = ep.box_mask([(0, 0, 2.4, 1.5)], height=4, width=5)   # centres x 0.5, 1.5 (2.5 out); y 0.5, 1.5 (edge)
    assert mask.shape == (4, 5) and mask.sum() == 4 and mask[:2, :2].all()
    assert np.argwhere(ep.box_mask([(0.5, 0.5, 0.5, 0.5)], 3, 3)).tolist() == [[0, 0]]   # a point on one centre
    assert ep.box_mask([(3.6, 0, 4.4, 9)], 2, 6).sum() == 0                               # between two centres


def test_chance_is_the_share_of_the_union_of_the_boxes_averaged_over_queries():
    h, w = 10, 20
    one = ep.box_mask(ep.scale_boxes([(0, 0, 50, 50)], h, w), h, w)                    # 10 x 5 of 200
    union = ep.box_mask(ep.scale_boxes([(0, 0, 50, 50), (25, 0, 75, 50)], h, w), h, w)   # 15 x 5, overlap once
    assert one.mean() == 0.25 and union.mean() == 0.375
    assert ep.chance_rate([one, union]) == 0.3125
    case = ep.Case("x.jpg", "a dog", ((0, 0, 50, 50), (25, 0, 75, 50)), percent=True)
    assert ep.case_mask(case, h, w).sum() == 75
    pixel_case = ep.Case("x.png", "a red circle", ((0, 0, 5, 5),))                      # shapes: pixel boxes
    assert ep.case_mask(pixel_case, h, w).sum() == 25


def test_the_peak_decides_and_a_tie_goes_to_the_first_in_reading_order():
    heat = np.zeros((4, 4), np.float32)
    heat[1, 3] = heat[2, 0] = 1.0                     # a tie: (row 1, col 3) comes first
    assert ep.peak_hits(heat, ep.box_mask([(3, 1, 4, 2)], 4, 4))
    assert not ep.peak_hits(heat, ep.box_mask([(0, 2, 1, 3)], 4, 4))
    assert ep.inside(heat, (3, 1, 4, 2)) and not ep.inside(heat, (0, 2, 1, 3))
    with pytest.raises(ValueError, match="map against"):
        ep.peak_hits(heat, np.zeros((4, 5), bool))


# ---------------------------------------------------------------------------------------------------- scoring

def _peak(at, shape=(10, 10)) -> np.ndarray:
    m = np.zeros(shape, np.float32)
    m[at] = 1.0
    return m


def test_score_counts_hits_per_method_and_the_chance_with_fixed_maps():
    left, right, single = (0, 0, 2, 10), (5, 0, 8, 10), (0, 0, 5, 10)     # 20, 30 and 50 pixels of 100
    items = [ep.Case("a.png", "a red circle", (left,)), ep.Case("a.png", "a blue star", (right,)),
             ep.Case("b.png", "a green square", (single,))]
    gradcam = {"a red circle": (5, 1), "a blue star": (5, 6), "a green square": (5, 9)}   # hit, hit, miss
    relevance = {"a red circle": (5, 1), "a blue star": (5, 6), "a green square": (5, 2)}  # hit, hit, hit
    tokens = {"a red circle": (5, 6), "a blue star": (5, 1), "a green square": (5, 9)}    # miss, miss, miss
    occlusion = {"a red circle": (5, 1), "a blue star": (5, 1), "a green square": (5, 2)}  # hit, miss, hit

    def explain(path, query, method):
        return _peak({"gradcam": gradcam, "relevance": relevance, "tokens": tokens,
                      "occlusion": occlusion}[method][query])

    calls = []

    def attention(path):
        calls.append(path)
        return {"mean": _peak((5, 1)), "rollout": _peak((5, 9))}    # left object; the right of image a, miss on b

    res = ep.score(items, explain, attention)
    assert calls == ["a.png", "b.png"]                                # once per image
    assert res["queries"] == 3 and res["unavailable"] == {}
    assert res["accuracy"] == {"gradcam": 2 / 3, "relevance": 1.0, "tokens": 0.0, "occlusion": 2 / 3,
                               "cls_attention_mean": 2 / 3, "cls_attention_rollout": 0.0}
    assert [r["chance"] for r in res["records"]] == [0.2, 0.3, 0.5]
    assert res["chance"] == pytest.approx(1 / 3, abs=1e-12)
    assert res["records"][1]["hits"] == {"gradcam": True, "relevance": True, "tokens": False, "occlusion": False,
                                         "cls_attention_mean": False, "cls_attention_rollout": False}


def test_a_tower_without_cls_attention_is_reported_not_raised():
    items = [ep.Case("a.png", "a dog", ((0, 0, 5, 5),))]

    def attention(path):
        raise ValueError("CLS attention needs a ViT image tower, this model uses efficientnet")

    res = ep.score(items, lambda p, q, m: _peak((1, 1)), attention)
    assert res["accuracy"] == {"gradcam": 1.0, "relevance": 1.0, "tokens": 1.0, "occlusion": 1.0}
    assert res["unavailable"] == {m: "ValueError: CLS attention needs a ViT image tower, this model uses efficientnet"
                                  for m in ep.ATTENTION_METHODS}


def test_summary_gives_mean_min_max_over_models_and_judges_targets_on_the_lowest():
    def model(two, one):   # the targets are judged on auto's method for the demo (occlusion), not on relevance
        return {"pointing_accuracy": {"two_object": {"queries": 4, "occlusion": two, "relevance": 1.0,
                                                     "gradcam": 1.0, "tokens": 0.5},
                                      "single_object": {"queries": 2, "occlusion": one, "relevance": 0.0,
                                                        "gradcam": 0.0, "tokens": 0.5}}}

    s = ep.summarise([model(0.9, 1.0), model(0.8, 0.95), model(1.0, 1.0)],
                     {"two_object": 0.125, "single_object": 0.25})
    assert s["two_object"]["occlusion"] == {"mean": 0.9, "min": 0.8, "max": 1.0}
    assert s["single_object"]["occlusion"] == {"mean": 0.9833, "min": 0.95, "max": 1.0}
    assert s["two_object"]["chance"] == 0.125 and s["two_object"]["queries"] == 4
    assert "cls_attention_mean" not in s["two_object"]
    t = ep.targets(s)
    assert t["method"] == "occlusion"
    assert t["two_object"] == {"target": 0.85, "min": 0.8, "mean": 0.9, "met": False}   # the mean would pass
    assert t["single_object"]["met"] is True


# ---------------------------------------------------------------------------------------------------- boxes file

def _boxes_file(tmp_path, photos, name="boxes.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"rule": "the main noun of the captions", "photos": photos}))
    return p


def test_the_boxes_file_loads_skips_entries_without_boxes_and_defaults_the_query(tmp_path):
    p = _boxes_file(tmp_path, [
        {"image": "a.jpg", "noun": "dog", "query": "a dog", "boxes": [[10, 20, 60, 70]]},
        {"image": "b.jpg", "noun": "cat", "boxes": [[0, 0, 50, 50], [50, 50, 100, 100]]},
        {"image": "c.jpg", "noun": "boy", "query": "a boy", "boxes": []}])
    boxes = ep.load_boxes(p)
    assert boxes["rule"] == "the main noun of the captions" and boxes["skipped"] == ["c.jpg"]
    assert [(e["image"], e["query"], e["boxes"]) for e in boxes["entries"]] == [
        ("a.jpg", "a dog", ((10.0, 20.0, 60.0, 70.0),)),
        ("b.jpg", "a cat", ((0.0, 0.0, 50.0, 50.0), (50.0, 50.0, 100.0, 100.0)))]
    for name in ("a.jpg", "b.jpg"):
        (tmp_path / name).write_bytes(b"")
    items = ep.photo_cases(boxes, tmp_path)
    assert [(Path(c.image).name, c.noun, c.percent) for c in items] == [("a.jpg", "dog", True), ("b.jpg", "cat", True)]
    (tmp_path / "b.jpg").unlink()
    with pytest.raises(ep.BoxesError, match=r"1 photo\(s\) of the boxes file are not in .*, e.g. b.jpg"):
        ep.photo_cases(boxes, tmp_path)


GOOD = {"image": "a.jpg", "noun": "dog", "query": "a dog", "boxes": [[10, 20, 60, 70]]}


@pytest.mark.parametrize("entry, says", [
    ({"image": "b.jpg", "query": "a dog", "boxes": [[1, 2, 3, 4]]}, '"noun" must be a non-empty string'),
    ({"image": "b.jpg", "noun": "dog", "boxes": [[1, 2, 3]]}, "box 0 must be 4 numbers"),
    ({"image": "b.jpg", "noun": "dog", "boxes": [[1, 2, 3, 4], [0, 0, 101, 50]]}, r"box 1 \[0, 0, 101, 50\] is not"),
    ({"image": "b.jpg", "noun": "dog", "boxes": [[60, 20, 10, 70]]}, "box 0 .* 0 <= x0 < x1 <= 100"),
    ({"image": "b.jpg", "noun": "dog", "boxes": [[1, 2, "3", 4]]}, "box 0 must be 4 numbers"),
    ({"image": "b.jpg", "noun": "dog", "boxes": "1 2 3 4"}, '"boxes" must be a list'),
    ({"image": "b.jpg", "noun": "dog", "query": " ", "boxes": []}, '"query" must be a non-empty string'),
])
def test_a_bad_entry_is_refused_naming_the_file_and_the_entry(tmp_path, entry, says):
    p = _boxes_file(tmp_path, [GOOD, entry])
    with pytest.raises(ep.BoxesError, match=says) as err:
        ep.load_boxes(p)
    assert str(err.value).startswith(f"{p}: photos[1] (b.jpg): ")


@pytest.mark.parametrize("text, says", [
    ("{not json", "not readable as JSON"),
    (json.dumps({"rule": "x"}), 'must be a JSON object with a "photos" list'),
    (json.dumps([GOOD]), 'must be a JSON object with a "photos" list'),
    (json.dumps({"photos": [GOOD, "b.jpg"]}), r"photos\[1\]: not an object"),
    (json.dumps({"photos": [{**GOOD, "image": "sub/a.jpg"}]}), r'photos\[0\]: "image" must be a file name'),
])
def test_a_bad_boxes_file_is_refused_naming_it(tmp_path, text, says):
    p = tmp_path / "boxes.json"
    p.write_text(text)
    with pytest.raises(ep.BoxesError, match=says) as err:
        ep.load_boxes(p)
    assert str(err.value).startswith(f"{p}: ")
    with pytest.raises(ep.BoxesError, match="no such file"):
        ep.load_boxes(tmp_path / "absent.json")


def test_the_drawn_boxes_file_is_valid_and_its_photos_present():
    """The hand-drawn file, once it exists: every entry well-formed and every photo in the Flickr8k folder."""
    if not ep.BOXES.is_file():
        pytest.skip(f"{ep.BOXES} not drawn yet")
    boxes = ep.load_boxes(ep.BOXES)
    assert boxes["entries"], "no entry has a box"
    if not IMAGES.is_dir():
        pytest.skip("Flickr8k images absent")
    assert len(ep.photo_cases(boxes, IMAGES)) == len(boxes["entries"])


# ---------------------------------------------------------------------------------------------------- real runs

@pytest.fixture(scope="module")
def small_shapes(tmp_path_factory) -> Path:
    from clip_mini.data.synthetic import generate

    return generate(tmp_path_factory.mktemp("pointing") / "shapes", n=30)   # 30 compositional images


def _labels(data: Path) -> dict:
    import csv

    with open(data / "labels.csv", newline="", encoding="utf-8") as f:
        return {r["image"]: r for r in csv.DictReader(f)}


def test_a_real_scoring_on_two_shapes_images_agrees_with_the_maps_themselves(model_dir, small_shapes):
    """The tiny model's own maps, peaks and boxes read independently of the script: the same hits and chance."""
    import clip_mini
    from clip_mini.data import load_image
    from clip_mini.model.attention import attention_map
    from clip_mini.model.explain import upsample

    sets = ep.cases(small_shapes, 1)
    two, one = sets["two_object"], sets["single_object"]
    assert len(two) == 2 and len(one) == 1 and two[0].image == two[1].image != one[0].image
    labels = _labels(small_shapes)
    row = labels[Path(two[0].image).name]
    assert row["n_objects"] == "2" and two[1].query == f"a {row['colour2']} {row['shape2']}"

    emb = clip_mini.load(model_dir, device="cpu")
    explain, attention = ep.embedder_maps(emb)
    for name, items in sets.items():
        res = ep.score(items, explain, attention)
        assert set(res["accuracy"]) == set(ep.METHODS) and res["unavailable"] == {}
        for case, rec in zip(items, res["records"]):
            r = labels[Path(case.image).name]
            suffix = "_2" if case.query == f"a {r['colour2']} {r['shape2']}" and r["n_objects"] == "2" else ""
            x0, y0, x1, y1 = (float(r[k + suffix]) for k in ("x0", "y0", "x1", "y1"))
            image = load_image(case.image)
            h, w = image.shape[:2]
            maps = {m: emb.explain(case.image, case.query, method=m) for m in ep.MAP_METHODS}
            for mode in ("mean", "rollout"):
                maps[f"cls_attention_{mode}"] = upsample(attention_map(emb.model, emb.transform(image), mode), h, w)
            want = {}
            for m, heat in maps.items():
                assert heat.shape == (h, w)
                y, x = np.unravel_index(int(np.argmax(heat)), heat.shape)
                want[m] = bool(x0 <= x + 0.5 <= x1 and y0 <= y + 0.5 <= y1)
            assert rec["hits"] == want, (name, case.query)
            cols = sum(x0 <= x + 0.5 <= x1 for x in range(w))
            rows = sum(y0 <= y + 0.5 <= y1 for y in range(h))
            assert rec["chance"] == pytest.approx(cols * rows / (h * w), abs=1e-12)
            assert 0 < rec["chance"] < 0.5
        for m in ep.METHODS:
            assert res["accuracy"][m] == sum(r["hits"][m] for r in res["records"]) / len(items)


@pytest.mark.skipif(not IMAGES.is_dir(), reason="Flickr8k images absent")
def test_a_real_scoring_on_two_flickr8k_photos_scales_the_percent_boxes_to_each_photo(model_dir, tmp_path):
    import clip_mini
    from PIL import Image

    names = sorted(p.name for p in IMAGES.glob("*.jpg"))[:2]
    p = _boxes_file(tmp_path, [{"image": names[0], "noun": "dog", "boxes": [[0, 0, 50, 100]]},
                               {"image": names[1], "noun": "man", "boxes": [[50, 0, 100, 40], [0, 60, 30, 100]]}])
    items = ep.photo_cases(ep.load_boxes(p), IMAGES)
    emb = clip_mini.load(model_dir, device="cpu")
    explain, attention = ep.embedder_maps(emb)
    res = ep.score(items, explain, attention)
    for case, rec in zip(items, res["records"]):
        w, h = Image.open(case.image).size
        heat = emb.explain(case.image, case.query, method="gradcam")
        assert heat.shape == (h, w)                    # the map is over the photo's own pixels
        y, x = np.unravel_index(int(np.argmax(heat)), heat.shape)
        fx, fy = 100 * (x + 0.5) / w, 100 * (y + 0.5) / h    # the peak's centre in percent
        assert rec["hits"]["gradcam"] == any(b[0] <= fx <= b[2] and b[1] <= fy <= b[3] for b in case.boxes)
        inside = [[any(b[0] <= 100 * (i + 0.5) / w <= b[2] and b[1] <= 100 * (j + 0.5) / h <= b[3]
                       for b in case.boxes) for i in range(w)] for j in range(h)]
        assert rec["chance"] == pytest.approx(float(np.mean(inside)), abs=1e-12)
    assert res["records"][0]["chance"] == pytest.approx(0.5, abs=0.01)


def test_the_rebuild_command_is_read_off_the_run_config(tmp_path):
    from clip_mini.config import load_config, save_config

    run = tmp_path / "runs" / "seed1"
    (run / "best").mkdir(parents=True)
    # as the trainer saves it: precision resolved (left out of the comparison), the budget in seconds
    save_config(load_config(ROOT / ep.CONFIG, ["train.seed=1", f"train.out_dir={run}", "train.precision=fp32"]),
                run / "config.yaml")
    got = ep.rebuild_of(run / "best")
    out_dir = ep.relative_to_repo(run)
    assert got == {"seed": 1, "rebuild": ep.train_command(1, out_dir), "differs": {}}
    assert got["rebuild"] == ("python train.py --config configs/tiny.yaml --set train.seed=1 "
                              f"--set train.out_dir={out_dir}")
    save_config(load_config(ROOT / ep.CONFIG, ["train.seed=2", f"train.out_dir={run}", "model.vision.patch_size=8",
                                               "train.betas=[0.9, 0.99]"]), run / "config.yaml")
    got = ep.rebuild_of(run / "best")
    assert got["differs"] == {"model.vision.patch_size": 8, "train.betas": [0.9, 0.99]}
    assert got["rebuild"].endswith("--set train.seed=2 --set train.out_dir=%s --set model.vision.patch_size=8 "
                                   "--set train.betas=[0.9, 0.99]" % out_dir)
    assert ep.rebuild_of(tmp_path / "lone")["rebuild"] is None


def test_the_script_writes_its_json_and_results_md_renders_it(model_dir, small_shapes, tmp_path, monkeypatch):
    out = tmp_path / "quality" / "explain_pointing.json"
    result = ep.main(["--models", str(model_dir), str(model_dir), "--data", str(small_shapes), "--n", "1",
                      "--out", str(out), "--photos-model", "photos", "--images", str(tmp_path / "no_images")])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    assert "images folder" in data["flickr8k_photos"]["skipped"] and "absent" in data["flickr8k_photos"]["skipped"]
    acc = data["pointing_accuracy"]
    for name, queries in (("two_object", 2), ("single_object", 1)):   # what tests/test_explain.py reads
        assert acc[name]["queries"] == queries
        assert set(ep.METHODS) <= set(acc[name]) and acc[name]["gradcam"] == data["summary"][name]["gradcam"]["mean"]
        assert data["summary"][name]["gradcam"]["min"] <= data["summary"][name]["gradcam"]["max"]
        assert 0 < data["chance"][name] < 0.5
    assert len(data["models"]) == 2 and data["models"][0]["rebuild"] is None
    assert data["models"][0]["pointing_accuracy"] == data["models"][1]["pointing_accuracy"]   # one model twice
    assert data["targets"]["two_object"]["target"] == 0.85 and data["targets"]["single_object"]["target"] == 0.95
    m = data["machine"]
    assert {"cpu_model", "cpu_kind", "load_average_1min_at_start", "load_average_1min_at_end"} <= set(m)

    # RESULTS.md's section from this JSON, the photos part filled in by hand
    data["flickr8k_photos"] = {
        "model": "photos", "boxes": "benchmarks/data/flickr8k_pointing_boxes.json", "photos": 3,
        "skipped_no_boxes": 1, "queries": 3, "chance": 0.25, "rebuild": "python train.py --config x.yaml",
        "cls_attention_unavailable": "ValueError: no ViT",
        "pointing_accuracy": {"occlusion": 0.3333, "gradcam": 0.6667, "relevance": 1.0, "tokens": 0.3333},
        "per_noun": {"dog": {"queries": 2, "chance": 0.2, "occlusion": 0.5, "gradcam": 0.5, "relevance": 1.0,
                             "tokens": 0.5},
                     "young boy": {"queries": 1, "chance": 0.35, "gradcam": 1.0, "tokens": 0.0}}}
    out.write_text(json.dumps(data))
    monkeypatch.setattr(results_md, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(results_md, "_cache", {})
    doc = results_md.Doc()
    results_md.explain_pointing(doc)
    text = doc.text()
    cpu = results_md.cpu_kind_of(m)
    s = data["summary"]["two_object"]
    assert "met: %s" % ("yes" if data["targets"]["two_object"]["met"] else "no") in text
    target = dict(results_md.POINTING_METHODS).get(ep.TARGET_METHOD, ep.TARGET_METHOD)
    assert f"Targets (issue 52), for {target} and met" in text
    assert (f"| **mean (range) over 2** |  | **{s['occlusion']['mean']:.3f}** ({s['occlusion']['min']:.3f}-"
            f"{s['occlusion']['max']:.3f}) | **{s['gradcam']['mean']:.3f}** ({s['gradcam']['min']:.3f}-"
            f"{s['gradcam']['max']:.3f}) | **{s['relevance']['mean']:.3f}** ({s['relevance']['min']:.3f}-"
            f"{s['relevance']['max']:.3f}) |") in text
    assert text.count(f"| `{data['models'][0]['model']}` | - | ") == 4   # two models, two sets; no seed known
    assert f"| {data['chance']['single_object']:.3f} | - | {cpu} | not known |" in text
    assert "| **all** | 3 | **0.333** | **0.667** | **1.000** | **0.333** | - | - | 0.250 | %s |" % cpu in text
    assert "| dog | 2 | 0.500 | 0.500 | 1.000 | 0.500 | - | - | 0.200 | %s |" % cpu in text
    assert "| young boy | 1 | - | 1.000 | - | 0.000 | - | - | 0.350 | %s |" % cpu in text
    assert "could not run on this tower: ValueError: no ViT" in text and "`python train.py --config x.yaml`" in text
    keys = {src.key for srcs in doc.sources for src in srcs}
    assert {"summary.two_object.gradcam.mean", "summary.single_object.relevance.min", "targets.single_object.met",
            "flickr8k_photos.per_noun.[young boy].gradcam", "models.1.pointing_accuracy.single_object.tokens"} <= keys

    data["flickr8k_photos"] = {"skipped": "no --photos-model given"}
    out.write_text(json.dumps(data))
    monkeypatch.setattr(results_md, "_cache", {})
    doc = results_md.Doc()
    results_md.explain_pointing(doc)
    assert "Flickr8k photos: not scored in this run (no --photos-model given)." in doc.text()


def test_results_md_leaves_the_section_out_for_the_json_before_the_seeds_study():
    """The committed JSON predates the study (one model, no summary): RESULTS.md has no such section yet, and the
    check does not trip over it."""
    have = json.loads((results_md.RESULTS_DIR / results_md.POINTING).read_text())
    rendered = "Where a query points" in results_md.document().text()
    assert rendered == ("summary" in have)
