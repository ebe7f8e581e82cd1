"""Zero-shot sorting with the photo model: how often ``clip-mini classify`` puts a photo in the right class.

    python benchmarks/studies/classify_flickr8k.py --model photos --demo-model runs/tiny/best
    python benchmarks/studies/classify_flickr8k.py --model photos --demo-model runs/tiny/best --final   # + test
    python benchmarks/studies/classify_flickr8k.py --model runs/photos/best --limit 40 --result /tmp/classify.json

Every score goes through the command's own code: ``clip_mini.eval.classify.classify_files`` (what ``clip-mini
classify --truth`` runs), which calls ``Embedder.classify`` and so ``Embedder.label_embeddings`` for the prompts.
Each part is scored twice: with the command's default single prompt ("a photo of a {}.") and with a prompt ensemble
(several templates averaged per label, what repeating ``--template`` does). Each row records the accuracy, the mean
per-class recall (the classes are not balanced), the recall of every class and the confusion matrix, which is also
drawn as a PNG beside the JSON.

Flickr8k (``--model``, a built-in name or a model directory): the project's val split (``load_splits`` of
``--config``, as the trainer splits; 500 photos, none trained on). Flickr8k has no class labels, so they are read
off the captions by this rule (``label_photo``):

    A photo's vote for class c is the number of its captions that contain at least one of c's keywords
    (``FLICKR_CLASSES``; case-insensitive, whole words: "dog" counts in "A dog runs" but not in "hotdog"; a
    caption counts once per class however many keywords it holds). The photo is labelled c when c has at least
    ``--min-votes`` (3) votes and every other class has fewer than that. Photos with no class at 3 votes
    (unlabelled) or with two or more (ambiguous: a dog in the snow) are left out.

The JSON records the rule, every class's keywords, how many photos each class gets and how many were left out.
Only about half of the 500 val photos get exactly one class (the rest show people doing things no class names, or
two classes at once). The train photos are never used (the model trained on them).

The test split is read only with ``--final``, which is for a final model and prompts chosen before (the built-in
``photos`` model and the ensemble above): one line of the test ledger (``clip_mini.eval.ledger.record_test_scoring``;
benchmark, model, what is scored) is written before the test split is read, and completed with the test numbers.
The test photos are labelled by the same rule and sorted into val's classes (a test photo of a class val has no
photo of would be left out and counted), and three row groups are reported, each with the single prompt and the
ensemble and each with its confusion PNGs: val (``flickr8k.rows``, as without ``--final``), test
(``flickr8k.test``) and val and test pooled (``flickr8k.pooled``: the two groups' confusion matrices summed, so
its counts are their sums). Without ``--final`` the JSON says the test split was not read.

Shapes demo (``--demo-model DIR``, optional): the generated shapes data (``--shapes``, what ``make demo`` writes)
with the generator's ``labels.csv`` as the truth, images with one object only, classified by colour (6 classes) and
by shape (4 classes), on the demo config's val split (the images the demo model did not train on) and on the
compositional split (colour-shape pairs no training caption names). Without ``--demo-model`` that part is skipped
and the JSON says so.

Writes benchmarks/results/studies/classify_flickr8k.json (with the machine, the load average at start and end, the
models and the commands that rebuild them) and its confusion-matrix PNGs beside it (``..._flickr8k_{single,ensemble}``
for val, ``..._flickr8k_test_*`` and ``..._flickr8k_pooled_*`` with ``--final``).
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402

RESULT = ROOT / "benchmarks/results/studies/classify_flickr8k.json"
MIN_VOTES = 3
# label (what goes into the prompt, as in `clip-mini classify --labels`) -> the caption keywords that vote for it.
# Chosen on the val captions for coverage and balance; a keyword is matched as a whole word (or phrase).
FLICKR_CLASSES: dict[str, tuple[str, ...]] = {
    "dog": ("dog", "dogs", "puppy", "puppies"),
    "water": ("water", "pool", "lake", "river", "pond", "stream", "fountain", "swim", "swims", "swimming", "swimmer",
              "swimmers", "splash", "splashes", "splashing"),
    "beach": ("beach", "beaches", "sand", "sandy", "shore", "ocean", "surf", "surfer", "surfers", "surfing",
              "surfboard"),
    "snow": ("snow", "snowy", "ski", "skis", "skier", "skiers", "skiing", "snowboard", "snowboarder", "snowboarders",
             "snowboarding", "sled", "sledding", "snowman"),
    "cyclist": ("bicycle", "bicycles", "bike", "bikes", "biker", "bikers", "biking", "bicyclist", "bicyclists",
                "cyclist", "cyclists", "bmx"),
    "rock climber": ("climb", "climbs", "climbing", "climber", "climbers"),
    "skateboarder": ("skateboard", "skateboards", "skateboarder", "skateboarders", "skateboarding", "skatepark",
                     "skate park"),
    "soccer player": ("soccer",),
    "basketball player": ("basketball",),
    "street": ("street", "streets", "city", "sidewalk", "crosswalk"),
}
SINGLE = ("a photo of a {}.",)   # the command's default (clip_mini.embed.DEFAULT_TEMPLATES)
FLICKR_ENSEMBLE = ("a photo of a {}.", "a photo of the {}.", "a photo of {}.", "a picture of {}.", "{}.")
SHAPES_ENSEMBLE = {"colour": ("a {} shape", "a {} object", "there is a {} shape", "a picture of a {} shape",
                              "an image showing a {} shape"),
                   "shape": ("a {}", "a {} shape", "there is a {}", "a picture of a {}", "an image showing a {}")}


# -- the Flickr8k labelling rule ----------------------------------------------------------------------------------
def keyword_pattern(keywords: Iterable[str]) -> re.Pattern:
    """One case-insensitive pattern matching any keyword as a whole word; a phrase's spaces match any whitespace."""
    words = sorted({k.strip().lower() for k in keywords if k.strip()}, key=len, reverse=True)
    if not words:
        raise ValueError("a class needs at least one keyword")
    alt = "|".join(r"\s+".join(map(re.escape, w.split())) for w in words)
    return re.compile(rf"\b(?:{alt})\b", re.IGNORECASE)


