"""Near-duplicate images in an index, from its stored embeddings alone (nothing is re-embedded).

Every pair of rows whose cosine similarity is at least ``threshold`` is linked (up to the rounding of the stored
rows: ``score_tolerance``), and the links form groups by one of two rules (``linkage``):

* ``single`` (the default): linked rows share a group, and so do rows linked through others. A chain of edits
  A~B~C is one group even when A and C are far apart; each group reports its ``lowest`` pairwise similarity so
  such chains show.
* ``complete``: every two rows of a group are linked (agglomerative complete linkage: the two groups whose least
  similar pair is the most similar merge first, while that pair reaches the threshold), so ``lowest`` is at
  least the threshold.

Two ways to find the pairs, with the same contract:

* ``exact``: blocks of rows against the rows after them (the upper triangle of the similarity matrix), each block
  a float32 matrix product of bounded size. Cost grows with N^2, fine up to ``RANGE_MIN_ROWS``.
* ``faiss``: an IVF index with 8-bit scalar-quantised rows (d bytes a row, built in memory) answers a range search
  for each block of rows; the candidate pairs it returns (at a radius ``SQ_MARGIN`` below the threshold, because
  the 8-bit scores are approximate) are re-scored exactly from the stored rows before the threshold is applied.
  Only a few inverted lists are probed (near-duplicates sit in the same cell as each other or the next one), and
  row i may probe row j's list while j does not probe i's, so a pair found from either of its rows is kept. The
  cost grows with N * (rows per probed list), and memory is the quantised rows plus one block's results.

A low threshold links a share of all N^2/2 pairs, which no memory holds at scale: the number of pairs is
estimated from a sample of rows before the search and counted during it, and more than ``max_pairs`` is refused.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

from clip_mini.retrieval.dupe_groups import LINKAGES, DuplicateGroup, Linkage, complete_groups, single_groups
from clip_mini.retrieval.format import EmbeddingIndexError
from clip_mini.retrieval.rows import BF16Rows

# For the stored search embeddings (``clip-mini dupes --features embedding``): the planted-copy study
# (benchmarks/studies/dupes_planted.py) chose it on its tuning set of photos with a pretrained DINOv2 stand-in; a model
# whose embeddings spread differently may want another (``--threshold``). The tower features have their own
# (``dupe_features.TOWER_THRESHOLD``).
DEFAULT_THRESHOLD = 0.965
RANGE_MIN_ROWS = 20_000   # from here `auto` uses the faiss range search: the exact pass grows with N^2
SQ_MARGIN = 0.03          # 8-bit scalar quantisation moves a unit-row cosine by well under this
# Linked pairs kept in memory (20 bytes each: two int64 rows and a float32 score, so 200 MB): photo collections
# have a few near-duplicate pairs per image, so this is reached only by a threshold far below near-duplicates.
DEFAULT_MAX_PAIRS = 10_000_000
_SAMPLE_ROWS = 2048       # rows whose pairs estimate the number of linked pairs before the search
_NPROBE = 8
_BLOCK = 4096             # rows per block: a (4096, 8192) float32 score block is 128 MB at most

Pairs = Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]


def check_threshold(threshold) -> float:
    """A cosine threshold in (0, 1]; anything else is refused with the value named."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)) \
            or not math.isfinite(threshold) or not 0 < threshold <= 1:
        raise EmbeddingIndexError(f"the duplicate threshold must be a cosine similarity above 0 and at most 1, "
                                  f"got {threshold!r}")
    return float(threshold)


def score_tolerance(embeddings) -> float:
    """How far the float32 dot product of two stored rows can sit from the cosine of the unit rows they store.

    Each stored element is the unit row's element rounded to the storage type: off by at most ``u`` times itself
    (the unit roundoff: 2^-11 for float16, 2^-8 for bfloat16, 2^-24 for float32, which every row is converted to
    before the product) plus ``eta``, half the smallest subnormal (2^-25 for float16). For unit rows x, y of d
    elements, sum |x_i y_i| <= 1 and sum |x_i| <= sqrt(d), so the stored rows' exact dot product is within
    ``2u + u^2 + 2 eta sqrt(d) (1 + u) + d eta^2`` of x.y, and a float32 sum of d products adds at most
    ``gamma_d = d 2^-24 / (1 - d 2^-24)`` times the sum of their magnitudes, at most ``(1 + u + eta sqrt(d))^2``.

    For float16 rows of 512 elements that is 1.0e-3: an image stored twice scores anywhere in 1 +- 1.0e-3 with
    itself (0.99987 to 1.00013 measured), so a pair is linked from ``threshold - score_tolerance``.
    """
    storage = embeddings.storage if isinstance(embeddings, BF16Rows) else np.dtype(embeddings.dtype).name
    if storage == "bfloat16":
        u, eta = 2.0 ** -8, 2.0 ** -134
    else:
        info = np.finfo(np.dtype(storage)) if np.issubdtype(np.dtype(storage), np.floating) else np.finfo(np.float32)
        u, eta = max(float(info.eps) / 2, 2.0 ** -24), max(float(info.smallest_subnormal) / 2, 2.0 ** -150)
    d = embeddings.shape[1]
    rounding = 2 * u + u * u + 2 * eta * math.sqrt(d) * (1 + u) + d * eta * eta
    gamma = d * 2.0 ** -24 / (1 - d * 2.0 ** -24)
    return rounding + gamma * (1 + u + eta * math.sqrt(d)) ** 2


