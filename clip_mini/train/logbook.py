"""Run records: ``metrics.jsonl`` (one JSON object per line), ``curves.png`` and the end-of-run summary table.

Rows (the contract ``clip_mini.pictures.draw.plot_curves`` reads):

* ``{"kind": "step", "step", "epoch", "loss", "lr", "logit_scale", "grad_norm", "pairs_per_s", "data_wait"}``
  every ``train.log_every`` steps (``loss`` averaged over those steps; ``data_wait`` is the fraction of the
  time spent waiting for batches);
* ``{"kind": "epoch", "step", "epoch", "train_loss", "val_loss", "val_t2i_r1", ..., "val_rsum", "time_s", "eval_s"}``
  after each evaluation (epoch 0 is the untrained model).

The whole file is rewritten atomically at each flush (it stays small), so a reader never sees a torn line.
On resume the rows past the checkpoint are dropped, so a resumed run's log reads like an uninterrupted one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from clip_mini.fileio.atomic import atomic_path, atomic_write_text

METRIC_NAMES = ("loss", "t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr",
                "rsum")
LOWER_IS_BETTER = ("loss", "t2i_medr", "i2t_medr")


def metric_key(name: str) -> str:
    """``"t2i_r1"`` or ``"val_t2i_r1"`` -> ``"t2i_r1"``; raises ``ValueError`` for an unknown metric."""
    base = name.removeprefix("val_")
    if base not in METRIC_NAMES:
        raise ValueError(f"unknown metric {name!r} (one of {', '.join(METRIC_NAMES)}, optionally val_-prefixed)")
    return base


def is_better(name: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value < best if metric_key(name) in LOWER_IS_BETTER else value > best


class MetricsLog:
    """In-memory rows of ``metrics.jsonl``, flushed by rewriting the file atomically."""

    def __init__(self, path: str | Path, rows: Iterable[dict] = ()):
        self.path = Path(path)
        self.rows = list(rows)

    @classmethod
    def resume(cls, path: str | Path, step: int, epochs_done: int) -> "MetricsLog":
        """Rows of an earlier run up to a checkpoint: steps <= ``step``, evaluations of epochs <= ``epochs_done``."""
        path = Path(path)
        rows = []
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue   # cannot happen with atomic rewrites; a hand-edited file just loses the line
                if row.get("kind") == "step" and row.get("step", 0) <= step:
                    rows.append(row)
                elif row.get("kind") == "epoch" and row.get("epoch", 0) <= epochs_done:
                    rows.append(row)
        return cls(path, rows)

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def flush(self) -> None:
        atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=False) + "\n" for r in self.rows))

    def epochs(self) -> list[dict]:
        return [r for r in self.rows if r.get("kind") == "epoch"]


def write_curves(rows: list[dict], out_png: str | Path) -> None:
    """Plot loss and recall curves via ``clip_mini.pictures.draw.plot_curves``, written atomically."""
    from clip_mini.pictures.draw import plot_curves

    with atomic_path(out_png, suffix=".png") as tmp:
        plot_curves(rows, tmp)


def summary_table(rows: list[dict], best_metric: str) -> str:
    """A fixed-width table of the evaluations, the best one marked with ``*``."""
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    cols = [("epoch", "epoch", "{:d}"), ("step", "step", "{:d}"), ("train_loss", "train loss", "{:.4f}"),
            ("val_loss", "val loss", "{:.4f}"), ("val_t2i_r1", "t2i R@1", "{:.3f}"),
            ("val_t2i_r5", "t2i R@5", "{:.3f}"), ("val_i2t_r1", "i2t R@1", "{:.3f}"),
            ("val_i2t_r5", "i2t R@5", "{:.3f}"), ("val_t2i_medr", "t2i medr", "{:.1f}"),
            ("val_rsum", "rsum", "{:.3f}")]
    key = "val_" + metric_key(best_metric)
    scored = [r for r in epochs if r.get("epoch", 0) > 0 and key in r]
    best = None
    for r in scored:
        if best is None or is_better(best_metric, r[key], best[key]):
            best = r
    header = " ".join(f"{title:>10}" for _, title, _ in cols)
    lines = [header, "-" * len(header)]
    for r in epochs:
        cells = [f"{fmt.format(r[k]) if r.get(k) is not None else '-':>10}" for k, _, fmt in cols]
        lines.append(" ".join(cells) + (" *" if r is best else ""))
    return "\n".join(lines)

