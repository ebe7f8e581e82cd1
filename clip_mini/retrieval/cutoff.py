"""When nothing matches: the cut-off below which a search lists no photo.

``auto`` (the default of ``clip-mini search`` and the server's page) is the model's own calibrated cosine, measured
on its validation split when it was trained (``clip_mini.eval.cutoff``: it keeps 90 % of the captions whose photo
ranks in the top 5) and stored in its ``config.json``. A model without one (trained before calibration existed, or
saved without a validation split) gets no cut-off. ``min_score`` sets the cosine by hand. Torch-free.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from clip_mini.errors import QueryError


class HitList(list):
    """One query's hits that passed a cut-off (a plain list of hit dicts), with ``below`` (how many of the top K it
    dropped), ``best_below`` (the best dropped hit, or None) and ``min_score`` (the cosine it asked; None: none)."""
    below: int = 0
    best_below: Optional[dict] = None
    min_score: Optional[float] = None


def check_cutoff(cutoff: Any) -> Optional[str]:
    """``"auto"`` or None (no cut-off); anything else is a ``QueryError``."""
    if cutoff is None or cutoff is False or (isinstance(cutoff, str) and cutoff.strip().lower() in ("none", "off")):
        return None
    if cutoff is True or (isinstance(cutoff, str) and cutoff.strip().lower() == "auto"):
        return "auto"
    raise QueryError(f"cut-off {cutoff!r}: give auto (the model's calibrated cut-off) or none; a cosine of your own "
                     "goes in min_score (--min-score)")


def model_cutoff(model_dir: str | Path) -> Optional[float]:
    """The calibrated cosine ``model_dir`` records (``trained.val.cutoff_cosine`` in its config.json), or None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        value = config.get("trained", {}).get("val", {}).get("cutoff_cosine")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def resolve_min_score(cutoff: Any, min_score: Optional[float], model_dir: str | Path) -> Optional[float]:
    """The cosine hits must reach: ``min_score`` when given, else the model's own with ``cutoff="auto"``."""
    if min_score is not None:
        return float(min_score)
    return model_cutoff(model_dir) if check_cutoff(cutoff) == "auto" else None