def _f32(embeddings, start: int, stop: int) -> np.ndarray:
    block = embeddings[start:stop]
    return np.asarray(block, dtype=np.float32)


def _too_many(threshold: float, n: int, pairs: str, max_pairs: int) -> EmbeddingIndexError:
    return EmbeddingIndexError(
        f"--threshold {threshold} links {pairs} pairs of the {n:,} rows, more than --max-pairs {max_pairs:,} "
        f"(20 bytes a pair in memory): near-duplicates are a small share of all pairs, so raise --threshold "
        f"(the default is {DEFAULT_THRESHOLD}), or raise --max-pairs if that many pairs are expected")


def estimate_pairs(embeddings, cutoff: float, sample: int = _SAMPLE_ROWS, seed: int = 0) -> float:
    """The number of pairs scoring at least ``cutoff``, counted among ``sample`` random rows and scaled to all."""
    n = len(embeddings)
    idx = np.sort(np.random.default_rng(seed).choice(n, size=min(n, sample), replace=False))
    rows = np.asarray(embeddings[idx], dtype=np.float32)
    m = len(rows)
    linked = np.count_nonzero(np.triu(rows @ rows.T >= cutoff, k=1))
    return linked * (n * (n - 1)) / (m * (m - 1))


def exact_pairs(embeddings, threshold: float, block: int = _BLOCK, max_pairs: Optional[int] = None) -> Pairs:
    """Yield ``(i, j, similarity)`` arrays of every pair ``i < j`` at or above ``threshold``, block by block.

    Raises:
        EmbeddingIndexError: more than ``max_pairs`` pairs (counted before a block's pairs are gathered).
    """
    n = len(embeddings)
    found = 0
    for a in range(0, n, block):
        qa = _f32(embeddings, a, min(a + block, n))
        for b in range(a, n, 2 * block):
            sims = qa @ _f32(embeddings, b, min(b + 2 * block, n)).T
            # the upper triangle: each pair once, no row with itself
            linked = (sims >= threshold) & (np.arange(a, a + len(qa))[:, None] < np.arange(b, b + sims.shape[1]))
            found += int(np.count_nonzero(linked))
            if max_pairs is not None and found > max_pairs:
                raise _too_many(threshold, n, f"more than {found:,}", max_pairs)
            i, j = np.nonzero(linked)
            if len(i):
                yield (a + i).astype(np.int64), (b + j).astype(np.int64), sims[i, j].astype(np.float32)


def _ivf_index(embeddings, nprobe: int, seed: int):
    """An IVF-SQ8 inner-product faiss index over the rows, about sqrt(N) lists, ``nprobe`` of them probed."""
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
    return index


def faiss_pairs(embeddings, threshold: float, block: int = 16384, nprobe: int = _NPROBE, seed: int = 0,
                progress: bool = False) -> Pairs:
    """``exact_pairs``'s contract from a faiss IVF-SQ8 range search with exact re-scoring (see the module), except
    that a pair can come twice (once found from each of its rows); ``find_duplicates`` keeps one."""
    n = len(embeddings)
    index = _ivf_index(embeddings, nprobe, seed)
    starts = range(0, n, block)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="dupes (faiss range search)", unit="block", leave=False)
    for start in starts:
        q = _f32(embeddings, start, min(start + block, n))
        lims, _, ids = index.range_search(q, threshold - SQ_MARGIN)
        i = np.repeat(np.arange(len(q), dtype=np.int64), np.diff(lims).astype(np.int64)) + start
        j = ids.astype(np.int64)
        # both directions: row i may probe row j's list while row j does not probe row i's
        keep = i != j
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
            yield np.minimum(i[ok], j[ok]), np.maximum(i[ok], j[ok]), sims[ok].astype(np.float32)


