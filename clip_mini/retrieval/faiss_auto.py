"""``index --faiss ...``: tune the stored faiss index's search parameter to a target recall, as autofaiss does.

The index kind comes from the size (``build.faiss_kind``: none below ``search.FAISS_THRESHOLD`` rows, where exact
search is fast enough; HNSW, whose float32 copy of the rows must fit in RAM; IVF-PQ with exact re-ranking from the
memory-mapped rows from ``search.IVFPQ_THRESHOLD``, past RAM). Its search parameter (HNSW ``efSearch``, IVF
``nprobe``) is then raised step by step until recall@10 against exact search reaches ``recall_target`` on proxy
queries, and the result is stored in the manifest (``faiss_params``) so every search uses it.

Proxy queries stand in for text queries, which an index of images does not have: each is a stored row blended
with random noise so that its cosine to that row is ``PROXY_COSINE``. Text queries sit that far from their best
image (the modality gap: a caption's best image sits at a cosine well below 1) while near-copy queries (cosine ~1)
make every index look perfect. ``benchmarks/results/speed/ann_real.json`` checks the tuned parameter on text-like
queries generated from real Flickr8k embeddings.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from clip_mini.retrieval import search as S

PROXY_COSINE = 0.5       # a little below a caption's typical best text->image cosine: errs towards more probing
PROXY_QUERIES = 200
RECALL_TARGET = 0.95
STEPS = {"hnsw": [16, 32, 64, 128, 256, 512, 1024], "ivf": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
         "ivfpq": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}


def proxy_queries(embeddings: np.ndarray, n: int = PROXY_QUERIES, cosine: float = PROXY_COSINE, seed: int = 0
                  ) -> np.ndarray:
    """(n, d) unit queries, each at ``cosine`` from a random stored row (noise orthogonal to the row)."""
    rng = np.random.default_rng(seed)
    rows = np.asarray(embeddings[np.sort(rng.choice(len(embeddings), size=min(n, len(embeddings)), replace=False))],
                      dtype=np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    noise = rng.standard_normal(rows.shape).astype(np.float32)
    noise -= (noise * rows).sum(1, keepdims=True) * rows
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    return cosine * rows + np.sqrt(1 - cosine ** 2) * noise


def get_param(index, kind: str) -> int:
    return int(index.hnsw.efSearch if kind == "hnsw" else index.nprobe)


def set_param(index, kind: str, value: int) -> None:
    """Apply a stored search parameter to a loaded faiss index."""
    if kind == "hnsw":
        index.hnsw.efSearch = int(value)
    else:
        index.nprobe = int(min(value, index.nlist))


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a[a >= 0]) & set(b)) / len(b) for a, b in zip(found, truth)]))


def tune(index, kind: str, embeddings: np.ndarray, recall_target: float = RECALL_TARGET, k: int = 10,
         queries: Optional[np.ndarray] = None) -> dict:
    """Smallest search parameter reaching ``recall_target`` (recall@k vs exact) on ``queries`` (default: proxies).

    Returns the manifest's ``faiss_params``: the parameter, the recall it measured, the target, and how.
    If no step reaches the target the largest is kept and ``reached`` says so.
    """
    if not 0 < recall_target <= 1:
        raise ValueError(f"recall target must be in (0, 1], got {recall_target}")
    queries = proxy_queries(embeddings) if queries is None else queries
    k = min(k, len(embeddings))
    _, truth = S.exact_search(embeddings, queries, k)
    rerank = embeddings if kind == "ivfpq" else None
    steps = [s for s in STEPS[kind] if kind == "hnsw" or s <= index.nlist] or [STEPS[kind][0]]
    for value in steps:
        set_param(index, kind, value)
        t = time.perf_counter()
        _, ids = S.faiss_search(index, queries, k, rerank=rerank)
        ms = 1000 * (time.perf_counter() - t) / len(queries)
        recall = recall_at(ids, truth)
        if recall >= recall_target:
            break
    name = "efSearch" if kind == "hnsw" else "nprobe"
    return {name: value, "recall_at_10": round(recall, 4), "recall_target": recall_target,
            "reached": recall >= recall_target, "ms_per_query": round(ms, 3),
            "tuned_on": f"{len(queries)} proxy queries at cosine {PROXY_COSINE} from stored rows"}


def apply_params(index, kind: str, params: Optional[dict]) -> None:
    """Set a loaded index's search parameter from the manifest's ``faiss_params`` (if any)."""
    if params:
        value = params.get("efSearch" if kind == "hnsw" else "nprobe")
        if value is not None:
            set_param(index, kind, value)
