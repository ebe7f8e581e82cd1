"""Pictures: search result grids, near-duplicate groups, attention overlays, confusion matrices, training curves.
Every PNG is written atomically.

Grids and overlays are drawn with Pillow (sizes are exact: ``grid_size`` says what a grid will measure);
curves use matplotlib's Agg backend, imported only when plotting.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from clip_mini.fileio.atomic import atomic_path

PAD, LABEL_H, TITLE_H = 6, 34, 28   # label: rank and score, then the file name
_BG, _FG, _MISSING = (24, 24, 28), (235, 235, 235), (70, 70, 76)


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:   # Pillow < 10.1 has one fixed-size bitmap font
        return ImageFont.load_default()


def _save_png(img: Image.Image, out_png: str | Path) -> None:
    with atomic_path(out_png, suffix=".png") as tmp:
        img.save(tmp, format="PNG")


def grid_size(n: int, cols: int = 5, thumb: int = 160, title: bool = True) -> tuple[int, int]:
    """(width, height) in pixels of a result grid of ``n`` images."""
    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    return cols * (thumb + PAD) + PAD, (TITLE_H if title else 0) + rows * (thumb + LABEL_H + PAD) + PAD


def _thumbnail(path: str, thumb: int, heat: Optional[np.ndarray] = None) -> Image.Image:
    from clip_mini.data.images import ImageError, load_image

    tile = Image.new("RGB", (thumb, thumb), _MISSING)
    try:
        array = load_image(path)
        img = Image.fromarray(array) if heat is None else match_overlay(array, heat)
    except (ImageError, OSError):
        ImageDraw.Draw(tile).text((8, thumb // 2 - 8), "unreadable", fill=_FG, font=_font(13))
        return tile
    img.thumbnail((thumb, thumb), Image.Resampling.LANCZOS if max(img.size) > thumb else Image.Resampling.NEAREST)
    if max(img.size) < thumb:   # small images (e.g. 64 px) are enlarged so they can be seen
        scale = thumb / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                         Image.Resampling.NEAREST)
    tile.paste(img, ((thumb - img.width) // 2, (thumb - img.height) // 2))
    return tile


def _fit(name: str, width: int) -> str:
    """``name`` shortened in the middle to fit ``width`` pixels at the 11 px label font (~6 px a character)."""
    room = max(4, width // 6)
    return name if len(name) <= room else name[:room // 2 - 2] + "..." + name[-(room - room // 2 - 1):]


def result_grid(paths: Sequence[str], scores: Sequence[float], out_png: str | Path, title: Optional[str] = None,
                cols: int = 5, thumb: int = 160, names: Optional[Sequence[str]] = None,
                heats: Optional[Sequence[Optional[np.ndarray]]] = None) -> tuple[int, int]:
    """Draw ranked results (rank, score and file name under each thumbnail) into one PNG; returns its (width,
    height).

    Args:
        names: the label under each thumbnail (default: each path's file name).
        heats: a map per result (any size; None for none) overlaid on its thumbnail (``clip-mini search
            --explain``).

    Unreadable or deleted files get a grey "unreadable" tile rather than failing the whole grid.
    """
    if not paths:
        raise ValueError("result_grid needs at least one result")
    if len(paths) != len(scores):
        raise ValueError(f"{len(paths)} paths but {len(scores)} scores")
    w, h = grid_size(len(paths), cols, thumb, title is not None)
    cols = max(1, min(cols, len(paths)))
    canvas = Image.new("RGB", (w, h), _BG)
    draw = ImageDraw.Draw(canvas)
    top = 0
    if title is not None:
        draw.text((PAD, 6), title[:120], fill=_FG, font=_font(15))
        top = TITLE_H
    for i, (path, score) in enumerate(zip(paths, scores)):
        r, c = divmod(i, cols)
        x, y = PAD + c * (thumb + PAD), top + PAD + r * (thumb + LABEL_H + PAD)
        canvas.paste(_thumbnail(str(path), thumb, None if heats is None else heats[i]), (x, y))
        draw.text((x + 2, y + thumb + 3), f"#{i + 1}  {score:.3f}", fill=_FG, font=_font(13))
        draw.text((x + 2, y + thumb + 18), _fit(names[i] if names else Path(path).name, thumb), fill=_FG,
                  font=_font(11))
    _save_png(canvas, out_png)
    return w, h


def group_grid(groups: Sequence[Sequence[str]], similarities: Sequence[float], out_png: str | Path,
               title: Optional[str] = None, per_row: int = 6, thumb: int = 120) -> tuple[int, int]:
    """One row of thumbnails per group (near-duplicates), its similarity at the left; returns (width, height).

    A group longer than ``per_row`` shows its first ``per_row - 1`` images and a "+N more" tile.
    """
    if not groups:
        raise ValueError("group_grid needs at least one group")
    if len(groups) != len(similarities):
        raise ValueError(f"{len(groups)} groups but {len(similarities)} similarities")
    label_w = 90
    w = label_w + per_row * (thumb + PAD) + PAD
    top = TITLE_H if title is not None else 0
    h = top + len(groups) * (thumb + LABEL_H // 2 + PAD) + PAD
    canvas = Image.new("RGB", (w, h), _BG)
    draw = ImageDraw.Draw(canvas)
    if title is not None:
        draw.text((PAD, 6), title[:120], fill=_FG, font=_font(15))
    for g, (paths, sim) in enumerate(zip(groups, similarities)):
        y = top + PAD + g * (thumb + LABEL_H // 2 + PAD)
        draw.text((PAD, y + thumb // 2 - 16), f"group {g + 1}", fill=_FG, font=_font(13))
        draw.text((PAD, y + thumb // 2), f"sim {sim:.3f}", fill=_FG, font=_font(13))
        shown = list(paths) if len(paths) <= per_row else list(paths[:per_row - 1])
        for c, path in enumerate(shown):
            x = label_w + PAD + c * (thumb + PAD)
            canvas.paste(_thumbnail(str(path), thumb), (x, y))
            draw.text((x + 2, y + thumb + 2), _fit(Path(path).name, thumb), fill=_FG, font=_font(11))
        if len(paths) > per_row:
            x = label_w + PAD + (per_row - 1) * (thumb + PAD)
            draw.rectangle([x, y, x + thumb, y + thumb], fill=_MISSING)
            draw.text((x + 8, y + thumb // 2 - 8), f"+{len(paths) - per_row + 1} more", fill=_FG, font=_font(13))
    _save_png(canvas, out_png)
    return w, h


def overlay_image(image: np.ndarray, heat: np.ndarray, alpha: float = 0.5, size: Optional[int] = None,
                  cmap: str = "inferno") -> Image.Image:
    """Blend a (gh, gw) heat map, upsampled bilinearly and coloured, over an (H, W, 3) uint8 image.

    Args:
        size: length of the output's longer side (aspect kept); None keeps the image's own size.
    """
    import matplotlib

    base = Image.fromarray(image)
    if size is not None:
        scale = size / max(base.size)
        base = base.resize((max(1, round(base.width * scale)), max(1, round(base.height * scale))),
                           Image.Resampling.BICUBIC)
    heat = np.asarray(heat, dtype=np.float32)
    heat = (heat - heat.min()) / max(float(heat.max() - heat.min()), 1e-12)
    up = np.asarray(Image.fromarray(heat).resize(base.size, Image.Resampling.BILINEAR))
    colours = matplotlib.colormaps[cmap](np.clip(up, 0, 1))[..., :3]  # (H, W, 3) in [0, 1]
    blend = (1 - alpha) * np.asarray(base, np.float32) / 255 + alpha * colours
    return Image.fromarray((np.clip(blend, 0, 1) * 255 + 0.5).astype(np.uint8))


MATCH_ALPHA = 0.45   # the match map's share of an explained picture: light enough to see the image under it


def match_overlay(image: np.ndarray, heat: np.ndarray, longest: Optional[int] = None) -> Image.Image:
    """A match map (``Embedder.explain``) over its (H, W, 3) uint8 image, as ``clip-mini search --explain`` draws
    each hit and ``clip-mini serve`` answers ``/api/explain``.

    Args:
        longest: shrink the image first (never enlarge it) to at most this many pixels on its longer side, as
            ``Image.thumbnail`` does (a server thumbnail's size); the map is resized to it.
    """
    if longest is not None and max(image.shape[:2]) > longest:
        small = Image.fromarray(image)
        small.thumbnail((longest, longest), Image.Resampling.LANCZOS)
        image = np.asarray(small)
    return overlay_image(image, heat, alpha=MATCH_ALPHA)


def attention_overlay(image: np.ndarray, heat: np.ndarray, out_png: str | Path, alpha: float = 0.5,
                      size: Optional[int] = 448) -> tuple[int, int]:
    """Write ``overlay_image`` to a PNG; returns its (width, height)."""
    img = overlay_image(image, heat, alpha, size)
    _save_png(img, out_png)
    return img.size


def confusion_png(matrix, labels: Sequence[str], out_png: str | Path, title: Optional[str] = None) -> None:
    """A confusion matrix (rows: true label, columns: predicted) as a PNG, each cell's count written in it."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    m = np.asarray(matrix)
    if m.ndim != 2 or m.shape != (len(labels), len(labels)):
        raise ValueError(f"a {len(labels)}-label confusion matrix must be {len(labels)}x{len(labels)}, got {m.shape}")
    side = min(16.0, 2.5 + 0.55 * len(labels))
    fig, ax = plt.subplots(figsize=(side, side), dpi=100)
    try:
        rows = np.maximum(m.sum(1, keepdims=True), 1)
        ax.imshow(m / rows, cmap="Blues", vmin=0, vmax=1)   # coloured by the row's share: per-class recall
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
        ax.set_yticks(range(len(labels)), labels)
        ax.set(xlabel="predicted", ylabel="true", title=title or "confusion matrix")
        for i in range(len(labels)):
            for j in range(len(labels)):
                ax.text(j, i, str(int(m[i, j])), ha="center", va="center", fontsize=8,
                        color="white" if m[i, j] / rows[i, 0] > 0.5 else "black")
        fig.tight_layout()
        with atomic_path(out_png, suffix=".png") as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)


def plot_curves(records: Sequence[dict], out_png: str | Path) -> None:
    """Training curves from metrics records into one PNG (1500 x 400).

    Args:
        records: dicts with ``kind`` "step" (``step``, ``loss``, ``lr``, ``logit_scale``) or "epoch" (``epoch``,
            ``step``, ``val_loss``, ``val_t2i_r1``, ``val_i2t_r1``, ...). Missing keys and NaNs are skipped.

    Panels: training loss per step with validation loss per epoch; validation recall per epoch; learning rate and
    logit scale per step. Drawn on a bare ``Figure`` (Agg, no pyplot) with fixed margins: the panels' places do not
    depend on the data, so nothing is measured before the one draw that writes the PNG.
    """
    from matplotlib.figure import Figure

    steps, epochs, last_step = [], [], None
    for r in records:
        if r.get("kind") == "step":
            steps.append(r)
            last_step = r.get("step", last_step)
        elif r.get("kind") == "epoch":   # an epoch row without a step sits at the last step before it
            epochs.append(r if r.get("step") is not None else {**r, "step": last_step})
    if not steps and not epochs:
        raise ValueError("plot_curves: no step or epoch records")
    fig = Figure(figsize=(15, 4), dpi=100)
    ax_loss, ax_rec, ax_lr = fig.subplots(1, 3)
    # room for the tick labels, axis labels and titles, and for the twin axis' label right of the last panel
    fig.subplots_adjust(left=0.045, right=0.955, bottom=0.12, top=0.93, wspace=0.28)
    _line(ax_loss, steps, "step", "loss", "train loss", lw=0.8)
    _line(ax_loss, epochs, "step", "val_loss", "val loss", marker="o")
    ax_loss.set(xlabel="step", ylabel="loss", title="contrastive loss")
    recall_keys = sorted({k for r in epochs for k in r if re.fullmatch(r"val_(t2i|i2t)_r\d+", k)},
                         key=lambda k: (k[4:7], int(k.split("_r")[-1])))
    for key in recall_keys:
        _line(ax_rec, epochs, "epoch", key, key[4:], marker="o")
    ax_rec.set(xlabel="epoch", ylabel="recall", title="validation retrieval", ylim=(0, 1.02))
    _line(ax_lr, steps, "step", "lr", "lr", lw=0.8)
    ax_lr.set(xlabel="step", ylabel="learning rate", title="schedule")
    twin = ax_lr.twinx()
    _line(twin, steps, "step", "logit_scale", "logit scale", lw=0.8, color="tab:red")
    twin.set_ylabel("logit scale")
    for ax in (ax_loss, ax_rec, ax_lr):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")


def _line(ax, rows: Sequence[dict], xkey: str, ykey: str, label: str, **kw) -> None:
    pts = [(r[xkey], r[ykey]) for r in rows if r.get(xkey) is not None and isinstance(r.get(ykey), (int, float))
           and math.isfinite(r[ykey])]
    if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, label=label, **kw)
