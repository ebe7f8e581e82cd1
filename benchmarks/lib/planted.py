"""Planted near-duplicates: the four edits of issue 43 applied to a photo, for the dupes study and its test.

Each edit is a copy a photo library really collects: a downsized export, a heavily recompressed JPEG, a slight
crop, a colour-adjusted version. Deterministic for one seed.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

EDITS = ("half", "jpeg40", "crop90", "jitter")


def edit(img: Image.Image, kind: str, rng: np.random.Generator) -> Image.Image:
    """One edited copy of ``img`` (RGB)."""
    w, h = img.size
    if kind == "half":
        return img.resize((max(1, w // 2), max(1, h // 2)), Image.Resampling.BICUBIC)
    if kind == "jpeg40":
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=40)
        buf.seek(0)
        return Image.open(buf).convert("RGB")
    if kind == "crop90":
        cw, ch = round(w * 0.9), round(h * 0.9)
        x, y = (w - cw) // 2, (h - ch) // 2
        return img.crop((x, y, x + cw, y + ch))
    if kind == "jitter":   # brightness, contrast and saturation each within +-20%, as a photo editor's sliders
        for enhancer in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
            img = enhancer(img).enhance(float(rng.uniform(0.8, 1.2)))
        return img
    raise ValueError(f"unknown edit {kind!r} (one of {EDITS})")


def plant_copies(originals: list[Path], out: Path, copies_each: int = 3, seed: int = 0) -> dict[str, str]:
    """Write ``copies_each`` edited copies of each original into ``out`` (PNG, so only the edit itself loses
    anything; ``jpeg40`` has already been through JPEG); returns ``{copy path: original path}``.

    Each original gets ``copies_each`` different edits, rotating through ``EDITS``.
    """
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    planted = {}
    for n, src in enumerate(originals):
        img = Image.open(src).convert("RGB")
        for c in range(copies_each):
            kind = EDITS[(n + c) % len(EDITS)]
            dst = out / f"{Path(src).stem}__{kind}.png"
            edit(img, kind, rng).save(dst)
            planted[str(dst)] = str(src)
    return planted


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
    found = set()
    for g in groups:
        g = sorted(g)
        found |= {(a, b) for i, a in enumerate(g) for b in g[i + 1:]}
    tp = len(found & truth)
    return {"true_pairs": len(truth), "found_pairs": len(found), "correct_pairs": tp,
            "precision": tp / len(found) if found else 1.0, "recall": tp / len(truth) if truth else 1.0}
