"""A model's own cut-off for "nothing matches", calibrated on its validation split.

Each val caption is searched twice: against the val images (its photo present) and against them without its photo.
The calibrated cut-off is the cosine that keeps ``KEEP`` of the captions whose photo ranks in the top ``K``; at it,
``cutoff_empty`` is the share of the photo-removed searches that return nothing. The trainer scores this at every
evaluation, so the numbers travel in the saved model's ``config.json`` (``trained.val``), where search reads its
default cut-off (``clip_mini.retrieval.cutoff``). A raw cosine, not a score relative to the index: the shapes
demo's scores are bimodal (a colour matches or it does not), and there a z-score against the index's scores cannot
tell a present photo from an absent one (benchmarks/quality/cutoff_flickr8k.py compares both on photos).
"""
from __future__ import annotations

import math

import numpy as np

KEEP = 0.90   # share of true top-K hits the default cut-off keeps
K = 5


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


def calibrate(image_features, text_features, text_image_ids, k: int = K, keep: float = KEEP,
              chunk: int = 4096) -> dict[str, float]:
    """``{"cutoff_cosine", "cutoff_kept", "cutoff_empty"}`` for L2-normalised features and each caption's image."""
    img = np.asarray(image_features, dtype=np.float32)
    txt = np.asarray(text_features, dtype=np.float32)
    ids = np.asarray(text_image_ids, dtype=np.int64)
    parts = [true_and_removed(txt[s:s + chunk] @ img.T, ids[s:s + chunk]) for s in range(0, len(txt), chunk)]
    true, rank, removed = (np.concatenate(x) for x in zip(*parts))
    top = true[rank < k]
    if not len(top) or len(img) < 2:
        return {}
    threshold = float(np.quantile(top, 1 - keep, method="lower"))   # at least `keep` of them score >= it
    threshold = math.floor(threshold * 1e6) / 1e6                    # a short number that still keeps them
    return {"cutoff_cosine": threshold, "cutoff_kept": float((top >= threshold).mean()),
            "cutoff_empty": float((removed < threshold).mean())}
