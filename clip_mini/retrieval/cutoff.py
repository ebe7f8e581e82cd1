"""When nothing matches: a cut-off on how far a hit stands above the index's own scores for that query.

A raw cosine threshold fails across queries and collections (Immich #5996): a generic query scores every photo
high, a precise one scores every photo low, and each model has its own scale. Here the cosine of a hit is read
against the distribution of the same query's cosines over the whole index, as a z-score
``(s - q.mean) / sqrt(q' Cov q)``. The mean and covariance of the index's rows give both moments for any query
in O(d^2), without scoring the index again. ``DEFAULT_Z`` was chosen on Flickr8k val with the built-in photo model
(benchmarks/quality/cutoff_flickr8k.py, benchmarks/results/quality/cutoff_flickr8k.json). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_Z = 3.0
SAMPLE_ROWS = 20_000   # moments from evenly spaced rows: a 256-d covariance is stable long before 1M rows
_CHUNK = 8192


@dataclass(frozen=True)
class IndexStats:
    mean: np.ndarray   # (d,) float64
    cov: np.ndarray    # (d, d) float64
    rows: int          # rows the moments were taken from

    @classmethod
    def from_rows(cls, rows: np.ndarray, sample: int = SAMPLE_ROWS) -> "IndexStats":
        """Moments of ``rows`` (any float dtype, memory-mapped is fine), from at most ``sample`` evenly spaced rows."""
        n = len(rows)
        if n == 0:
            raise ValueError("an empty index has no score distribution")
        pick = np.arange(n) if n <= sample else np.linspace(0, n - 1, sample).round().astype(np.int64)
        d = rows.shape[1]
        total, outer = np.zeros(d), np.zeros((d, d))
        for start in range(0, len(pick), _CHUNK):
            x = np.asarray(rows[pick[start:start + _CHUNK]], dtype=np.float64)
            total += x.sum(0)
            outer += x.T @ x
        mean = total / len(pick)
        cov = outer / len(pick) - np.outer(mean, mean)
        return cls(mean=mean, cov=cov, rows=len(pick))

    def moments(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of each query's cosines over the index: two ``(q,)`` arrays."""
        q = np.asarray(queries, dtype=np.float64).reshape(-1, len(self.mean))
        var = np.einsum("qd,de,qe->q", q, self.cov, q)
        return q @ self.mean, np.sqrt(np.maximum(var, 1e-12))

    def z(self, queries: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """``scores`` (``(q, k)`` cosines of each query's hits) as z-scores against the index's distribution."""
        mu, sd = self.moments(queries)
        return (np.asarray(scores, dtype=np.float64) - mu[:, None]) / sd[:, None]


def keep_mask(stats: IndexStats | None, queries: np.ndarray, scores: np.ndarray, min_score: float | None = None,
              min_z: float | None = DEFAULT_Z) -> np.ndarray:
    """Which hits pass: cosine >= ``min_score`` when given, else z >= ``min_z`` (None: every hit passes)."""
    scores = np.asarray(scores)
    if min_score is not None:
        return scores >= min_score
    if min_z is None or stats is None:
        return np.ones(scores.shape, dtype=bool)
    return stats.z(queries, scores) >= min_z