def caption_votes(captions: Sequence[str], patterns: Mapping[str, re.Pattern]) -> dict[str, int]:
    """For each class, how many of ``captions`` name it (at most one vote per caption and class)."""
    return {c: sum(bool(p.search(str(cap))) for cap in captions) for c, p in patterns.items()}


def label_photo(captions: Sequence[str], patterns: Mapping[str, re.Pattern], min_votes: int = MIN_VOTES
                ) -> tuple[Optional[str], list[str]]:
    """``(label, classes at min_votes or more)``: the label is the one class with at least ``min_votes`` votes,
    None when no class or more than one class reaches that."""
    votes = caption_votes(captions, patterns)
    reached = [c for c, v in votes.items() if v >= min_votes]
    return (reached[0] if len(reached) == 1 else None), reached


def label_photos(captions_by_photo: Mapping[str, Sequence[str]], classes: Mapping[str, Iterable[str]],
                 min_votes: int = MIN_VOTES) -> tuple[dict[str, str], dict]:
    """``({photo: label}, counts)`` for the photos ``label_photo`` labels; counts holds ``per_class`` (in
    ``classes`` order), ``labelled``, ``unlabelled`` (no class reached ``min_votes``), ``ambiguous`` (two or more
    did) and ``photos``."""
    if min_votes < 1:
        raise ValueError(f"min_votes must be at least 1, got {min_votes}")
    patterns = {c: keyword_pattern(k) for c, k in classes.items()}
    labels, unlabelled, ambiguous = {}, 0, 0
    for photo, caps in captions_by_photo.items():
        label, reached = label_photo(caps, patterns, min_votes)
        if label is not None:
            labels[photo] = label
        elif reached:
            ambiguous += 1
        else:
            unlabelled += 1
    per_class = {c: sum(v == c for v in labels.values()) for c in classes}
    return labels, {"photos": len(captions_by_photo), "labelled": len(labels), "unlabelled": unlabelled,
                    "ambiguous": ambiguous, "per_class": per_class}


def take(truth: Mapping[str, str], labels: Sequence[str], limit: Optional[int]) -> list[str]:
    """The photos to score, sorted by path; with ``limit``, that many taken in turn from each class (a short check
    still sees every class)."""
    by_class = {c: sorted(p for p, t in truth.items() if t == c) for c in labels}
    if limit is None:
        return sorted(truth)
    out, k = [], 0
    while len(out) < min(limit, len(truth)):
        out += [ps[k] for ps in by_class.values() if k < len(ps)][:limit - len(out)]
        k += 1
    return sorted(out)


