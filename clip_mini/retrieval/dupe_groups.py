"""Near-duplicate groups from the linked pairs of rows (``retrieval.dupes`` finds the pairs): single or complete
linkage, and each group's weakest link and lowest pair."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

Linkage = Literal["single", "complete"]
LINKAGES = ("single", "complete")
LOWEST_MAX_ROWS = 20_000  # single-linkage groups up to this size get their lowest pair (k^2 d work each)
_BLOCK = 4096             # rows per block of the lowest-pair products


@dataclass
class DuplicateGroup:
    """Rows of one near-duplicate group (ascending) and two cosine similarities.

    ``similarity`` is the weakest link, the lowest similarity among the linked pairs that join the group (at
    least the threshold). ``lowest`` is the lowest similarity between any two of its rows: the same for a group
    whose rows are all linked (always, under complete linkage), lower for a single-linkage chain, and None for a
    single-linkage group of more than ``LOWEST_MAX_ROWS`` rows, where it is not computed.
    """

    rows: list[int]
    similarity: float
    lowest: Optional[float]


def _components(n: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Each row's component label (the smallest row of its component) under the links ``i``-``j``."""
    label = np.arange(n, dtype=np.int64)
    while True:
        li, lj = label[i], label[j]
        if np.array_equal(li, lj):
            return label
        # hook each link's larger root onto the smaller one, then point every row at its root
        low = np.minimum(li, lj)
        np.minimum.at(label, li, low)
        np.minimum.at(label, lj, low)
        while True:
            jumped = label[label]
            if np.array_equal(jumped, label):
                break
            label = jumped


def _lowest_pair(embeddings, rows: list[int], block: int = _BLOCK) -> float:
    """The lowest cosine similarity between two of ``rows`` (a float32 product of the stored rows, blockwise)."""
    x = np.asarray(embeddings[np.asarray(rows)], dtype=np.float32)
    return min(float((x[a:a + block] @ x.T).min()) for a in range(0, len(x), block))


def single_groups(embeddings, i: np.ndarray, j: np.ndarray, s: np.ndarray) -> list[DuplicateGroup]:
    """Connected components of the distinct links ``i < j`` (single linkage), best group first."""
    if not len(i):
        return []
    label = _components(len(embeddings), i, j)
    roots, inverse = np.unique(label[i], return_inverse=True)
    weakest = np.ones(len(roots), np.float32)
    np.minimum.at(weakest, inverse, s)
    links = np.bincount(inverse, minlength=len(roots))
    members = np.unique(np.concatenate([i, j]))
    member_root = np.searchsorted(roots, label[members])
    order = np.argsort(member_root, kind="stable")
    split = np.split(members[order], np.cumsum(np.bincount(member_root, minlength=len(roots)))[:-1])
    groups = []
    for rows, weak, count in zip(split, weakest.tolist(), links.tolist()):
        rows = rows.tolist()
        k = len(rows)
        if count == k * (k - 1) // 2:
            lowest = weak   # every pair is a link
        else:
            lowest = _lowest_pair(embeddings, rows) if k <= LOWEST_MAX_ROWS else None
        groups.append(DuplicateGroup(rows, min(1.0, weak), None if lowest is None else min(1.0, lowest)))
    groups.sort(key=lambda g: (-g.similarity, g.rows[0]))
    return groups


def complete_groups(i: np.ndarray, j: np.ndarray, s: np.ndarray) -> list[DuplicateGroup]:
    """Complete-linkage groups of the distinct links ``i < j``, best group first.

    Two groups can merge only while every pair across them is a link, so only such "complete" group pairs are
    kept, each with its least similar pair; merging groups a and b keeps the neighbours linked completely to both.
    A merged group goes by its smallest row, and ties merge the smallest rows first, so the result does not
    depend on the order of the links.
    """
    link: dict[int, dict[int, float]] = {}
    for a, b, sim in zip(i.tolist(), j.tolist(), s.tolist()):
        link.setdefault(a, {})[b] = sim
        link.setdefault(b, {})[a] = sim
    members = {r: [r] for r in link}
    inner = {r: 1.0 for r in link}   # each group's least similar pair
    heap = [(-sim, a, b) for a, b, sim in zip(i.tolist(), j.tolist(), s.tolist())]
    heapq.heapify(heap)
    while heap:
        neg, a, b = heapq.heappop(heap)
        if link.get(a, {}).get(b) != -neg:
            continue   # stale: a or b merged since, or their link changed
        la, lb = link.pop(a), link.pop(b)
        del la[b], lb[a]
        merged: dict[int, float] = {}
        for d in la.keys() | lb.keys():
            del link[d][a if d in la else b]
            if d in lb and d in la:
                del link[d][b]
                merged[d] = min(la[d], lb[d])
        # the merged group goes by a, its smaller row (heap entries hold a < b)
        for d, sim in merged.items():
            link[d][a] = sim
            heapq.heappush(heap, (-sim, min(a, d), max(a, d)))
        link[a] = merged
        members[a] += members.pop(b)
        inner[a] = min(inner[a], inner.pop(b), -neg)
    groups = [DuplicateGroup(sorted(rows), min(1.0, inner[r]), min(1.0, inner[r]))
              for r, rows in members.items() if len(rows) > 1]
    groups.sort(key=lambda g: (-g.similarity, g.rows[0]))
    return groups
