"""Which tower features ``clip-mini dupes`` reads: the picture's size and the share of the patch grid averaged.

    python benchmarks/studies/dupes_recipe.py [--model photos] [--images ../shared/data/flickr8k/images]

Chosen on planted sets that ``dupes_planted.py`` does not score: its tuning set (photos 0-499 of its seeded
permutation of the Flickr8k photos, planted with seed 0) and a selection set (photos 1000-1499, planted with seed
2: 40 photos with one copy per edit of ``benchmarks/lib/planted.py``). Its held-out set (photos 500-999) is never
read here. For each picture size (the model's input side times each of ``SCALES``, rounded to whole patches) one
tower pass per image gives its last patch states (``ImageEncoder.token_grid``); each recipe pools them into one
unit row: the middle k x k cells of the n x n grid averaged (``dupe_features.centre_rows`` with share k / n, for
k = 3 .. n; k = n is the plain patch mean), or the tower's own pooling before the projection head ([CLS ; patch
mean] for ``photos``) at the model's size. For each recipe the threshold with the best F1 over pairs on the tuning
set (``dupes_planted.GRID``, single linkage as ``clip-mini dupes`` groups) is scored on the selection set; the
recipe with the best F1 there (ties: the smaller picture, then the larger share) is the one to use, and
``clip_mini.retrieval.dupe_features`` says which it uses.
Writes ``benchmarks/results/studies/dupes_recipe.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
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
from benchmarks.lib.planted import EDITS, edit_kind, pair_scores  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo, scrub_paths  # noqa: E402
from benchmarks.studies.dupes_planted import GRID, describe_model, f1, planted_set  # noqa: E402

SCALES = (1.0, 4 / 3)
STUDY = "python benchmarks/studies/dupes_recipe.py"


def token_grids(model_dir: Path, files: list[str], scale: float) -> np.ndarray:
    """(N, n, n, D) float16 last patch states of each file at ``scale`` times the model's side."""
    import torch

    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.embed import load

    embedder = load(model_dir, device="cpu")
    model = embedder.model
    patch = model.cfg.vision.patch_size
    side = max(1, round(model.preprocess.image_size * scale / patch)) * patch
    transform = build_eval_transform(dataclasses.replace(model.preprocess, image_size=side))
    out = []
    for start in range(0, len(files), 32):
        pixels = torch.stack([transform(load_image(f, min_size=side)) for f in files[start:start + 32]])
        with torch.inference_mode():
            out.append(model.visual.token_grid(pixels).half().numpy())
    return np.concatenate(out)


def centre(grids: np.ndarray, k: int) -> np.ndarray:
    """The middle k x k cells of each n x n grid averaged, as float16 unit rows (``dupe_features.centre_rows``)."""
    import torch

    from clip_mini.retrieval.dupe_features import centre_rows

    return centre_rows(torch.from_numpy(grids), k / grids.shape[1]).numpy().astype(np.float16)