# -- scoring ------------------------------------------------------------------------------------------------------
def score_row(embedder, paths: Sequence[str], truth: Mapping[str, str], labels: Sequence[str],
              templates: Sequence[str], prompts: str, png: Path, title: str) -> dict:
    """One row: ``classify_files`` (the command's code) on ``paths`` against ``truth``, and its confusion PNG."""
    from clip_mini.eval.classify import classify_files

    out = classify_files(embedder, paths, labels, templates, top=2,
                         truth={str(Path(p).resolve()): t for p, t in truth.items()})
    return confusion_row(out["confusion"], labels, templates, prompts, png, title, sorted(out["skipped"]))


def confusion_row(confusion, labels: Sequence[str], templates: Sequence[str], prompts: str, png: Path, title: str,
                  unreadable: Sequence[str] = ()) -> dict:
    """A row's numbers from its confusion matrix (rows: the true class, columns: the predicted one): accuracy,
    the recall of every class and their mean over the classes that have photos; and the matrix drawn as ``png``."""
    from clip_mini.pictures.draw import confusion_png

    m = np.asarray(confusion)
    n = int(m.sum())
    accuracy = float(np.trace(m) / n) if n else float("nan")
    n_true = m.sum(1)
    recall = {c: (round(float(m[i, i] / n_true[i]), 4) if n_true[i] else None) for i, c in enumerate(labels)}
    defined = [r for r in recall.values() if r is not None]
    confusion_png(m, labels, png, title=f"{title}: accuracy {accuracy:.3f} on {n} images")
    return {"prompts": prompts, "templates": list(templates), "images": n, "unreadable": list(unreadable),
            "accuracy": round(accuracy, 4), "mean_class_recall": round(float(np.mean(defined)), 4),
            "recall": recall, "confusion": m.tolist(), "confusion_png": png.name}


def pooled_rows(groups: Sequence[Mapping], labels: Sequence[str], out_dir: Path, stem: str) -> list[dict]:
    """The rows of the photos of ``groups`` together (val and test): each prompt's confusion matrices summed (the
    same label list, templates and per-photo predictions as the groups' own rows; nothing is classified again)."""
    rows = []
    for i, first in enumerate(groups[0]["rows"]):
        parts = [g["rows"][i] for g in groups]
        if any(r["prompts"] != first["prompts"] or r["templates"] != first["templates"] for r in parts):
            raise ValueError("pooled rows need the same prompts in every group")
        m = sum(np.asarray(r["confusion"]) for r in parts)
        rows.append(confusion_row(m, labels, first["templates"], first["prompts"],
                                  out_dir / f"{stem}_flickr8k_pooled_{first['prompts']}.png",
                                  f"Flickr8k val+test, {first['prompts']} prompt",
                                  [u for r in parts for u in r["unreadable"]]))
    return rows


def label_split(frame, min_votes: int) -> tuple[dict[str, str], dict]:
    """``label_photos`` on one split's caption table (columns ``path``, ``caption``)."""
    captions = {p: list(g["caption"]) for p, g in frame.groupby("path", sort=True)}
    return label_photos(captions, FLICKR_CLASSES, min_votes)


def score_group(embedder, args, truth: Mapping[str, str], labels: Sequence[str], name: str, out_dir: Path,
                stem: str) -> dict:
    """One group of photos (a split) scored with the single prompt and the ensemble: ``scored`` (photos per
    class, after ``--limit``) and ``rows``. Val keeps the PNG names it had before test could be scored."""
    paths = take(truth, labels, args.limit)
    scored = {p: truth[p] for p in paths}
    suffix = "" if name == "val" else f"_{name}"
    rows = []
    for prompts, templates in (("single", SINGLE), ("ensemble", args.template or FLICKR_ENSEMBLE)):
        rows.append(score_row(embedder, paths, scored, labels, templates, prompts,
                              out_dir / f"{stem}_flickr8k{suffix}_{prompts}.png", f"Flickr8k {name}, {prompts} prompt"))
        print(f"flickr8k {name} {prompts}: accuracy {rows[-1]['accuracy']:.3f}, mean class recall "
              f"{rows[-1]['mean_class_recall']:.3f} on {rows[-1]['images']} photos", flush=True)
    return {"scored": {c: sum(scored[p] == c for p in paths) for c in labels}, "rows": rows}


