"""Planted near-duplicates: the edits of issues 43 and 52 applied to a photo, for the dupes study and its tests.

Each edit is a copy a photo library really collects:

* ``jpeg40``  -- re-encoded as a JPEG at quality 40 (a messenger's recompression);
* ``half``    -- resized to half its width and height (a downsized export);
* ``crop90``  -- a 10% crop: a window of 90% of the width and height, at a seeded offset;
* ``rotate5`` -- straightened by 5 degrees (seeded sign) as a photo editor does it: rotated about the centre, then
  the largest window of the photo's aspect ratio that holds no corner filler is cut out and resized back to the
  photo's size (so the copy keeps the size and has no black corners);
* ``colour``  -- a colour shift: a warm or cool cast (red and blue gains moved 8-15% in opposite directions) on top
  of brightness, contrast and saturation each within +-15%, as a photo editor's sliders;
* ``caption`` -- a line of text drawn across the photo (Pillow's ``ImageDraw`` and default font, white with a dark
  outline, as a meme or a story caption) in a band near the top or the bottom, about 90% of the width;
* ``border``  -- a screenshot of the photo in a viewer: the photo at a seeded scale (80-100%) inside a larger dark
  canvas, with a title bar above (three window buttons, a file name) and a toolbar below.

Deterministic for one seed: each copy's randomness comes from ``(seed, original's position, edit)`` alone.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFont

EDITS = ("jpeg40", "half", "crop90", "rotate5", "colour", "caption", "border")
CAPTIONS = ("best day ever", "summer 2012 with the family", "look who showed up!", "can't stop laughing",
            "throwback to this one", "weekend vibes", "guess where we are", "happy birthday!!")
ROTATION_DEG = 5.0
CROP = 0.9


def straighten_scale(w: int, h: int, degrees: float) -> float:
    """The largest scale ``s`` such that a centred ``s*w x s*h`` window fits inside the ``w x h`` photo rotated by
    ``degrees`` about its centre (so it holds none of the rotation's corner filler)."""
    c, s = math.cos(math.radians(abs(degrees))), math.sin(math.radians(abs(degrees)))
    return min(w / (w * c + h * s), h / (w * s + h * c))


def _rotate(img: Image.Image, degrees: float) -> Image.Image:
    w, h = img.size
    turned = img.rotate(degrees, resample=Image.Resampling.BICUBIC, expand=False)
    k = straighten_scale(w, h, degrees)
    cw, ch = w * k, h * k
    # bicubic resampling reads 2 pixels either side: pixels that near the filler's edge are cut off too
    box = (math.ceil((w - cw) / 2) + 2, math.ceil((h - ch) / 2) + 2,
           math.floor((w + cw) / 2) - 2, math.floor((h + ch) / 2) - 2)
    return turned.crop(box).resize((w, h), Image.Resampling.BICUBIC)


def _colour(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    for enhancer in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        img = enhancer(img).enhance(float(rng.uniform(0.85, 1.15)))
    cast = float(rng.uniform(0.08, 0.15)) * (1 if rng.random() < 0.5 else -1)   # + warm, - cool
    a = np.asarray(img, np.float32)
    a = a * np.array([1 + cast, 1.0, 1 - cast], np.float32)
    return Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8))


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)   # Pillow's bundled scalable font (needs FreeType)
    except (TypeError, ValueError, OSError, ImportError):   # an old Pillow or no FreeType: the bitmap font
        return ImageFont.load_default()


