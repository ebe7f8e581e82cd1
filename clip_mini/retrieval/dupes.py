"""Near-duplicate images in an index, from its stored embeddings alone (nothing is re-embedded).

Every pair of rows whose cosine similarity is at least ``threshold`` is linked, and linked rows form a group
(single linkage: a group's ``similarity`` is its weakest link, the lowest similarity among the pairs that join it).

Two ways to find the pairs, with the same contract:

* ``exact``: blocks of rows against the rows after them (the upper triangle of the similarity matrix), each block
  a float32 matrix product of bounded size. Cost grows with N^2, fine up to ``RANGE_MIN_ROWS``.
* ``faiss``: an IVF index with 8-bit scalar-quantised rows (d bytes a row, built in memory) answers a range search
  for each block of rows; the candidate pairs it returns (at a radius ``SQ_MARGIN`` below the threshold, because
  the 8-bit scores are approximate) are re-scored exactly from the stored rows before the threshold is applied.
  Only a few inverted lists are probed (near-duplicates sit in the same cell as each other or the next one), so
  the cost grows with N * (rows per probed list), and memory is the quantised rows plus one block's results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from clip_mini.retrieval.format import EmbeddingIndexError
from clip_mini.retrieval.rows import BF16Rows

# The planted-copy study (benchmarks/studies/dupes_planted.py) chose this on its tuning set of photos; a model whose
# embeddings spread differently may want another (``--threshold``).
DEFAULT_THRESHOLD = 0.965
RANGE_MIN_ROWS = 20_000   # from here `auto` uses the faiss range search: the exact pass grows with N^2
SQ_MARGIN = 0.03          # 8-bit scalar quantisation moves a unit-row cosine by well under this
_NPROBE = 8
_BLOCK = 4096             # rows per block: a (4096, 8192) float32 score block is 128 MB at most


@dataclass
class DuplicateGroup:
    """Rows of one near-duplicate group (ascending) and its weakest link's cosine similarity."""

    rows: list[int]
    similarity: float


def check_threshold(threshold) -> float:
    """A cosine threshold in (0, 1]; anything else is refused with the value named."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)) \
            or not math.isfinite(threshold) or not 0 < threshold <= 1:
        raise EmbeddingIndexError(f"the duplicate threshold must be a cosine similarity above 0 and at most 1, "
                                  f"got {threshold!r}")
    return float(threshold)


def _f32(embeddings, start: int, stop: int) -> np.ndarray:
    block = embeddings[start:stop]
    return np.asarray(block, dtype=np.float32)


def exact_pairs(embeddings, threshold: float, block: int = _BLOCK) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                                                       np.ndarray]]:
    """Yield ``(i, j, similarity)`` arrays of every pair ``i < j`` at or above ``threshold``, block by block."""
    n = len(embeddings)
    for a in range(0, n, block):
        qa = _f32(embeddings, a, min(a + block, n))
        for b in range(a, n, 2 * block):
            sims = qa @ _f32(embeddings, b, min(b + 2 * block, n)).T
            i, j = np.nonzero(sims >= threshold)
            keep = a + i < b + j   # the upper triangle: each pair once, no row with itself
            if keep.any():
                i, j = i[keep], j[keep]
                yield (a + i).astype(np.int64), (b + j).astype(np.int64), sims[i, j].astype(np.float32)


def faiss_pairs(embeddings, threshold: float, block: int = 16384, nprobe: int = _NPROBE, seed: int = 0,
                progress: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``exact_pairs``'s contract from a faiss IVF-SQ8 range search with exact re-scoring (see the module)."""
    from clip_mini.retrieval.search import _faiss

    faiss = _faiss()
    n, dim = embeddings.shape
    nlist = max(1, min(int(math.sqrt(n)), n // 39 or 1))
    index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, nlist, faiss.ScalarQuantizer.QT_8bit,
                                          faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=min(n, nlist * 39), replace=False))
    index.train(np.asarray(embeddings[sample], dtype=np.float32))
    for start in range(0, n, 65536):
        index.add(_f32(embeddings, start, min(start + 65536, n)))
    index.nprobe = min(nprobe, nlist)
    starts = range(0, n, block)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="dupes (faiss range search)", unit="block", leave=False)
    for start in starts:
        q = _f32(embeddings, start, min(start + block, n))
        lims, _, ids = index.range_search(q, threshold - SQ_MARGIN)
        i = np.repeat(np.arange(len(q), dtype=np.int64), np.diff(lims).astype(np.int64)) + start
        j = ids.astype(np.int64)
        keep = i < j
        i, j = i[keep], j[keep]
        if not len(i):
            continue
        # exact scores from the stored rows: the quantised ones only proposed the candidates
        order = np.argsort(j, kind="stable")   # read the rows (a memory map) forwards
        i, j = i[order], j[order]
        rows_j = np.asarray(embeddings[j], dtype=np.float32)
        sims = (q[i - start] * rows_j).sum(-1)
        ok = sims >= threshold
        if ok.any():
            yield i[ok], j[ok], sims[ok].astype(np.float32)