def model_record(spec: str, recipe: Optional[str]) -> dict:
    """What model ``spec`` is (a built-in name with its package fingerprint, or a directory with its manifest's
    fingerprint) and the command that rebuilds it: ``recipe`` when given, else the built-in card's recipe, else
    training the run's saved config (``DIR/../config.yaml``) when there is one."""
    from clip_mini.builtin.registry import BUILTIN_ROOT, PACKAGE_FILES, is_builtin_name, model_card, resolve_model
    from clip_mini.fileio.manifest import read_manifest

    if is_builtin_name(spec):
        card = model_card(spec)
        fp = read_manifest(Path(BUILTIN_ROOT) / spec, verify=False, required=PACKAGE_FILES)["fingerprint"]
        return {"name": spec, "kind": "built-in", "package_fingerprint": fp, "summary": card.get("summary"),
                "step": card.get("step"), "delta_rank": card.get("delta_rank"),
                "rebuild": recipe or card.get("recipe") or None,
                "packaged_by": "python benchmarks/quality/ship_photo_model.py --run RUN (the run the recipe trains)"}
    path = resolve_model(spec)   # a directory, or the registry's error naming the built-in models
    run_config = path.parent / "config.yaml"
    return {"name": str(spec), "kind": "directory", "fingerprint": read_manifest(path, verify=False)["fingerprint"],
            "rebuild": recipe or (f"clip-mini train --config {run_config}" if run_config.is_file() else None)}


def check_same_split(model: str, cfg) -> Optional[str]:
    """Refuse a model directory whose run split the captions differently from ``cfg`` (its val would hold photos
    it trained on); returns the run config checked, or None when the model has none beside it."""
    from clip_mini.builtin.registry import is_builtin_name
    from clip_mini.config import load_config
    from clip_mini.eval.scoring import EvalError

    run_config = Path(model).parent / "config.yaml"
    if is_builtin_name(model) or not run_config.is_file():
        return None
    run = load_config(run_config).data
    keys = ("val", "test", "seed", "val_list", "test_list")
    differ = [k for k in keys if getattr(run, k) != getattr(cfg.data, k)]
    if differ:
        raise EvalError(f"{run_config}: the model's run split the data with "
                        + ", ".join(f"data.{k}={getattr(run, k)!r}" for k in differ) + " but the study's config has "
                        + ", ".join(f"data.{k}={getattr(cfg.data, k)!r}" for k in differ)
                        + ": its val would not be the photos it held out; pass that config with --config")
    return str(run_config)


def flickr_part(args, out_dir: Path, stem: str, model: Optional[dict] = None) -> dict:
    """The Flickr8k rows: val always; with ``args.final`` also test (inside one test-ledger line, written before
    the test split is read) and val+test pooled."""
    from clip_mini.config import load_config
    from clip_mini.data import load_splits
    from clip_mini.embed import load

    cfg = load_config(args.config, [f"data.captions={args.captions}"])
    checked = check_same_split(args.model, cfg)   # before anything slow
    splits = load_splits(cfg, progress=False)
    truth, counts = label_split(splits["val"], args.min_votes)
    labels = [c for c in FLICKR_CLASSES if counts["per_class"][c]]   # val's classes: test and pooled use them too
    embedder = load(args.model, device=args.device, batch_size=args.batch_size)
    val = score_group(embedder, args, truth, labels, "val", out_dir, stem)
    out = {"precision": embedder.precision, "split": "val", "config": str(args.config), "captions": str(args.captions),
           "run_config_checked": checked, "val_photos": counts["photos"],
           "rule": {"min_votes": args.min_votes, "text": (
               f"a photo is labelled c when at least {args.min_votes} of its captions contain one of c's keywords "
               f"(whole words, case-insensitive) and no other class has {args.min_votes}; other photos are left "
               "out"), "keywords": {c: list(k) for c, k in FLICKR_CLASSES.items()}},
           "labelled": counts["labelled"], "unlabelled": counts["unlabelled"], "ambiguous": counts["ambiguous"],
           "counts": counts["per_class"], "labels": labels, "scored": val["scored"], "rows": val["rows"]}
    if not args.final:
        out["test_split"] = "not read (run without --final)"
        return out
    out["split"] = "val, test (--final)"
    out["test"], out["ledger"] = score_test(embedder, args, cfg, splits, labels, out_dir, stem, model)
    out["test_split"] = "read with --final, inside one test-ledger line written before it was read"
    out["pooled"] = {"splits": ["val", "test"], "photos": counts["photos"] + out["test"]["photos"],
                     "labelled": counts["labelled"] + out["test"]["labelled"],
                     "scored": {c: val["scored"][c] + out["test"]["scored"][c] for c in labels},
                     "rows": pooled_rows([val, out["test"]], labels, out_dir, stem)}
    for r in out["pooled"]["rows"]:
        print(f"flickr8k val+test {r['prompts']}: accuracy {r['accuracy']:.3f}, mean class recall "
              f"{r['mean_class_recall']:.3f} on {r['images']} photos", flush=True)
    return out