def _caption(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    img = img.copy()
    w, h = img.size
    text = CAPTIONS[int(rng.integers(len(CAPTIONS)))]
    draw = ImageDraw.Draw(img)
    size = max(8, h // 8)
    font = _font(size)
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    if x1 - x0 > 0 and hasattr(font, "font_variant"):   # scale the font so the line spans about 90% of the width
        size = max(8, int(size * 0.9 * w / (x1 - x0)))
        size = min(size, max(8, h // 5))
        font = _font(size)
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    tw, th = x1 - x0, y1 - y0
    top = rng.random() < 0.5
    y = round(h * 0.06) if top else h - round(h * 0.06) - th
    x = (w - tw) // 2
    stroke = max(1, size // 12)
    draw.text((x - x0, y - y0), text, font=font, fill=(255, 255, 255), stroke_width=stroke,
              stroke_fill=(0, 0, 0))
    return img


def _border(img: Image.Image, rng: np.random.Generator, name: str = "IMG_0001.JPG") -> Image.Image:
    w, h = img.size
    scale = float(rng.uniform(0.8, 1.0))
    pw, ph = max(1, round(w * scale)), max(1, round(h * scale))
    photo = img.resize((pw, ph), Image.Resampling.BICUBIC) if (pw, ph) != (w, h) else img
    side = max(4, round(w * 0.05))
    title = max(12, round(h * 0.08))
    toolbar = max(12, round(h * 0.10))
    cw, ch = pw + 2 * side, ph + title + toolbar + 2 * side
    canvas = Image.new("RGB", (cw, ch), (32, 32, 34))
    draw = ImageDraw.Draw(canvas)
    draw.rectangle((0, 0, cw - 1, title - 1), fill=(58, 58, 62))   # title bar
    r = max(2, title // 5)
    for k, colour in enumerate(((237, 94, 86), (246, 190, 79), (98, 197, 84))):   # window buttons
        cx, cy = side + r + k * 3 * r, title // 2
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    font = _font(max(8, title // 2))
    x0, y0, x1, y1 = draw.textbbox((0, 0), name, font=font)
    draw.text((side + 10 * r - x0, (title - (y1 - y0)) // 2 - y0), name, font=font, fill=(200, 200, 200))
    draw.rectangle((0, ch - toolbar, cw - 1, ch - 1), fill=(46, 46, 50))   # toolbar with a few icons
    for k in range(5):
        cx = cw // 2 + (k - 2) * toolbar
        draw.rounded_rectangle((cx - toolbar // 4, ch - toolbar * 3 // 4, cx + toolbar // 4, ch - toolbar // 4),
                               radius=max(1, toolbar // 10), outline=(170, 170, 175), width=max(1, toolbar // 16))
    canvas.paste(photo, (side, title + side))
    return canvas


def edit(img: Image.Image, kind: str, rng: np.random.Generator) -> Image.Image:
    """One edited copy of ``img`` (RGB), its randomness drawn from ``rng``."""
    w, h = img.size
    if kind == "half":
        return img.resize((max(1, w // 2), max(1, h // 2)), Image.Resampling.BICUBIC)
    if kind == "jpeg40":
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=40)
        buf.seek(0)
        return Image.open(buf).convert("RGB")
    if kind == "crop90":
        cw, ch = round(w * CROP), round(h * CROP)
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        return img.crop((x, y, x + cw, y + ch))
    if kind == "rotate5":
        return _rotate(img, ROTATION_DEG * (1 if rng.random() < 0.5 else -1))
    if kind == "colour":
        return _colour(img, rng)
    if kind == "caption":
        return _caption(img, rng)
    if kind == "border":
        return _border(img, rng)
    raise ValueError(f"unknown edit {kind!r} (one of {EDITS})")


def copy_rng(seed: int, n: int, kind: str) -> np.random.Generator:
    """The random stream of the ``kind`` copy of the ``n``-th original: independent of every other copy."""
    return np.random.default_rng([seed, n, EDITS.index(kind)])


def plant_copies(originals: list[Path], out: Path, copies_each: int = 3, seed: int = 0,
                 edits: Sequence[str] = EDITS) -> dict[str, str]:
    """Write ``copies_each`` edited copies of each original into ``out`` (PNG, so only the edit itself loses
    anything; ``jpeg40`` has already been through JPEG), named ``<original>__<edit>.png``; returns
    ``{copy path: original path}``.

    Each original gets ``copies_each`` different edits, rotating through ``edits`` (``len(edits)``: every one).
    """
    unknown = [k for k in edits if k not in EDITS]
    if unknown or not edits:
        raise ValueError(f"unknown edits {unknown} (one of {EDITS})" if unknown else "no edits given")
    if not 1 <= copies_each <= len(edits):
        raise ValueError(f"copies_each must be 1 to {len(edits)} (one copy per edit), got {copies_each}")
    out.mkdir(parents=True, exist_ok=True)
    planted = {}
    for n, src in enumerate(originals):
        img = Image.open(src).convert("RGB")
        for c in range(copies_each):
            kind = edits[(n + c) % len(edits)]
            dst = out / f"{Path(src).stem}__{kind}.png"
            edit(img, kind, copy_rng(seed, n, kind)).save(dst)
            planted[str(dst)] = str(src)
    return planted


def edit_kind(copy: str | Path) -> str:
    """The edit a planted copy was made with, from its name (``<original>__<edit>.png``)."""
    kind = Path(copy).stem.rpartition("__")[2]
    if kind not in EDITS:
        raise ValueError(f"{copy}: not a planted copy's name (<original>__<edit>.png, edit one of {EDITS})")
    return kind


def _pairs(groups: list[list[str]]) -> set[tuple[str, str]]:
    found = set()
    for g in groups:
        g = sorted(g)
        found |= {(a, b) for i, a in enumerate(g) for b in g[i + 1:]}
    return found


def pair_scores(groups: list[list[str]], planted: dict[str, str]) -> dict:
    """Precision and recall over image pairs: a true pair is (copy, its original) or two copies of one original;
    a found pair is any two paths in one group."""
    fam: dict[str, str] = {}
    for copy, src in planted.items():
        fam[copy] = fam[src] = src
    truth = set()
    by_src: dict[str, list[str]] = {}
    for p, src in fam.items():
        by_src.setdefault(src, []).append(p)
    for members in by_src.values():
        members = sorted(members)
        truth |= {(a, b) for i, a in enumerate(members) for b in members[i + 1:]}
    found = _pairs(groups)
    tp = len(found & truth)
    return {"true_pairs": len(truth), "found_pairs": len(found), "correct_pairs": tp,
            "precision": tp / len(found) if found else 1.0, "recall": tp / len(truth) if truth else 1.0}


def edit_recall(groups: list[list[str]], planted: dict[str, str]) -> dict[str, dict]:
    """Per edit: of the pairs (copy made with that edit, its original), how many share a group.
    ``{edit: {"pairs", "found", "recall"}}`` for each edit that has a copy, in ``EDITS`` order."""
    found = _pairs(groups)
    out: dict[str, dict] = {}
    for copy, src in planted.items():
        row = out.setdefault(edit_kind(copy), {"pairs": 0, "found": 0})
        row["pairs"] += 1
        row["found"] += tuple(sorted((copy, src))) in found
    return {k: {**out[k], "recall": out[k]["found"] / out[k]["pairs"]} for k in EDITS if k in out}