def find_duplicates(embeddings, threshold: float = DEFAULT_THRESHOLD, backend: str = "auto",
                    progress: bool = False) -> list[DuplicateGroup]:
    """Groups of near-duplicate rows, most similar group first.

    Args:
        embeddings: (N, d) L2-normalised rows (an index's float16 memory map, ``BF16Rows``, or any array).
        threshold: cosine similarity at which two rows count as duplicates, in (0, 1].
        backend: "exact", "faiss" or "auto" (faiss from ``RANGE_MIN_ROWS`` rows when faiss is installed).

    Raises:
        EmbeddingIndexError: a threshold outside (0, 1], an unknown backend, or faiss asked for but missing.
    """
    threshold = check_threshold(threshold)
    if backend not in ("auto", "exact", "faiss"):
        raise EmbeddingIndexError(f"unknown dupes backend {backend!r} (use auto, exact or faiss)")
    if not isinstance(embeddings, BF16Rows):
        embeddings = np.asarray(embeddings) if not isinstance(embeddings, np.ndarray) else embeddings
    if embeddings.ndim != 2:
        raise EmbeddingIndexError(f"embeddings must be (N, d) rows, got shape {embeddings.shape}")
    n = len(embeddings)
    if n < 2:
        return []
    if backend == "auto":
        from clip_mini.retrieval.search import faiss_available

        backend = "faiss" if n >= RANGE_MIN_ROWS and faiss_available() else "exact"
    if backend == "faiss":
        try:
            pairs = faiss_pairs(embeddings, threshold, progress=progress)
        except ImportError as e:
            raise EmbeddingIndexError(str(e)) from None
    else:
        pairs = exact_pairs(embeddings, threshold)
    return group_pairs(n, pairs)


def group_pairs(n: int, pairs) -> list[DuplicateGroup]:
    """Connected components of the linked pairs (union-find), each with its weakest link; best group first."""
    parent = np.arange(n, dtype=np.int64)

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    edges: list[tuple[int, int, float]] = []
    for i, j, s in pairs:
        for a, b, sim in zip(i.tolist(), j.tolist(), s.tolist()):
            edges.append((a, b, sim))
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    weakest: dict[int, float] = {}
    for a, _, sim in edges:
        r = root(a)
        weakest[r] = min(weakest.get(r, 1.0), sim)
    members: dict[int, list[int]] = {r: [] for r in weakest}
    for x in sorted({x for a, b, _ in edges for x in (a, b)}):
        members[root(x)].append(x)
    groups = [DuplicateGroup(rows=rows, similarity=min(1.0, float(weakest[r]))) for r, rows in members.items()]
    groups.sort(key=lambda g: (-g.similarity, g.rows[0]))
    return groups


def index_duplicates(index, threshold: float = DEFAULT_THRESHOLD, backend: str = "auto",
                     progress: bool = False) -> list[dict]:
    """``find_duplicates`` over an opened index: ``{"paths": [...], "rows": [...], "similarity": s}`` per group."""
    groups = find_duplicates(index.embeddings, threshold, backend, progress)
    paths = index.items["path"]
    return [{"paths": [paths[r] for r in g.rows], "rows": g.rows, "similarity": g.similarity} for g in groups]
