"""When nothing matches: the cut-off below which a search lists no photo. One rule for ``clip-mini search``, the
Python API (``EmbeddingIndex.hits``) and ``clip-mini serve``: ``resolve_cutoff`` says which, ``Cutoff.split``
applies it to one query's hits.

``auto`` (the default of ``clip-mini search`` and the server's page) is the model's own calibrated rule, measured on
its validation split when it was trained (``clip_mini.eval.cutoff``) and stored in its ``config.json``
(``trained.val``): a search lists nothing unless its best hit reaches ``cutoff_best_cosine``; when it does, it lists
the hits that reach ``cutoff_cosine``. Calibrated so that 90 % of the captions whose photo ranks in the top 5 still
list it. A model calibrated before the best-hit floor existed has ``cutoff_cosine`` alone: every hit must reach it.
A built-in model may carry ``cutoff.json`` beside its package, a calibration of the shipped weights that replaces
the trainer's (``calibrated_for`` names the package fingerprint it was measured on; it is read only for that one).
A model with neither (saved without a validation split) gets no cut-off. ``min_score`` sets one cosine by hand:
every hit must reach it. Torch-free.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from clip_mini.errors import QueryError

SIDECAR = "cutoff.json"   # a built-in package's calibration of its shipped weights


class HitList(list):
    """One query's hits that passed a cut-off (a plain list of hit dicts), with ``below`` (how many of the top K it
    dropped), ``best_below`` (the best dropped hit, or None), ``min_score`` (the cosine a listed hit reaches; None:
    no cut-off) and ``min_best`` (the cosine the best hit must reach for any to be listed; None: no cut-off)."""
    below: int = 0
    best_below: Optional[dict] = None
    min_score: Optional[float] = None
    min_best: Optional[float] = None


@dataclass(frozen=True)
class Cutoff:
    """A search lists nothing unless its best hit reaches ``best``; then the hits that reach ``hit``."""
    hit: float
    best: float
    source: str = "model"   # "model": the model's calibrated rule; "min_score": a cosine of the caller's

    def split(self, scores: Sequence[float]) -> list[bool]:
        """Which of one query's hit ``scores`` are listed."""
        scores = [float(s) for s in scores]
        if not scores or max(scores) < self.best:
            return [False] * len(scores)
        return [s >= self.hit for s in scores]


def split_hits(scores: Sequence[float], rule: Optional[Cutoff]) -> list[bool]:
    """``rule.split(scores)``; every hit passes without a rule."""
    return [True] * len(scores) if rule is None else rule.split(scores)


def check_cutoff(cutoff: Any) -> Optional[str]:
    """``"auto"`` or None (no cut-off); anything else is a ``QueryError``."""
    if cutoff is None or cutoff is False or (isinstance(cutoff, str) and cutoff.strip().lower() in ("none", "off")):
        return None
    if cutoff is True or (isinstance(cutoff, str) and cutoff.strip().lower() == "auto"):
        return "auto"
    raise QueryError(f"cut-off {cutoff!r}: give auto (the model's calibrated cut-off) or none; a cosine of your own "
                     "goes in min_score (--min-score)")


def _number(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _rule(values: Any) -> Optional[Cutoff]:
    if not isinstance(values, dict):
        return None
    hit = _number(values.get("cutoff_cosine"))
    if hit is None:
        return None
    best = _number(values.get("cutoff_best_cosine"))
    return Cutoff(hit=hit, best=hit if best is None else max(best, hit))


def model_cutoff(model_dir: str | Path) -> Optional[Cutoff]:
    """The calibrated rule of ``model_dir``: a built-in model's ``cutoff.json`` (when it was measured on this
    package), else ``trained.val`` in its config.json; None without one."""
    config = _read(Path(model_dir) / "config.json")
    name = config.get("builtin")
    from clip_mini.builtin.registry import BUILTIN_ROOT, is_builtin_name

    if is_builtin_name(name):
        sidecar = _read(Path(BUILTIN_ROOT) / name / SIDECAR)
        if sidecar.get("calibrated_for") == config.get("builtin_fingerprint") and _rule(sidecar):
            return _rule(sidecar)
    trained = config.get("trained")
    return _rule(trained.get("val")) if isinstance(trained, dict) else None


def resolve_cutoff(cutoff: Any, min_score: Optional[float], model_dir: str | Path) -> Optional[Cutoff]:
    """The rule hits must pass: ``min_score`` when given (every hit must reach it), else the model's own with
    ``cutoff="auto"``, else None."""
    if min_score is not None:
        return Cutoff(hit=float(min_score), best=float(min_score), source="min_score")
    return model_cutoff(model_dir) if check_cutoff(cutoff) == "auto" else None
