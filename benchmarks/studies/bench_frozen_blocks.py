"""Fine-tuning the last k blocks of the DINOv2 ViT-S/14 tower on stored token states: per-step pairs/s and val
rsum for k = 0, 1, 2 (4), and what fits a 30-minute 2-core budget on the full Flickr8k train split.

    python benchmarks/studies/bench_frozen_blocks.py [--images 800] [--val 200] [--ks 0 1 2] [--epochs 5]

Each k is one real training run of ``configs/flickr8k-vit.yaml`` (the trainer, ``train.frozen_features``) on the
first ``--images`` images of Flickr8k's captions file, written to /tmp with an image-grouped val split of
``--val`` images and no test split; k = 0 is the config as it is (locked tower, pooled outputs stored), k > 0 sets
``model.vision.trainable=true, trainable_blocks=k`` and trains those blocks at ``--lr-image``. All runs share the
seed, views, schedule and steps. Recorded per k: the stored-prefix pass (seconds and images/s, timed around
``frozen.compute_view``), the median pairs/s of the training steps (the first log window, warm-up, left out), the
seconds per epoch's evaluation, and the val rsum after every epoch. The estimate scales those to the full split
(5,591 train images x the config's views + 500 val; 43 steps of 128 pairs per epoch). Writes
``benchmarks/results/studies/frozen_blocks.json`` with the 1-minute load average, since other jobs on the 2 cores slow
everything down.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
CONFIG = ROOT / "configs/flickr8k-vit.yaml"
CAPTIONS = ROOT / "../shared/data/flickr8k/captions.csv"
FULL = {"train_images": 5591, "val_images": 500, "batch": 128, "budget_s": 1800}


def write_subset(src: Path, n_images: int, out: Path) -> int:
    """The captions of the first ``n_images`` images of ``src`` (in file order), written to ``out``."""
    with open(src, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    keep, images = [], []
    for row in rows:
        if row["image"] not in images:
            if len(images) == n_images:
                continue
            images.append(row["image"])
        keep.append(row)
    from clip_mini.fileio.atomic import atomic_path

    with atomic_path(out) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["image", "caption"])
        w.writeheader()
        w.writerows({"image": r["image"], "caption": r["caption"]} for r in keep)
    return len(images)


class PrefixTimer:
    """Wraps ``frozen.compute_view``: seconds and images of every stored-view pass of a run."""

    def __init__(self):
        from clip_mini.train import frozen

        self.module, self.real, self.seconds, self.images = frozen, frozen.compute_view, 0.0, 0

    def __enter__(self):
        def timed(model, dataset, *a, **k):
            t0 = time.perf_counter()
            out = self.real(model, dataset, *a, **k)
            self.seconds += time.perf_counter() - t0
            self.images += len(dataset)
            return out

        self.module.compute_view = timed
        return self

    def __exit__(self, *exc):
        self.module.compute_view = self.real


def run_k(k: int, args, captions: Path, out: Path) -> dict:
    from clip_mini.config import load_config
    from clip_mini.train import train

    sets = [f"data.captions={captions}", f"data.image_root={CAPTIONS.parent / 'images'}", f"data.val={args.val}",
            "data.test=0", f"train.out_dir={out}", f"train.epochs={args.epochs}", "train.budget=null",
            f"train.batch_size={args.batch}",
            f"train.frozen_features={args.views}", f"train.warmup_steps={args.warmup}", "train.log_every=3",
            "train.checkpoint_every=0", f"train.threads={args.threads}", "data.workers=0"]
    if k:
        sets += ["model.vision.trainable=true", f"model.vision.trainable_blocks={k}", f"train.lr_image={args.lr_image}"]
    cfg = load_config(CONFIG, sets)
    load0 = os.getloadavg()[0]
    with PrefixTimer() as timer:
        t0 = time.perf_counter()
        result = train(cfg)
        wall = time.perf_counter() - t0
    return {"k": k, "wall_s": wall, "steps": result["step"], "prefix_pass_s": timer.seconds,
            "prefix_images": timer.images, "prefix_images_per_s": timer.images / max(timer.seconds, 1e-9),
            **summarise(out), "load_average_1min": [load0, os.getloadavg()[0]]}


def summarise(out: Path) -> dict:
    """Step speed and val numbers of a finished run, from its metrics.jsonl.

    Pairs/s is kept per log window as well as its median and maximum: another job starting on the 2 shared
    cores cuts a 2-thread step's speed several-fold (the threads wait on each other), so the fastest window is
    the closest to a quiet machine and the median to this one as it was.
    """
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    pairs = [r["pairs_per_s"] for r in steps[1:]] or [r["pairs_per_s"] for r in steps]
    return {"pairs_per_s_median": statistics.median(pairs), "pairs_per_s_max": max(pairs),
            "pairs_per_s_windows": [round(x, 1) for x in pairs],
            "eval_s_median": statistics.median(r["eval_s"] for r in epochs[1:]),
            "val_rsum_by_epoch": [r["val_rsum"] for r in epochs], "val_rsum_best": max(r["val_rsum"] for r in epochs),
            "val_t2i_r1_best": max(r["val_t2i_r1"] for r in epochs), "val_rsum_final": epochs[-1]["val_rsum"]}


def full_split_estimate(run: dict, val_images: int, views: int) -> dict:
    """Seconds for the full split under this run's measured speeds, and the epochs that fit the budget: at the
    median step speed (this loaded machine) and at the fastest window's (closer to a quiet one)."""
    prefix = (FULL["train_images"] * views + FULL["val_images"]) / run["prefix_images_per_s"]
    steps = FULL["train_images"] // FULL["batch"]
    evaluation = run["eval_s_median"] * FULL["val_images"] / val_images
    left = FULL["budget_s"] - prefix - evaluation   # the untrained model's evaluation
    out = {"views": views, "prefix_pass_s": prefix, "epoch_eval_s": evaluation}
    for name in ("median", "max"):
        epoch = steps * FULL["batch"] / run[f"pairs_per_s_{name}"]
        out[f"epoch_train_s_at_{name}_speed"] = epoch
        out[f"epochs_in_budget_at_{name}_speed"] = max(0.0, left / (epoch + evaluation))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=800)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr-image", type=float, default=3e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_frozen_blocks"))
    p.add_argument("--result", type=Path, default=ROOT / "benchmarks/results/studies/frozen_blocks.json")
    args = p.parse_args(argv)
    from clip_mini.fileio.atomic import atomic_write_json
    from benchmarks.lib.repo_paths import relative_to_repo

    args.work.mkdir(parents=True, exist_ok=True)
    captions = args.work / "captions.csv"
    n = write_subset(CAPTIONS, args.images, captions)
    result = {"machine": {**machine_info(), "threads": args.threads},
              "config": relative_to_repo(CONFIG), "captions": relative_to_repo(CAPTIONS),
              "subset": {"images": n, "val_images": args.val, "train_images": n - args.val,
                         "note": "first images of the captions file, all their captions; written to /tmp"},
              "settings": {"epochs": args.epochs, "views": args.views, "batch": args.batch,
                           "warmup_steps": args.warmup, "lr_image": args.lr_image},
              "runs": [], "full_split_estimate": {}}
    for k in args.ks:
        out = args.work / f"k{k}"
        if out.exists():
            import shutil

            shutil.rmtree(out)   # a fresh run every time: the prefix pass is part of what is measured
        run = run_k(k, args, captions, out)
        result["runs"].append(run)
        result["full_split_estimate"][str(k)] = full_split_estimate(run, args.val, views=3)
        print(json.dumps(run), file=sys.stderr)
        atomic_write_json(args.result, result)   # after every k: a stopped benchmark keeps what it measured
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
