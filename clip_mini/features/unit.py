"""``unit_rows``: the one normaliser of query and class embeddings outside torch (numpy only)."""
from __future__ import annotations

import numpy as np


def unit_rows(x) -> np.ndarray:
    """Rows as float32 scaled to unit L2 length (a zero row stays zero): the one normaliser of query and class
    embeddings outside torch."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