def score_test(embedder, args, cfg, splits, labels: Sequence[str], out_dir: Path, stem: str,
               model: Optional[dict]) -> tuple[dict, dict]:
    """``(test group, ledger record)``: the test split's photos labelled by the same rule and scored like val,
    inside one line of the test ledger (``record_test_scoring``), which goes out before ``splits["test"]`` is
    read. Test photos whose class has no val photo are left out (counted): every group sorts into val's classes."""
    from clip_mini.eval.ledger import LEDGER, config_hash, record_test_scoring, repo_relative

    variant = f"builtin:{model['name']}" if model and model.get("kind") == "built-in" else str(args.model)
    with record_test_scoring(variant=variant, source="benchmarks/studies/classify_flickr8k.py --final",
                             config=args.config, config_hash=config_hash(cfg.to_dict()),
                             benchmark="classify_flickr8k", model=model or {"name": str(args.model)},
                             scored="zero-shot classify accuracy and mean class recall on the test photos labelled "
                                    "from their captions (the val rule), single prompt and ensemble") as line:
        test_truth, counts = label_split(splits["test"], args.min_votes)
        outside = {p: c for p, c in test_truth.items() if c not in labels}
        truth = {p: c for p, c in test_truth.items() if c in labels}
        group = score_group(embedder, args, truth, labels, "test", out_dir, stem)
        line.test = {r["prompts"]: {k: r[k] for k in ("accuracy", "mean_class_recall", "images")}
                     for r in group["rows"]}
        line.test_images = group["rows"][0]["images"]
    test = {"photos": counts["photos"], "labelled": counts["labelled"] - len(outside),
            "unlabelled": counts["unlabelled"], "ambiguous": counts["ambiguous"],
            "outside_val_classes": len(outside), "counts": {c: counts["per_class"][c] for c in labels}, **group}
    return test, {"path": repo_relative(LEDGER), "id": line.id, "variant": variant}


def shapes_truth(shapes: Path, config: Path, limit: Optional[int]) -> dict[str, dict]:
    """``{set: {"attribute": {image path: value}}}`` for the one-object images of the demo config's val split
    and of the compositional split, read from the generator's ``labels.csv``."""
    import pandas as pd

    from clip_mini.config import load_config
    from clip_mini.data import load_splits
    from clip_mini.data.readers import DataError

    labels_csv = shapes / "labels.csv"
    if not labels_csv.is_file():
        raise DataError(f"{labels_csv} not found: --shapes must be the generator's output folder "
                        "(python -m clip_mini.data.synthetic --out data/shapes --n 10000)")
    table = pd.read_csv(labels_csv, dtype=str, keep_default_na=False)
    missing = {"image", "split", "n_objects", "colour", "shape"} - set(table.columns)
    if missing:
        raise DataError(f"{labels_csv}: no column(s) {sorted(missing)}; it is not the shapes generator's labels.csv")
    cfg = load_config(config, [f"data.captions={shapes / 'captions.csv'}"])
    val_images = set(load_splits(cfg, progress=False)["val"]["image"])
    one = table[table["n_objects"] == "1"]
    sets = {"val": one[one["image"].isin(val_images)], "compositional": one[one["split"] == "comp"]}
    out = {}
    for name, rows in sets.items():
        out[name] = {}
        for attr in ("colour", "shape"):
            truth = {str(shapes / "images" / img): v for img, v in zip(rows["image"], rows[attr])}
            values = sorted(set(truth.values()))
            out[name][attr] = {p: truth[p] for p in take(truth, values, limit)}
    return out


