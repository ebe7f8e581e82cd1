"""Near-duplicate finding (``clip-mini dupes``) on real photos with planted copies; the default threshold's source.

    python benchmarks/studies/dupes_planted.py [--model NAME_OR_DIR] [--images ../shared/data/flickr8k/images]

Two disjoint planted sets are cut from the Flickr8k photos (seeded): each has 500 photos, 40 of which get one
edited copy per edit of ``benchmarks/lib/planted.py`` (7 copies each, 280 copies: JPEG quality 40, resized to half,
a 10% crop, straightened by 5 degrees, a colour shift, a caption drawn across it, a screenshot-style viewer frame),
so 40 true (copy, original) pairs per edit and 40 x 28 true pairs in all (copies of one photo pair with each other
too). Each set is indexed (``EmbeddingIndex.build``), its tower features are computed as ``clip-mini dupes``
computes them (``retrieval.dupe_features.tower_features``: the image tower's patch states averaged over the middle
of the picture), and ``retrieval.dupes.find_duplicates`` (exact, single linkage: what ``clip-mini dupes`` runs below
20,000 rows) groups each kind of rows (``FEATURES``: the tower features, and the stored search embeddings) at every
threshold of a grid. On the tuning set the threshold with the highest F1 over pairs (ties: the higher threshold) is
chosen per kind; on the held-out set precision and recall over pairs, and the recall of each edit's (copy,
original) pairs, are reported at that threshold and at the command's default for that kind (``TOWER_THRESHOLD``,
``DEFAULT_THRESHOLD``), with the edits whose recall is under 0.95 named. The tower pass is timed per photo (reading
and decoding included) and its cache's size per photo recorded.

``--model``: a built-in model's name (``photos``: ``clip-mini models`` lists them; built into the user cache once,
as every ``--model`` of the CLI) or a model directory. Without one, the model is ``configs/flickr8k-vit.yaml``'s
pretrained image tower, DINOv2 ViT-S/14 ([CLS ; patch mean], 768 wide), with an identity image head (``head:
linear``, ``embed_dim`` 768, the projection set to the identity): an untrained CLIP's image side (its tower
features are the pretrained DINOv2's own). The JSON records the model's name and the commands that rebuild it. Writes
``benchmarks/results/studies/dupes_planted.json``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402
from benchmarks.lib.planted import EDITS, edit_recall, pair_scores, plant_copies  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo, scrub_paths  # noqa: E402

GRID = [round(t, 3) for t in np.arange(0.50, 0.996, 0.005)]
TARGET = 0.95   # precision and recall over pairs, and each edit's recall
STUDY = "python benchmarks/studies/dupes_planted.py"
FEATURES = ("tower", "embedding")   # the two kinds of rows ``clip-mini dupes`` can group (its --features)


def rows_described(arm: str) -> str:
    from clip_mini.retrieval.dupe_features import CENTRE, SCALE

    if arm == "embedding":
        return "the index's stored search embeddings (--features embedding)"
    return (f"the image tower's last patch states, the picture at {SCALE:.4g} times the model's input side, averaged "
            f"over the middle {CENTRE:g} of each side of the patch grid (clip_mini.retrieval.dupe_features: what "
            "--features tower, and auto with the model at hand, group)")


def tower_model(out: Path) -> Path:
    """The pretrained-tower stand-in described in the module docstring, saved as a model directory."""
    import torch

    from clip_mini.config import load_config
    from clip_mini.model.clip import CLIPModel

    cfg = load_config(ROOT / "configs/flickr8k-vit.yaml", ["model.head=linear", "model.embed_dim=768"]).model
    torch.manual_seed(0)
    model = CLIPModel.build(cfg)
    with torch.no_grad():
        model.image_head.proj.weight.copy_(torch.eye(768))
        model.image_head.proj.bias.zero_()
    model.save_pretrained(out)
    return out


def _recipe_run(recipe: str) -> str | None:
    """The run folder a training command writes (its ``--out`` or ``train.out_dir=``), when it names one."""
    try:
        words = shlex.split(recipe)
    except ValueError:
        return None
    for k, w in enumerate(words):
        if w == "--out" and k + 1 < len(words):
            return words[k + 1]
        if w.startswith(("--out=", "train.out_dir=")):
            return w.partition("=")[2]
    return None


def describe_model(spec: str | None, work: Path) -> tuple[Path, dict]:
    """The model directory ``--model`` stands for (as the CLI resolves it) and what the JSON records of it: its
    name, what it is, and the commands that rebuild it."""
    if spec is None:
        return tower_model(work / "tower_model"), {
            "name": "DINOv2 ViT-S/14 image tower (pretrained), identity head, untrained",
            "kind": "stand-in",
            "rebuild": f"{STUDY} (no --model: tower_model() builds it from configs/flickr8k-vit.yaml with "
                       "model.head=linear model.embed_dim=768 and an identity projection)"}
    from clip_mini.builtin.registry import BUILTIN_ROOT, PACKAGE_FILES, is_builtin_name, model_card, resolve_model
    from clip_mini.fileio.manifest import read_json, read_manifest

    model_dir = resolve_model(spec)   # what every --model of the CLI does: a built-in name is built once, cached
    if is_builtin_name(spec) and Path(model_dir) != Path(spec):   # a name, not a model directory called so
        card = model_card(spec)
        package = Path(BUILTIN_ROOT) / spec
        recipe = card.get("recipe") or ""
        run = _recipe_run(recipe)
        ship = f"python benchmarks/quality/ship_photo_model.py --run {run or 'RUN'} --name {spec} --final"
        return model_dir, {
            "name": spec, "kind": "built-in", "package": relative_to_repo(package),
            "fingerprint": read_manifest(package, verify=False, required=PACKAGE_FILES)["fingerprint"],
            "summary": card.get("summary"),
            "rebuild": {"train": recipe or "(not recorded on the model card)",
                        "package": ship + ("" if run else "  (RUN: the run folder the training command wrote)")}}
    info = {"name": relative_to_repo(model_dir), "kind": "model directory"}
    run = Path(model_dir).resolve().parent
    config = read_json(Path(model_dir) / "config.json") if (Path(model_dir) / "config.json").is_file() else {}
    if isinstance(config, dict) and isinstance(config.get("trained"), dict):
        info["trained"] = {k: config["trained"][k] for k in ("step", "epoch") if k in config["trained"]}
    if (run / "config.yaml").is_file():
        info["rebuild"] = (f"clip-mini train --config {relative_to_repo(run / 'config.yaml')} "
                           f"--out {relative_to_repo(run)}  (then {relative_to_repo(model_dir)})")
    else:
        info["rebuild"] = "(not recorded: the model directory is not inside a run folder with its config.yaml)"
    return model_dir, info


def planted_set(photos: list[Path], out: Path, n_planted: int, seed: int) -> dict[str, str]:
    out.mkdir(parents=True)
    for p in photos:
        os.symlink(p.resolve(), out / p.name)
    return plant_copies(photos[:n_planted], out / "copies", copies_each=len(EDITS), seed=seed)


def score(groups: list[list[str]], planted: dict[str, str]) -> dict:
    s = pair_scores(groups, planted)
    s["groups"] = len(groups)
    s["by_edit"] = edit_recall(groups, planted)
    return s


def sweep(model_dir: Path, folder: Path, planted: dict, work: Path, thresholds: dict[str, list[float]]) -> dict:
    """Index ``folder``, compute its tower features as ``clip-mini dupes`` does, and score both kinds of rows
    (``FEATURES``) at each of their thresholds."""
    from clip_mini.retrieval.dupe_features import tower_features
    from clip_mini.retrieval.dupes import find_duplicates
    from clip_mini.retrieval.index import EmbeddingIndex

    t = time.perf_counter()
    index = EmbeddingIndex.build(work, str(model_dir), folder, progress=False)
    embed_s = time.perf_counter() - t
    t = time.perf_counter()
    tower = tower_features(index, model_dir, progress=False)
    tower_s = time.perf_counter() - t
    if tower.left_out:
        r, why = next(iter(tower.left_out.items()))
        sys.exit(f"{len(tower.left_out)} images got no tower features, e.g. {index.items['path'][r]}: {why}")
    planted = {str(Path(k).resolve()): str(Path(v).resolve()) for k, v in planted.items()}
    resolved = [str(Path(p).resolve()) for p in index.items["path"]]
    missing = set(planted) | set(planted.values())
    missing -= set(resolved)
    if missing:
        sys.exit(f"{len(missing)} planted images were not indexed (unreadable?), e.g. {sorted(missing)[0]}")
    rows = {"tower": (tower.features, [resolved[r] for r in tower.rows]),
            "embedding": (index.embeddings, resolved)}
    out = {}
    for arm, (feats, paths) in rows.items():
        out[arm] = {}
        for th in thresholds[arm]:
            groups = find_duplicates(feats, th, "exact")
            out[arm][th] = score([[paths[r] for r in g.rows] for g in groups], planted)
    n = len(index)
    return {"n_rows": n, "embed_seconds": round(embed_s, 1), "tower_seconds": round(tower_s, 1),
            "tower_ms_per_photo": round(1000 * tower_s / n, 1),
            "tower_feature_bytes_per_photo": int(tower.features.shape[1] * tower.features.itemsize),
            "tower_cache_bytes_per_photo": round(tower.cache.stat().st_size / n, 1) if tower.cache else None,
            "by_threshold": out}


def f1(s: dict) -> float:
    p, r = s["precision"], s["recall"]
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def rounded(s: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else rounded(v) if isinstance(v, dict) else v)
            for k, v in s.items()}


def misses(s: dict) -> list[str]:
    """The edits whose (copy, original) recall is under ``TARGET``."""
    return [k for k, e in s["by_edit"].items() if e["recall"] < TARGET]


def verdict(threshold: float, s: dict) -> str:
    """One line: precision and recall against the targets, and the edits missed."""
    low = misses(s)
    edits = ("misses " + ", ".join(f"{k} (recall {s['by_edit'][k]['recall']:.2f})" for k in low) if low
             else f"no edit under recall {TARGET}")
    ok = s["precision"] >= TARGET and s["recall"] >= TARGET
    return (f"at {threshold}: precision {s['precision']:.3f}, recall {s['recall']:.3f} over pairs "
            f"({'meets' if ok else 'misses'} the {TARGET} targets); {edits}")


def main(argv=None) -> dict:
    from clip_mini.retrieval.dupe_features import RECIPE, TOWER_THRESHOLD
    from clip_mini.retrieval.dupes import DEFAULT_THRESHOLD

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a built-in model's name (e.g. photos) or a model directory (default: the "
                                    "pretrained-tower stand-in)")
    ap.add_argument("--images", type=Path, default=ROOT.parent / "shared/data/flickr8k/images")
    ap.add_argument("--photos", type=int, default=500, help="photos in each of the two sets")
    ap.add_argument("--planted", type=int, default=40,
                    help=f"photos of each set that get {len(EDITS)} edited copies (one per edit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/studies/dupes_planted.json")
    args = ap.parse_args(argv)
    if not 1 <= args.planted <= args.photos:
        ap.error(f"--planted must be 1 to --photos ({args.photos}), got {args.planted}")
    photos = sorted(args.images.glob("*.jpg"))
    if len(photos) < 2 * args.photos:
        sys.exit(f"need at least {2 * args.photos} photos (*.jpg) under {args.images}, found {len(photos)}")
    load_at_start = round(os.getloadavg()[0], 2)   # before the work (machine_info at the end sees torch too)
    command = scrub_paths(shlex.join(STUDY.split() + list(sys.argv[1:] if argv is None else argv)))
    pick = np.random.default_rng(args.seed).permutation(len(photos))
    tune_photos = [photos[i] for i in pick[:args.photos]]
    test_photos = [photos[i] for i in pick[args.photos:2 * args.photos]]
    defaults = {"tower": TOWER_THRESHOLD, "embedding": DEFAULT_THRESHOLD}
    thresholds = {arm: sorted(set(GRID) | {defaults[arm]}) for arm in FEATURES}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dupes-study-") as tmp:
        tmp = Path(tmp)
        model_dir, model = describe_model(args.model, tmp)
        tune = sweep(model_dir, tmp / "tune", planted_set(tune_photos, tmp / "tune", args.planted, args.seed),
                     tmp / "tune_index", thresholds)
        test = sweep(model_dir, tmp / "test", planted_set(test_photos, tmp / "test", args.planted, args.seed + 1),
                     tmp / "test_index", thresholds)
    arms = {}
    for arm in FEATURES:
        default = defaults[arm]
        by_tune, by_test = tune["by_threshold"][arm], test["by_threshold"][arm]
        chosen = max(GRID, key=lambda th: (round(f1(by_tune[th]), 6), th))
        at_chosen, at_default = by_test[chosen], by_test[default]
        arms[arm] = {
            "rows": rows_described(arm),
            "chosen_threshold_on_tuning_set": chosen,
            "tuning_at_chosen": rounded(by_tune[chosen]),
            "held_out_at_chosen": rounded(at_chosen),
            "held_out_misses_at_chosen": misses(at_chosen),
            "held_out_verdict_at_chosen": verdict(chosen, at_chosen),
            "default_threshold": default,
            "held_out_at_default": rounded(at_default),
            "held_out_misses_at_default": misses(at_default),
            "held_out_verdict_at_default": verdict(default, at_default),
            "held_out_by_threshold": {str(k): rounded(s) for k, s in by_test.items()},
        }
    result = {
        "study": "dupes_planted",
        "model": model,
        "command": command,
        "images": relative_to_repo(args.images),
        "sets": (f"2 disjoint sets of {args.photos} photos (seed {args.seed}); {args.planted} of each get one copy "
                 f"per edit ({', '.join(EDITS)}): {args.planted} (copy, original) pairs per edit"),
        "edits": list(EDITS),
        "target": TARGET,
        "tower_recipe": RECIPE,
        "features": arms,
        "tuning": {k: v for k, v in tune.items() if k != "by_threshold"},
        "held_out": {k: v for k, v in test.items() if k != "by_threshold"},
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "machine": {**machine_info(), "load_average_1min_at_start": load_at_start},
    }
    for arm, a in arms.items():
        print(f"{arm}: tuned {a['held_out_verdict_at_chosen']}", file=sys.stderr)
        print(f"{arm}: default {a['held_out_verdict_at_default']}", file=sys.stderr)
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