class Scorer:
    """``pair_scores`` and ``edit_recall`` (benchmarks/lib/planted.py) of single-linkage groups, over row numbers."""

    def __init__(self, files: list[str], planted: dict[str, str]):
        at = {f: i for i, f in enumerate(files)}
        self.family = np.arange(len(files))
        self.copies = []
        for copy, src in planted.items():
            self.family[at[copy]] = at[src]
            self.copies.append((at[copy], at[src], edit_kind(copy)))
        counts = np.bincount(self.family)
        self.true_pairs = int((counts * (counts - 1) // 2).sum())

    def __call__(self, groups) -> dict:
        found = correct = 0
        label = np.arange(len(self.family)) + len(self.family)   # ungrouped rows: a label of their own
        for k, g in enumerate(groups):
            rows = np.asarray(g.rows)
            label[rows] = k
            found += len(rows) * (len(rows) - 1) // 2
            c = np.bincount(self.family[rows])
            correct += int((c * (c - 1) // 2).sum())
        by_edit = {e: [0, 0] for e in EDITS}
        for c, o, e in self.copies:
            by_edit[e][0] += 1
            by_edit[e][1] += int(label[c] == label[o])
        return {"true_pairs": self.true_pairs, "found_pairs": found, "correct_pairs": correct,
                "precision": correct / found if found else 1.0, "recall": correct / self.true_pairs,
                "by_edit": {e: {"pairs": p, "found": f, "recall": f / p} for e, (p, f) in by_edit.items() if p}}


def main(argv=None) -> dict:
    from clip_mini.retrieval.dupes import find_duplicates

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="photos", help="a built-in model's name or a model directory")
    ap.add_argument("--images", type=Path, default=ROOT.parent / "shared/data/flickr8k/images")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/studies/dupes_recipe.json")
    args = ap.parse_args(argv)
    photos = sorted(args.images.glob("*.jpg"))
    if len(photos) < 1500:
        sys.exit(f"need at least 1500 photos (*.jpg) under {args.images}, found {len(photos)}")
    load_at_start = round(os.getloadavg()[0], 2)
    command = scrub_paths(shlex.join(STUDY.split() + list(sys.argv[1:] if argv is None else argv)))
    pick = np.random.default_rng(0).permutation(len(photos))   # dupes_planted's permutation (its --seed 0)
    sets = {"tuning": ([photos[i] for i in pick[:500]], 0), "selection": ([photos[i] for i in pick[1000:1500]], 2)}
    t0 = time.perf_counter()
    rows: dict[str, dict[tuple, np.ndarray]] = {s: {} for s in sets}
    scorers = {}
    with tempfile.TemporaryDirectory(prefix="dupes-recipe-") as tmp:
        tmp = Path(tmp)
        model_dir, model = describe_model(args.model, tmp)
        for name, (chosen, seed) in sets.items():
            planted = planted_set(chosen, tmp / name, 40, seed)
            # the originals are links to the photos, which the planted map names: both resolved, as dupes_planted does
            files = sorted(str(p.resolve()) for p in (tmp / name).rglob("*") if p.suffix in (".jpg", ".png"))
            planted = {str(Path(c).resolve()): str(Path(o).resolve()) for c, o in planted.items()}
            scorers[name] = Scorer(files, planted)
            for scale in SCALES:
                grids = token_grids(model_dir, files, scale)
                n = grids.shape[1]
                for k in range(3, n + 1):
                    rows[name][("centre", k, n, scale)] = centre(grids, k)
                if scale == 1.0:   # the tower's own pooling, what the projection head reads
                    rows[name][("tower", 0, n, scale)] = _tower_pooling(model_dir, files)
            if name == "tuning":   # the fast scorer is pair_scores, checked once
                groups = find_duplicates(next(iter(rows[name].values())), 0.85, "exact")
                ref = pair_scores([[files[r] for r in g.rows] for g in groups], planted)
                mine = scorers[name](groups)
                assert all(ref[k] == mine[k] for k in ref), (ref, mine)
    results = []
    for recipe in rows["tuning"]:
        tune = {th: scorers["tuning"](find_duplicates(rows["tuning"][recipe], th, "exact")) for th in GRID}
        chosen = max(GRID, key=lambda th: (round(f1(tune[th]), 6), th))
        sel = scorers["selection"](find_duplicates(rows["selection"][recipe], chosen, "exact"))
        kind, k, n, scale = recipe
        cells = f"{k} x {k} of {n} x {n}" if kind == "centre" else "the tower's pooling"
        results.append({"pooling": kind, "cells": cells,
                        "share": round(k / n, 4) if kind == "centre" else None, "scale": round(scale, 4),
                        "threshold": chosen, "tuning_f1": round(f1(tune[chosen]), 4),
                        "selection": {"precision": round(sel["precision"], 4), "recall": round(sel["recall"], 4),
                                      "f1": round(f1(sel), 4),
                                      "border_recall": round(sel["by_edit"]["border"]["recall"], 4)}})
        print(f"{kind} {results[-1]['cells']} x{scale:.3g}: th {chosen} selection F1 {f1(sel):.3f}", file=sys.stderr)
    best = max(results, key=lambda r: (r["selection"]["f1"], -r["scale"], r["share"] or 0))
    result = {"study": "dupes_recipe", "model": model, "command": command, "images": relative_to_repo(args.images),
              "sets": "tuning: photos 0-499 of dupes_planted's permutation (seed 0), planted with seed 0; selection: "
                      "photos 1000-1499, planted with seed 2; 40 photos of each get one copy per edit",
              "chosen": best, "recipes": results, "wall_seconds": round(time.perf_counter() - t0, 1),
              "machine": {**machine_info(), "load_average_1min_at_start": load_at_start}}
    print(f"best on the selection set: {best}", file=sys.stderr)
    return write_result(args.out, result)


def _tower_pooling(model_dir: Path, files: list[str]) -> np.ndarray:
    """Unit rows of the tower's own pooling (``model.vision.pooling``: [CLS ; patch mean] for photos) at the model's
    own size, before the projection head."""
    import torch

    from clip_mini.data import load_image
    from clip_mini.embed import load

    embedder = load(model_dir, device="cpu")
    out = []
    for start in range(0, len(files), 32):
        pixels = torch.stack([embedder.transform(load_image(f)) for f in files[start:start + 32]])
        with torch.inference_mode():
            out.append(embedder.model.visual(pixels).numpy())
    feats = np.concatenate(out)
    return (feats / np.linalg.norm(feats, axis=1, keepdims=True)).astype(np.float16)


if __name__ == "__main__":
    main()