def shapes_part(args, out_dir: Path, stem: str) -> dict:
    from clip_mini.data.synthetic import COLOURS, SHAPES
    from clip_mini.embed import load

    demo = Path(args.demo_model)
    config = Path(args.demo_config) if args.demo_config else (
        demo.parent / "config.yaml" if (demo.parent / "config.yaml").is_file() else ROOT / "configs/tiny.yaml")
    truth = shapes_truth(Path(args.shapes), config, args.limit)
    embedder = load(str(demo), device=args.device, batch_size=args.batch_size)
    order = {"colour": list(COLOURS), "shape": list(SHAPES)}
    sets = []
    for name, by_attr in truth.items():
        for attr, t in by_attr.items():
            labels = [v for v in order[attr] if v in set(t.values())]
            rows = []
            for prompts, templates in (("single", SINGLE), ("ensemble", SHAPES_ENSEMBLE[attr])):
                rows.append(score_row(embedder, sorted(t), t, labels, templates, prompts,
                                      out_dir / f"{stem}_shapes_{name}_{attr}_{prompts}.png",
                                      f"shapes {name}, {attr}, {prompts} prompt"))
                print(f"shapes {name} {attr} {prompts}: accuracy {rows[-1]['accuracy']:.3f} on "
                      f"{rows[-1]['images']} images", flush=True)
            sets.append({"set": name, "attribute": attr, "labels": labels,
                         "counts": {c: sum(v == c for v in t.values()) for c in labels}, "rows": rows})
    return {"model": model_record(str(demo), args.demo_recipe), "precision": embedder.precision,
            "data": str(args.shapes), "config": str(config),
            "sets_note": "one-object images only; val: the demo config's val split (not trained on); compositional: "
                         "compositional_test.csv, first objects of colour-shape pairs no training caption names",
            "sets": sets}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="photos", help="the photo model: a built-in name or a model directory")
    p.add_argument("--model-recipe", help="the command that rebuilds --model (default: the built-in card's recipe, "
                                          "or `clip-mini train` on the run's saved config)")
    p.add_argument("--config", default=str(ROOT / "configs/flickr8k-vit.yaml"),
                   help="the val split (and test, with --final) comes from here")
    p.add_argument("--captions", default=str(ROOT.parent / "shared/data/flickr8k/captions.csv"))
    p.add_argument("--min-votes", type=int, default=MIN_VOTES, help="captions of 5 that must name the class")
    p.add_argument("--template", action="append", help="the Flickr8k ensemble's templates (repeatable; default: "
                                                       + "; ".join(FLICKR_ENSEMBLE) + ")")
    p.add_argument("--demo-model", help="the shapes demo model directory (e.g. runs/tiny/best); none: part skipped")
    p.add_argument("--demo-recipe", help="the command that rebuilds --demo-model (default: `clip-mini train` on "
                                         "its run's saved config)")
    p.add_argument("--demo-config", help="the demo's val split comes from here (default: the run's config.yaml "
                                         "beside --demo-model, else configs/tiny.yaml)")
    p.add_argument("--shapes", default=str(ROOT / "data/shapes"), help="the generated shapes data (make demo)")
    p.add_argument("--limit", type=int, help="at most this many images per scored set (a quick check; needs "
                                             "--result, so the study's JSON is not replaced)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--final", action="store_true",
                   help="also score the TEST split's photos (same rule, val's classes) and val+test pooled, inside "
                        "one line of the test ledger written before test is read; only for a final, val-chosen "
                        "model and prompts")
    p.add_argument("--result", default=str(RESULT))
    args = p.parse_args(argv)
    if args.limit is not None and (args.limit < 1 or Path(args.result).resolve() == RESULT.resolve()):
        p.error("--limit must be positive and comes with --result elsewhere than the study's own JSON")
    if args.min_votes < 1:
        p.error("--min-votes must be at least 1")
    if args.final and args.limit is not None:
        p.error("--final scores the whole test split once (a ledger line); a --limit check runs without it")

    from benchmarks.lib.repo_paths import scrub_paths
    from clip_mini.embed import check_templates

    if args.template:
        check_templates(args.template)
    t0 = time.time()
    result_path = Path(args.result)
    out_dir, stem = result_path.parent, result_path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    result = {"benchmark": "classify_flickr8k", "machine": machine_info(),
              "command": shlex.join(["python", "benchmarks/studies/classify_flickr8k.py", *given]),
              "limit": args.limit, "implementation": "clip_mini.eval.classify.classify_files -> Embedder.classify"}
    result["model"] = model_record(args.model, args.model_recipe)
    result["flickr8k"] = flickr_part(args, out_dir, stem, result["model"])
    result["shapes"] = (shapes_part(args, out_dir, stem) if args.demo_model else
                        {"skipped": "no --demo-model given"})
    result["wall_s"] = round(time.time() - t0, 1)
    return write_result(result_path, scrub_paths(result))   # adds the load average at the end


if __name__ == "__main__":
    main()
