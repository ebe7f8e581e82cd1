"""clip-mini classify / Embedder.classify: zero-shot sorting of real shapes images by colour, and bad input."""
from __future__ import annotations

import csv
import math
import shutil

import numpy as np
import pytest

from clip_mini.cli.main import main

COLOURS = ["red", "green", "blue", "yellow", "purple", "cyan"]
TEMPLATES = [a for s in ("circle", "square", "triangle", "star") for a in ("--template", f"a {{}} {s}")]


@pytest.fixture(scope="module")
def folder(shapes_dir, shapes_splits, tmp_path_factory):
    """Held-out single-object images (never trained on), a truth CSV by colour, and one unreadable file."""
    from pathlib import Path

    root = tmp_path_factory.mktemp("classify")
    images = root / "images"
    images.mkdir()
    held_out = {Path(p).name for split in ("val", "test") for p in shapes_splits[split]["path"]}
    truth = []
    with open(shapes_dir / "labels.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["image"] in held_out and r["n_objects"] == "1" and len(truth) < 120:
                shutil.copy2(shapes_dir / "images" / r["image"], images / r["image"])
                truth.append((r["image"], r["colour"]))
    (images / "broken.png").write_bytes(b"\x89PNG truncated")
    with open(root / "truth.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "label")] + truth)
    return root


def test_classify_cli_writes_csv_and_scores_truth(trained_model_dir, folder, tmp_path, capsys):
    out = tmp_path / "labels.csv"
    assert main(["classify", "--model", str(trained_model_dir), "--images", str(folder / "images"),
                 "--labels", ",".join(COLOURS), *TEMPLATES, "--out", str(out), "--top", "3",
                 "--truth", str(folder / "truth.csv"), "-q"]) == 0
    captured = capsys.readouterr()
    assert "broken.png" in captured.err and "skipped unreadable" in captured.err
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == ["path", "label", "score", "runner_up", "runner_up_score", "label_3", "score_3"]
    assert len(rows) == 120 and all(r["label"] in COLOURS and r["runner_up"] != r["label"] for r in rows)
    assert all(1 >= float(r["score"]) >= float(r["runner_up_score"]) >= float(r["score_3"]) >= 0 for r in rows)
    truth = dict(csv.reader(open(folder / "truth.csv")))
    acc = np.mean([truth[r["path"].rsplit("/", 1)[-1]] == r["label"] for r in rows])
    assert acc > 0.8   # chance is 1/6
    assert f"accuracy {100 * acc:.2f}% on 120 images" in captured.out
    from PIL import Image

    assert Image.open(tmp_path / "labels_confusion.png").size[0] > 200


def test_python_classify_matches_cli(trained_model_dir, folder, tmp_path, capsys):
    import clip_mini

    templates = TEMPLATES[1::2]
    paths = sorted(str(p) for p in (folder / "images").glob("*.png") if p.name != "broken.png")[:20]
    rows = clip_mini.load(trained_model_dir).classify(paths, COLOURS, template=templates)
    out = tmp_path / "cli.csv"
    sub = tmp_path / "sub"
    sub.mkdir()
    for p in paths:
        shutil.copy2(p, sub)
    assert main(["classify", "--model", str(trained_model_dir), "--images", str(sub), "--labels",
                 ",".join(COLOURS), *TEMPLATES, "--out", str(out), "-q"]) == 0
    cli = list(csv.DictReader(open(out)))
    assert [r["label"] for r in rows] == [r["label"] for r in cli]
    assert np.allclose([r["score"] for r in rows], [float(r["score"]) for r in cli], atol=1e-5)
    assert all(r["top"] == [(r["label"], r["score"]), (r["runner_up"], r["runner_up_score"])] for r in rows)
    # the scores are probabilities over the labels: the softmax of the cosines times the model's logit scale
    e = clip_mini.load(trained_model_dir)
    every = e.classify(paths, COLOURS, template=templates, top=len(COLOURS))
    logits = e.encode_image(paths) @ e.label_embeddings(COLOURS, templates).T * float(e.model.scale().detach())
    want = np.exp(logits - logits.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    for r, p in zip(every, want):
        assert sum(s for _, s in r["top"]) == pytest.approx(1, abs=1e-5)
        assert dict(r["top"]) == pytest.approx(dict(zip(COLOURS, p.tolist())), abs=1e-5)
        assert [s for _, s in r["top"]] == sorted((s for _, s in r["top"]), reverse=True)


def test_template_ensemble_averages_normalised_prompts(model_dir):
    import clip_mini

    e = clip_mini.load(model_dir)
    rows = e.label_embeddings(["red", "blue"], ["a {} circle", "a {} star"])
    prompts = e.encode_text(["a red circle", "a red star"])
    want = prompts.mean(0) / np.linalg.norm(prompts.mean(0))
    assert np.allclose(rows[0], want, atol=1e-6) and np.allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--labels", ""], "--labels is empty"),
    (["--labels", "red,   ,blue"], "--labels item 2 is only spaces"),
    (["--labels", "red,blue,red"], "repeats --labels item 1"),
    (["--labels", "red"], "at least 2 labels"),
    ([], "no labels given"),
    (["--labels", "red,blue", "--template", "a photo"], "has no {}"),
    (["--labels", "red,blue", "--top", "3"], "--top 3 is more than the 2 labels"),
])
def test_classify_bad_labels(model_dir, folder, tmp_path, capsys, argv, message):
    out = tmp_path / "labels.csv"
    out.write_text("kept\n")
    assert main(["classify", "--model", str(model_dir), "--images", str(folder / "images"), "--out", str(out),
                 *argv]) == 2
    assert message in capsys.readouterr().err
    assert out.read_text() == "kept\n"   # nothing written over


def test_classify_labels_file_and_bad_lines(model_dir, folder, tmp_path, capsys):
    f = tmp_path / "labels.txt"
    f.write_text("red\n  \nblue\n")
    assert main(["classify", "--model", str(model_dir), "--images", str(folder / "images"),
                 "--labels-file", str(f), "--out", str(tmp_path / "o.csv")]) == 2
    assert f"{f} line 2 is only spaces" in capsys.readouterr().err
    f.write_text("red\nblue\n\n")
    assert main(["classify", "--model", str(model_dir), "--images", str(folder / "images"),
                 "--labels-file", str(f), "--out", str(tmp_path / "o.csv"), "-q"]) == 0
    assert {r["label"] for r in csv.DictReader(open(tmp_path / "o.csv"))} <= {"red", "blue"}


def test_classify_truth_with_unknown_label(model_dir, folder, tmp_path, capsys):
    truth = tmp_path / "truth.csv"
    truth.write_text("path,label\n" + next((folder / "images").glob("*.png")).name + ",magenta\n")
    assert main(["classify", "--model", str(model_dir), "--images", str(folder / "images"), "--labels",
                 "red,blue", "--truth", str(truth), "--out", str(tmp_path / "o.csv")]) == 2
    assert "magenta" in capsys.readouterr().err


def test_embedder_classify_input_checks(model_dir, folder):
    import clip_mini
    from clip_mini.embed import InputError

    e = clip_mini.load(model_dir)
    img = str(next((folder / "images").glob("train_*.png"), next((folder / "images").glob("*_0*.png"))))
    with pytest.raises(InputError, match="label list is empty"):
        e.classify(img, [])
    with pytest.raises(InputError, match="label 2 is only spaces"):
        e.classify(img, ["red", "   "])
    with pytest.raises(InputError, match="one string"):
        e.classify(img, "red,blue")
    with pytest.raises(InputError, match="image 1"):
        e.classify([img, str(folder / "images" / "broken.png")], ["red", "blue"])
    rows, failed = e.classify([img, str(folder / "images" / "broken.png")], ["red", "blue"], on_error="skip")
    assert len(rows) == 1 and list(failed) == [1]
    single = e.classify(img, ["red", "blue"], top=1)
    assert single["runner_up"] == "" and math.isnan(single["runner_up_score"])