def find_duplicates(embeddings, threshold: float = DEFAULT_THRESHOLD, backend: str = "auto",
                    progress: bool = False, linkage: Linkage = "single", max_pairs: int = DEFAULT_MAX_PAIRS,
                    approx_from: int = RANGE_MIN_ROWS) -> list[DuplicateGroup]:
    """Groups of near-duplicate rows, most similar group first.

    Args:
        embeddings: (N, d) L2-normalised rows (an index's float16 memory map, ``BF16Rows``, or any array).
        threshold: cosine similarity at which two rows count as duplicates, in (0, 1]; pairs within
            ``score_tolerance`` below it count too, since the stored rows cannot tell them apart.
        backend: "exact", "faiss" or "auto" (faiss from ``approx_from`` rows when faiss is installed).
        linkage: "single" or "complete" (see the module).
        max_pairs: the most linked pairs held in memory; a threshold that links more is refused.

    Raises:
        EmbeddingIndexError: a threshold outside (0, 1], an unknown backend or linkage, faiss asked for but
            missing, or more than ``max_pairs`` linked pairs (the message names ``--threshold``/``--max-pairs``).
    """
    threshold = check_threshold(threshold)
    if backend not in ("auto", "exact", "faiss"):
        raise EmbeddingIndexError(f"unknown dupes backend {backend!r} (use auto, exact or faiss)")
    if linkage not in LINKAGES:
        raise EmbeddingIndexError(f"unknown dupes linkage {linkage!r} (use {' or '.join(LINKAGES)})")
    if isinstance(max_pairs, bool) or not isinstance(max_pairs, (int, np.integer)) or max_pairs < 1:
        raise EmbeddingIndexError(f"--max-pairs must be a whole number of at least 1, got {max_pairs!r}")
    if not isinstance(embeddings, BF16Rows):
        embeddings = np.asarray(embeddings) if not isinstance(embeddings, np.ndarray) else embeddings
    if embeddings.ndim != 2:
        raise EmbeddingIndexError(f"embeddings must be (N, d) rows, got shape {embeddings.shape}")
    n = len(embeddings)
    if n < 2:
        return []
    cutoff = threshold - score_tolerance(embeddings)
    estimate = estimate_pairs(embeddings, cutoff)
    if estimate > max_pairs:
        raise _too_many(threshold, n, f"about {estimate:,.0f}", max_pairs)
    if backend == "auto":
        from clip_mini.retrieval.search import faiss_available

        backend = "faiss" if n >= approx_from and faiss_available() else "exact"
    if backend == "faiss":
        try:
            pairs = faiss_pairs(embeddings, cutoff, progress=progress)
        except ImportError as e:
            raise EmbeddingIndexError(str(e)) from None
    else:
        pairs = exact_pairs(embeddings, cutoff, max_pairs=max_pairs)
    try:
        i, j, s = _collect(pairs, n, max_pairs)
    except _TooMany as e:
        raise _too_many(threshold, n, f"more than {e.args[0]:,}", max_pairs) from None
    if linkage == "complete":
        return complete_groups(i, j, s)
    return single_groups(embeddings, i, j, s)


class _TooMany(Exception):
    """More distinct pairs than the bound (the count in args[0])."""


def _collect(pairs: Pairs, n: int, max_pairs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct pairs ``(i < j, i, similarity)`` of a pair stream, sorted by (i, j), at most ``max_pairs``."""
    chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    held = 0

    def merged():
        if not chunks:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        i, j, s = (np.concatenate(c) for c in zip(*chunks))
        _, first = np.unique(i * n + j, return_index=True)   # sorted by (i, j); a pair found twice is kept once
        return i[first], j[first], s[first]

    for chunk in pairs:
        chunks.append(chunk)
        held += len(chunk[0])
        if held > max_pairs:   # repeats may be all that is over: count the distinct pairs
            chunks[:] = [merged()]
            held = len(chunks[0][0])
            if held > max_pairs:
                raise _TooMany(held)
    return merged()


def index_duplicates(index, threshold: float = DEFAULT_THRESHOLD, backend: str = "auto", progress: bool = False,
                     linkage: Linkage = "single", max_pairs: int = DEFAULT_MAX_PAIRS) -> list[dict]:
    """``find_duplicates`` over an opened index: ``{"paths", "rows", "similarity", "lowest"}`` per group."""
    groups = find_duplicates(index.embeddings, threshold, backend, progress, linkage, max_pairs)
    paths = index.items["path"]
    return [{"paths": [paths[r] for r in g.rows], "rows": g.rows, "similarity": g.similarity, "lowest": g.lowest}
            for g in groups]
