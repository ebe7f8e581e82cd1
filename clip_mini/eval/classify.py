"""Sorting a folder of images into the user's own labels (zero-shot), and scoring it against a truth table.

The classification itself is ``Embedder.classify`` (prompt ensembling by ``Embedder.label_embeddings``, which
``clip_mini.eval.scoring``'s zero-shot accuracy uses too); this module reads the label lists and the truth file,
writes the CSV and the confusion matrix.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from clip_mini.eval.scoring import EvalError

COLUMNS = ["path", "label", "score", "runner_up", "runner_up_score"]


def parse_labels(labels: Optional[str] = None, labels_file: Optional[str | Path] = None) -> list[str]:
    """Class names from ``--labels "cat,dog,beach"`` and/or ``--labels-file`` (one name a line; empty lines are
    skipped), in that order. A name of only spaces, or a repeated name, is refused with its position."""
    names: list[tuple[str, str]] = []   # (name, where it came from)
    if labels is not None:
        if not labels.strip():
            raise EvalError("--labels is empty: give class names separated by commas, e.g. --labels 'cat,dog'")
        names += [(n, f"--labels item {i + 1}") for i, n in enumerate(labels.split(","))]
    if labels_file is not None:
        from clip_mini.data.readers import read_input_file

        path = Path(labels_file)
        try:
            text = read_input_file(path, "labels file").decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise EvalError(f"labels file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        names += [(ln, f"{path} line {i + 1}") for i, ln in enumerate(text.splitlines()) if ln != ""]
    if not names:
        raise EvalError("no labels given: use --labels 'cat,dog,...' or --labels-file FILE (one label a line)"
                        if labels is None and labels_file is None else
                        f"the label list is empty ({labels_file} has no labels)")
    seen: dict[str, str] = {}
    for name, where in names:
        if not name.strip():
            raise EvalError(f"{where} is {'empty' if not name else 'only spaces'}: {name!r}")
        if name.strip() in seen:
            raise EvalError(f"{where} ({name.strip()!r}) repeats {seen[name.strip()]}")
        seen[name.strip()] = where
    if len(seen) < 2:
        raise EvalError(f"classification needs at least 2 labels, got {list(seen)}")
    return list(seen)


def read_truth(path: str | Path, image_root: Optional[str | Path] = None) -> dict[str, str]:
    """``{absolute image path: label}`` from a CSV with a ``path`` (or ``image``) column and a ``label`` column;
    names resolve against ``image_root`` (default: the CSV's folder), as in a captions file."""
    from clip_mini.data import read_captions
    from clip_mini.data.readers import read_input_file

    path = Path(path)
    header = next(csv.reader(io.StringIO(read_input_file(path, "truth file").decode("utf-8-sig"))), [])
    col = "path" if "path" in header else "image"
    if col not in header or "label" not in header:
        raise EvalError(f"truth file {path} needs the columns path (or image) and label; its header is {header}")
    df, _ = read_captions(path, image_root=image_root, fmt="csv", image_col=col, caption_col="label")
    return {str(Path(p).resolve()): str(label).strip() for p, label in zip(df["path"], df["caption"])}


def confusion(labels: Sequence[str], truth: Sequence[str], predicted: Sequence[str]) -> np.ndarray:
    """(C, C) counts: row = true label, column = predicted label, in ``labels`` order."""
    index = {name: i for i, name in enumerate(labels)}
    m = np.zeros((len(labels), len(labels)), np.int64)
    for t, p in zip(truth, predicted):
        m[index[t], index[p]] += 1
    return m


def write_csv(rows: list[dict], out: str | Path, top: int) -> None:
    """The result table, written atomically: ``COLUMNS`` and, for ``top`` > 2, ``label_3, score_3, ...``."""
    from clip_mini.fileio.atomic import atomic_write_text

    extra = [f"{kind}_{k}" for k in range(3, top + 1) for kind in ("label", "score")]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS + extra)
    for r in rows:
        more = [x for label, score in r["top"][2:] for x in (label, f"{score:.6f}")]
        w.writerow([r["path"], r["label"], f"{r['score']:.6f}", r["runner_up"],
                    "" if math.isnan(r["runner_up_score"]) else f"{r['runner_up_score']:.6f}"] + more)
    atomic_write_text(out, buf.getvalue())


def classify_files(embedder, paths: Sequence[str], labels: Sequence[str], templates: Sequence[str],
                   top: int = 2, truth: Optional[dict[str, str]] = None, progress: bool = False) -> dict:
    """Classify image files; returns ``{"rows", "skipped": {path: reason}, "accuracy", "confusion", ...}``.

    Unreadable images are left out and listed in ``skipped``. With ``truth`` (``read_truth``), images it does
    not name are classified but not scored; a truth label outside ``labels`` is refused (a typo would otherwise
    count as a miss).
    """
    paths = [str(p) for p in paths]
    if not paths:
        raise EvalError("no images to classify")
    if truth is not None:
        unknown = sorted(set(truth.values()) - set(labels))
        if unknown:
            raise EvalError(f"the truth file uses labels that are not in the label list: {unknown[:10]}")
    rows, failed = embedder.classify(paths, list(labels), template=list(templates), top=top, on_error="skip",
                                     show_progress=progress)
    out = {"n_images": len(rows), "skipped": {paths[i]: reason for i, reason in failed.items()}, "rows": rows,
           "labels": list(labels), "templates": list(templates)}
    if truth is not None:
        scored = [(truth[str(Path(r["path"]).resolve())], r["label"]) for r in rows
                  if str(Path(r["path"]).resolve()) in truth]
        if not scored:
            raise EvalError("none of the classified images is named in the truth file")
        t, p = zip(*scored)
        out.update(n_scored=len(scored), accuracy=float(np.mean([a == b for a, b in scored])),
                   confusion=confusion(labels, t, p).tolist())
    return out
