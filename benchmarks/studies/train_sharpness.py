"""How soft training crops are, depending on the size of the copy they are cut from (the image cache's record).

    python benchmarks/studies/train_sharpness.py [--images ../shared/data/flickr8k/fullres/images] [--size 64]

For each photo one random crop is drawn as ``RandomResizedCrop`` draws it (area in [scale_min, 1], aspect ratio in
[3/4, 4/3]), in coordinates relative to the image. The ideal training input is that crop cut from the full-size
photo and shrunk once to ``size`` (INTER_AREA, as the transforms do). The same crop is then cut from a squashed
copy of side ``base`` and resized to ``size`` (INTER_AREA when shrinking, bilinear when enlarging): base = size is
what the old cache held. Reports the mean absolute difference to the ideal (grey levels, 0-255) and the mean
neighbour difference (a sharpness measure, pixels in [0, 1]) next to the eval transform's. Writes
``benchmarks/results/studies/train_sharpness.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402


def resize(img: np.ndarray, side: int) -> np.ndarray:
    import cv2

    shrink = side < img.shape[0] and side < img.shape[1]
    return cv2.resize(img, (side, side), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)


def crop(img: np.ndarray, box: tuple[float, float, float, float]) -> np.ndarray:
    h, w = img.shape[:2]
    x0, y0, bw, bh = box
    return img[round(y0 * h):round((y0 + bh) * h), round(x0 * w):round((x0 + bw) * w)]


def neighbour_difference(img: np.ndarray) -> float:
    x = img.astype(np.float32) / 255
    return float((np.abs(np.diff(x, axis=0)).mean() + np.abs(np.diff(x, axis=1)).mean()) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", default=str(ROOT.parent / "shared/data/flickr8k/fullres/images"))
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--scale-min", type=float, default=0.8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/studies/train_sharpness.json"))
    args = ap.parse_args()

    from clip_mini.data import load_image
    from clip_mini.data.transforms import train_base_size
    from benchmarks.lib.repo_paths import relative_to_repo
    from clip_mini.fileio.atomic import atomic_write_json

    s = args.size
    images = [load_image(os.path.join(args.images, f)) for f in sorted(os.listdir(args.images))]
    rng = np.random.default_rng(0)
    boxes = []
    for _ in images:
        area, ratio = rng.uniform(args.scale_min, 1.0), math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        bw, bh = min(1.0, math.sqrt(area * ratio)), min(1.0, math.sqrt(area / ratio))
        boxes.append((rng.uniform(0, 1 - bw), rng.uniform(0, 1 - bh), bw, bh))
    ideal = [resize(crop(img, box), s) for img, box in zip(images, boxes)]
    result = {"machine": machine_info(), "images": relative_to_repo(args.images), "n_images": len(images), "size": s,
              "scale_min": args.scale_min,
              "eval_neighbour_difference": float(np.mean([neighbour_difference(resize(img, s)) for img in images])),
              "ideal_neighbour_difference": float(np.mean([neighbour_difference(x) for x in ideal])),
              "current_base": train_base_size(s, args.scale_min), "bases": {}}
    for base in sorted({s, math.ceil(s / math.sqrt(args.scale_min)), math.ceil(s / math.sqrt(args.scale_min * 0.75)),
                        2 * s, result["current_base"], 4 * s}):
        out = [resize(crop(resize(img, base), box), s) for img, box in zip(images, boxes)]
        result["bases"][str(base)] = {
            "mean_abs_diff_to_ideal": float(np.mean([np.abs(o.astype(np.float32) - i).mean()
                                                     for o, i in zip(out, ideal)])),
            "neighbour_difference": float(np.mean([neighbour_difference(o) for o in out]))}
    atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
