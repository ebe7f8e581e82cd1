"""Generated demo dataset: coloured shapes on a plain background, captioned in several phrasings.

    python -m clip_mini.data.synthetic --out data/shapes --n 3000 [--seed 0] [--size 64]

writes ``images/*.png``, ``captions.csv`` (``image,caption``, 3 captions per image, the Flickr8k Kaggle
layout), ``compositional_test.csv`` (same format) and ``labels.csv`` (attributes of each image, for
zero-shot classification, and each object's bounding box ``x0,y0,x1,y1`` in output pixels, for scoring where a
match map points). Scenes hold one or two objects: 4 shapes x 6 colours x 2 sizes x 5 positions.
Four (colour, shape) pairs never occur in ``captions.csv``; ``compositional_test.csv`` holds ``n // 10``
(at least 30) further images whose first object is such a pair, testing whether a model composes "red" and
"star" without having seen a red star. Output is byte-identical for one seed (each image has its own
generator seeded by ``(seed, split, i)``). Objects are big and backgrounds dark and nearly flat, so a tiny ViT
at 64 px learns the captions in minutes on a CPU.
"""
from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 90, 235), "yellow": (240, 220, 40),
           "purple": (160, 60, 210), "cyan": (40, 210, 220)}
HELD_OUT = frozenset({("red", "star"), ("green", "circle"), ("blue", "triangle"), ("yellow", "square")})
SIZES = {"small": 0.11, "large": 0.2}   # radius as a fraction of the image side
POSITIONS = {"left": (0.27, 0.5), "right": (0.73, 0.5), "top": (0.5, 0.27), "bottom": (0.5, 0.73),
             "center": (0.5, 0.5)}
PLACE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom",
         "center": "in the center"}
# Every phrasing names every attribute, so captions rarely collide across images: a bare "a red circle" would
# match dozens of validation images and cap text->image R@1 far below 1 for even a perfect model.
SINGLE_TEMPLATES = ("a {z} {c} {s} {p}", "a picture of a {z} {c} {s} {p}", "there is a {z} {c} {s} {p}",
                    "an image showing a {z} {c} {s} {p}", "{p} there is a {z} {c} {s}")
_SUPER = 2   # draw at 2x and downsample: anti-aliased edges without ImageDraw's jaggies
OWN_FILES = {"images", "captions.csv", "compositional_test.csv", "labels.csv"}


def _combos(held_out: bool) -> list[tuple[str, str]]:
    return [(c, s) for c in COLOURS for s in SHAPES if ((c, s) in HELD_OUT) == held_out]


def _scene(rng: np.random.Generator, compositional: bool) -> list[dict]:
    """One or two objects; for the compositional split the first object's (colour, shape) is held out."""
    first_pool, other_pool = (_combos(True), _combos(False) + _combos(True)) if compositional else \
        (_combos(False), _combos(False))
    c, s = first_pool[rng.integers(len(first_pool))]
    if rng.random() < 0.6:
        pos = list(POSITIONS)[rng.integers(len(POSITIONS))]
        return [dict(colour=c, shape=s, size=list(SIZES)[rng.integers(2)], pos=pos)]
    c2, s2 = other_pool[rng.integers(len(other_pool))]
    while (c2, s2) == (c, s):
        c2, s2 = other_pool[rng.integers(len(other_pool))]
    first, second = ("left", "right") if rng.random() < 0.5 else ("top", "bottom")
    objs = [dict(colour=c, shape=s, size=list(SIZES)[rng.integers(2)], pos=first),
            dict(colour=c2, shape=s2, size=list(SIZES)[rng.integers(2)], pos=second)]
    return objs if rng.random() < 0.5 else objs[::-1]   # the held-out object may sit on either side


def _captions(objs: list[dict], rng: np.random.Generator) -> list[str]:
    if len(objs) == 1:
        o = objs[0]
        c, s, z = o["colour"], o["shape"], o["size"]
        picks = rng.choice(len(SINGLE_TEMPLATES), size=3, replace=False)
        return [SINGLE_TEMPLATES[k].format(c=c, s=s, z=z, p=PLACE[o["pos"]]) for k in picks]
    a, b = sorted(objs, key=lambda o: o["pos"] in ("right", "bottom"))   # a is left / top
    rel, inv = ("left of", "right of") if a["pos"] == "left" else ("above", "below")
    na, nb = f"{a['colour']} {a['shape']}", f"{b['colour']} {b['shape']}"
    layout = "side by side" if a["pos"] == "left" else "one above the other"
    return [f"a {na} and a {nb} {layout}", f"a {na} {rel} a {nb}", f"a {nb} {inv} a {na}"]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill
                ) -> tuple[float, float, float, float]:
    """Draw one shape; returns its bounding box ``(x0, y0, x1, y1)`` in the drawing's pixels."""
    if shape == "circle":
        box = [cx - r, cy - r, cx + r, cy + r]
        draw.ellipse(box, fill=fill)
        return tuple(box)
    if shape == "square":
        h = r * 0.88   # about the circle's area, so size words mean the same for every shape
        box = [cx - h, cy - h, cx + h, cy + h]
        draw.rectangle(box, fill=fill)
        return tuple(box)
    if shape == "triangle":
        pts = [(cx + 1.15 * r * math.cos(a), cy + 1.15 * r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6,
                                                                                     5 * math.pi / 6)]
    else:   # five-pointed star
        pts = [(cx + rr * math.cos(a), cy + rr * math.sin(a))
               for k in range(10) for rr, a in [((1.15 if k % 2 == 0 else 0.5) * r, -math.pi / 2 + k * math.pi / 5)]]
    draw.polygon(pts, fill=fill)
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    return min(xs), min(ys), max(xs), max(ys)


