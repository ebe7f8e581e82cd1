"""A model's own cut-off for "nothing matches", calibrated on its validation split.

Each val caption is searched twice: against the val images (its photo present) and against them without its photo.
The rule (``clip_mini.retrieval.cutoff``) has two cosines. A search lists nothing unless its best hit reaches
``cutoff_best_cosine``; when it does, it lists the hits that reach ``cutoff_cosine``. Calibration:

* ``cutoff_cosine`` keeps ``HIT_KEEP`` (98 %) of the true photos that rank in the top ``K`` (each hit's floor);
* ``cutoff_best_cosine`` is the highest cosine at which ``KEEP`` (90 %) of the captions whose photo ranks in the top
  ``K`` still list it (their best hit reaches it and their photo reaches ``cutoff_cosine``);
* ``cutoff_kept`` is that share, ``cutoff_empty`` the share of the photo-removed searches that list nothing.

Why the best hit decides: a caption whose photo ranks 2nd to 5th has a best hit at least as good as its photo, so a
floor on the best hit keeps it at a higher cosine than a floor on every hit can. On Flickr8k val with the built-in
``photos`` model the old one-cosine rule (every hit must reach the cosine that keeps 90 %) answered 7 % of the
photo-removed searches with nothing, this rule about 23 %, at the same 90 % kept
(``benchmarks/quality/cutoff_flickr8k.py``, fitted on half the val photos and scored on the other half).

The trainer scores this at every evaluation, so the numbers travel in the saved model's ``config.json``
(``trained.val``), where search reads its default cut-off. Raw cosines, not scores relative to the index: as a
gate at 90 % kept, a z-score against the index's scores, the gap from the best hit to the 2nd, 10th or 50th, the
best photo's score against a bank of other captions, or a logistic mix of them, emptied no more removed searches
than the best cosine (at most 0.005 more, within the halves' noise; the study's ``candidates``), and the shapes
demo's scores are bimodal (a colour matches or it does not), where a z-score cannot tell present from absent.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

KEEP = 0.90       # share of the captions whose photo ranks in the top K that still list it
HIT_KEEP = 0.98   # share of those photos that reach the per-hit floor
K = 5


class Cases(NamedTuple):
    """Per caption: its photo's cosine and rank (0-based, ties against the query), the best cosine of the search
    with its photo present and with it removed."""
    true: np.ndarray
    rank: np.ndarray
    best: np.ndarray
    removed: np.ndarray


def true_and_removed(sim: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a (captions, images) cosine matrix and each caption's image: the true image's score, its rank (0-based,
    ties against the query) and the best score among the other images (the search with the photo removed)."""
    sim = np.asarray(sim, dtype=np.float64)
    rows = np.arange(len(sim))
    true = sim[rows, truth]
    rank = (sim > true[:, None]).sum(1) + (sim == true[:, None]).sum(1) - 1
    other = sim.copy()
    other[rows, truth] = -np.inf
    return true, rank, other.max(1)


def search_cases(image_features, text_features, text_image_ids, chunk: int = 4096) -> Cases:
    """``Cases`` for L2-normalised features and each caption's image (row of ``image_features``)."""
    img = np.asarray(image_features, dtype=np.float32)
    txt = np.asarray(text_features, dtype=np.float32)
    ids = np.asarray(text_image_ids, dtype=np.int64)
    parts = [true_and_removed(txt[s:s + chunk] @ img.T, ids[s:s + chunk]) for s in range(0, len(txt), chunk)]
    true, rank, removed = (np.concatenate(x) for x in zip(*parts)) if parts else (np.zeros(0),) * 3
    return Cases(true, rank, np.maximum(true, removed), removed)


def _short(x: float) -> float:
    """A short number at or below ``x`` (a cut-off rounded down keeps what it kept)."""
    return math.floor(x * 1e6) / 1e6


def floor_keeping(scores: np.ndarray, keep: float) -> float:
    """The highest (short) cosine that at least ``keep`` of ``scores`` reach."""
    return _short(float(np.quantile(scores, 1 - keep, method="lower")))


def score_rule(cases: Cases, hit: float, best: float, k: int = K) -> dict[str, float]:
    """``{"kept", "empty_when_removed"}`` of the rule (``hit``, ``best``) on ``cases``: kept is the share of the
    captions whose photo ranks in the top ``k`` that list it, empty the share of photo-removed searches that list
    nothing."""
    top = cases.rank < k
    listed = top & (cases.best >= best) & (cases.true >= hit)
    return {"kept": float(listed.sum() / max(top.sum(), 1)),
            "empty_when_removed": float((cases.removed < max(hit, best)).mean())}


def fit_rule(cases: Cases, k: int = K, keep: float = KEEP, hit_keep: Optional[float] = HIT_KEEP) -> dict[str, float]:
    """The two cosines for ``cases`` (``{"cutoff_cosine", "cutoff_best_cosine", "cutoff_kept", "cutoff_empty"}``),
    or ``{}`` when no caption's photo ranks in the top ``k``. ``hit_keep=None`` fits the old one-cosine rule (every
    hit must reach the cosine that keeps ``keep``; both cosines are that one)."""
    top = cases.rank < k
    if not top.any():
        return {}
    if hit_keep is None:
        hit = best = floor_keeping(cases.true[top], keep)
    else:
        hit = floor_keeping(cases.true[top], max(hit_keep, keep))
        need = int(math.ceil(keep * top.sum()))   # captions that must still list their photo
        candidates = np.sort(cases.best[top & (cases.true >= hit)])[::-1]
        best = max(_short(float(candidates[need - 1])), hit)
    scored = score_rule(cases, hit, best, k)
    return {"cutoff_cosine": hit, "cutoff_best_cosine": best, "cutoff_kept": scored["kept"],
            "cutoff_empty": scored["empty_when_removed"]}


def calibrate(image_features, text_features, text_image_ids, k: int = K, keep: float = KEEP,
              hit_keep: Optional[float] = HIT_KEEP, chunk: int = 4096) -> dict[str, float]:
    """``fit_rule`` on the val searches of L2-normalised features and each caption's image; ``{}`` for fewer than
    two images."""
    if len(np.asarray(image_features)) < 2:
        return {}
    return fit_rule(search_cases(image_features, text_features, text_image_ids, chunk), k, keep, hit_keep)