def render(objs: list[dict], rng: np.random.Generator, size: int = 64, boxes: list | None = None) -> Image.Image:
    """Draw a scene: dark, slightly tinted background with mild noise; flat-coloured objects.

    ``boxes``, when given, receives each object's bounding box ``(x0, y0, x1, y1)`` in output pixels, in the
    order of ``objs`` (the random draws are the same either way, so the image does not change).
    """
    big = size * _SUPER
    base = rng.integers(35, 80) + rng.integers(-8, 9, size=3)
    im = Image.new("RGB", (big, big), tuple(int(v) for v in base))
    draw = ImageDraw.Draw(im)
    for o in objs:
        r = SIZES[o["size"]] * big
        fx, fy = POSITIONS[o["pos"]]
        jitter = 0.02 * big
        if len(objs) == 2:   # pairs sit further apart and jitter less than single objects, so they never touch
            fx, fy = {"left": (0.25, fy), "right": (0.75, fy), "top": (fx, 0.25), "bottom": (fx, 0.75)}[o["pos"]]
            jitter = 0.008 * big
        cx = np.clip(fx * big + rng.normal(0, jitter), r + 2, big - r - 2)
        cy = np.clip(fy * big + rng.normal(0, jitter), r + 2, big - r - 2)
        fill = tuple(int(np.clip(v + rng.integers(-15, 16), 0, 255)) for v in COLOURS[o["colour"]])
        box = _draw_shape(draw, o["shape"], float(cx), float(cy), r, fill)
        if boxes is not None:
            boxes.append(tuple(round(v * size / big, 1) for v in box))
    arr = np.asarray(im.resize((size, size), Image.BOX), dtype=np.int16)
    arr = arr + rng.normal(0, 3.0, size=arr.shape).round().astype(np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _csv_text(rows: list[list], header: list[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def generate(out: str | Path, n: int, seed: int = 0, size: int = 64) -> Path:
    """Write the dataset to ``out`` (replaced as a whole, atomically) and return ``out``.

    Args:
        out: output folder; must be empty, absent, or an earlier output of this generator.
        n: images in ``captions.csv``; ``compositional_test.csv`` gets ``max(30, n // 10)`` more.
        seed: generator seed; the same seed gives byte-identical files.
        size: image side in pixels.
    """
    from clip_mini.fileio.atomic import atomic_dir

    out = Path(out)
    if n < 1 or size < 16:
        raise ValueError(f"need n >= 1 and size >= 16, got n={n}, size={size}")
    if out.exists() and (not out.is_dir() or set(p.name for p in out.iterdir()) - OWN_FILES):
        raise FileExistsError(f"{out} exists and holds files this generator did not write; choose another --out")
    splits = {"captions.csv": ("train", n), "compositional_test.csv": ("comp", max(30, n // 10))}
    with atomic_dir(out) as tmp:
        (tmp / "images").mkdir()
        labels = []
        for fname, (split, count) in splits.items():
            rows = []
            for i in range(count):
                rng = np.random.default_rng([seed, split == "comp", i])
                objs = _scene(rng, compositional=split == "comp")
                name = f"{split}_{i:05d}.png"
                boxes: list = []
                render(objs, rng, size, boxes).save(tmp / "images" / name, optimize=False)
                rows += [[name, cap] for cap in _captions(objs, rng)]
                second = objs[1] if len(objs) > 1 else dict(colour="", shape="", size="", pos="")
                box2 = list(boxes[1]) if len(boxes) > 1 else [""] * 4
                labels.append([name, split, len(objs)] + [objs[0][k] for k in ("colour", "shape", "size", "pos")]
                              + [second[k] for k in ("colour", "shape", "size", "pos")]
                              + list(boxes[0]) + box2)
            (tmp / fname).write_text(_csv_text(rows, ["image", "caption"]), encoding="utf-8")
        header = ["image", "split", "n_objects", "colour", "shape", "size", "position",
                  "colour2", "shape2", "size2", "position2",
                  "x0", "y0", "x1", "y1", "x0_2", "y0_2", "x1_2", "y1_2"]
        (tmp / "labels.csv").write_text(_csv_text(labels, header), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (e.g. data/shapes)")
    p.add_argument("--n", type=int, default=3000, help="training images (captions.csv)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    args = p.parse_args(argv)
    out = generate(args.out, args.n, args.seed, args.size)
    print(f"wrote {args.n} training images (+ compositional test split) to {out}")


if __name__ == "__main__":
    main()
