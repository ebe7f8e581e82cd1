"""The torch exact-search kernel (used when torch is already imported, as in a server or a notebook, or asked for).

A cheap approximate pass over the whole matrix, then exact float64 re-scoring of a short list. One or a few
queries: torch's float16 matrix-vector product (float32 accumulation, read at close to memory speed). More queries:
each cache-sized chunk goes float16 -> float32 -> bfloat16 and through a bf16 matrix product (AMX/AVX512-BF16 where
the CPU has them, much faster than fp32), of which only the maximum of each group of 16 rows is kept; on a CPU with
native bf16 the float32 chunk goes to oneDNN as it is, asked to round it to bf16 inside the product (one conversion
pass fewer); on a CPU without it (AVX2 only), where a bf16 product is emulated and an order of magnitude slower, the
float32 chunk goes through a float32 product (float16 or bfloat16 rows widen exactly: only the accumulation rounds).
The K-th best group maximum and the groups near it are found on the maxima of 64-group super-groups
first. The approximate scores' rounding error has a proven bound (``bounds.margin``); every row whose approximate
score is within twice that bound of the approximate K-th best is re-scored exactly, so no true top-K row can be
missed. fp16 arithmetic itself is never used: without native support it is emulated and far slower.

Rows stored as bfloat16 skip every conversion where the CPU has native bf16: they go straight to the bf16 matrix-vector or matrix product (a
query then costs little more than reading the rows). torch is imported only when the kernel runs.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from clip_mini.retrieval.rows import BF16Rows
from clip_mini.retrieval.search import bounds, shortlist

_MV_MAX_QUERIES = 4       # up to this many queries: one fp16 matrix-vector product each (memory-bound)
_BIG_CHUNK = 1 << 18      # rows per fp16 mv call (128 MB at d=256: the page cache streams a larger-than-RAM map)
_BF16_CHUNK = 4096        # float16 rows converted per bf16 product: the fp32 and bf16 copies stay in the L2 cache
_BF16_ROWS_CHUNK = 16384  # stored bf16 rows per product (no copies)
_IMPLICIT_CHUNK = 16384   # float16 rows per float32 chunk that oneDNN rounds to bf16 (it packs its own copy)
_GROUP = 16               # rows per group maximum in the many-queries pass
_SUPER = 64               # groups per super-group (1,024 rows): the floor and the first filter run on their maxima
_IMPLICIT_BF16 = True     # float16 rows: let oneDNN round float32 chunks to bf16 inside the product where it can
_F32_CHUNK = 8192         # rows per float32 product where there is no native bf16 (``_wide``)
_WIDE = None              # None: float32 products exactly where the CPU has no native bf16; True / False: always / never


def search(embeddings, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """An approximate pass over the whole matrix (``_few_queries`` or ``_many_queries``), then exact re-scoring of
    the rows it short-lists."""
    bf16 = isinstance(embeddings, BF16Rows)
    if not bf16 and embeddings.dtype != np.float16:
        raise ValueError(f"the torch exact-search kernel reads float16 or bfloat16 rows, not {embeddings.dtype}")
    import torch

    with warnings.catch_warnings():   # torch warns about read-only memory maps; nothing writes to it
        warnings.simplefilter("ignore")
        bits = embeddings.bits if bf16 else np.asarray(embeddings)
        E = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16 if bf16 else torch.float16)  # (N, d), no copy
    q = torch.from_numpy(queries)
    with torch.inference_mode():
        if len(queries) <= _MV_MAX_QUERIES:
            cq, ci = _few_queries(torch, E, q.bfloat16() if bf16 else q.half(), k,
                                  bounds.margin(bounds.BF16_U if bf16 else bounds.FP16_U, 2, queries.shape[1]))
        else:
            cq, ci = _many_queries(torch, E, q.bfloat16(), q, k)
    return shortlist.rescore(embeddings, queries, cq.numpy(), ci.numpy(), k)


def _few_queries(torch, E, qv, k: int, margin: float):
    """One matrix-vector product per query (memory-bound: the matrix is read at close to memory speed), each
    chunk's top ``k + 32`` kept; returns the (query, row) pairs whose approximate score is within ``margin`` of the
    approximate K-th best."""
    def approx(start: int, stop: int):
        return torch.stack([torch.mv(E[start:stop], qv[j]) for j in range(len(qv))])

    spans, tops = [], []
    for start in range(0, len(E), _BIG_CHUNK):
        a = approx(start, start + _BIG_CHUNK)
        v, i = torch.topk(a, min(k + 32, a.shape[1]), dim=1)   # (Q, keep) each
        spans.append((start, start + a.shape[1]))
        tops.append((v.float(), i + start))
    vals = torch.cat([v for v, _ in tops], 1)
    floor = torch.topk(vals, k, dim=1).values[:, -1:] - margin   # (Q, 1)
    cand_q, cand_i = [], []
    for (start, stop), (v, i) in zip(spans, tops):
        if v.shape[1] == stop - start or bool((v[:, -1:] < floor).all()):
            # Everything this chunk left out scores below the floor: its top list is complete. Otherwise (many
            # near-ties in one chunk) take every row above the floor.
            qs, cols = torch.nonzero(v >= floor, as_tuple=True)
            cand_q.append(qs)
            cand_i.append(i[qs, cols])
        else:
            qs, rows = torch.nonzero(approx(start, stop).float() >= floor, as_tuple=True)
            cand_q.append(qs)
            cand_i.append(rows + start)
    return torch.cat(cand_q), torch.cat(cand_i)


def _many_queries(torch, E, qb, qf, k: int):
    """One bf16 matrix product per chunk, rows by queries (faster than queries by rows), of which only
    each group of ``_GROUP`` rows' maximum is kept: a top-K per chunk costs twice the product. The K-th best group
    maximum is a score that K distinct rows reach, so only groups whose maximum is within ``margin`` of it can hold
    a true top-K row; their rows are scored exactly and those above the floor (the K-th best less the margin)
    returned. On a CPU without native bf16 the products are float32 instead (``_wide``): there a bf16 product is
    emulated, an order of magnitude slower (``benchmarks/speed/bench_serve.py --arm 1m`` found it)."""
    n, d = E.shape
    nq, G, S = len(qb), _GROUP, _SUPER
    groups = -(-n // G)
    if groups < k:   # fewer groups than results: every row is a candidate
        return torch.arange(nq).repeat_interleave(n), torch.arange(n).repeat(nq)
    stored = E.dtype == torch.bfloat16
    wide = _wide()   # rows widened to float32 exactly, float32 products: only the accumulation rounds
    implicit = not stored and not wide and _implicit_bf16(torch)
    margin = (bounds.margin(0.0, 0, d) if wide
              else bounds.margin(bounds.BF16_U, 2 if stored or implicit else 3, d))
    supers = -(-groups // S)
    # group maxima, padded to whole super-groups; float32 where the product hands back float32
    gmax = torch.empty(supers * S, nq, dtype=torch.float32 if implicit or wide else torch.bfloat16)
    gmax[groups:] = -math.inf
    chunk_rows = (_F32_CHUNK if wide else _BF16_ROWS_CHUNK if stored else _IMPLICIT_CHUNK if implicit
                  else _BF16_CHUNK)
    step = max(G, chunk_rows // G * G)   # whole groups per chunk
    if wide or not stored:   # -> float32 (-> bfloat16) in reused buffers (float16 -> bfloat16 directly is slower)
        f32 = torch.empty(min(step, n), d)
        b16 = None if implicit or wide else torch.empty(min(step, n), d, dtype=torch.bfloat16)
    qT = (qf if implicit or wide else qb).T.contiguous()
    with _matmul_precision(torch, "bf16" if implicit else None):
        for start in range(0, n, step):
            c = min(step, n - start)
            if wide:   # float16 or bfloat16 rows -> float32, exactly
                chunk = f32[:c].copy_(E[start:start + c])
            elif stored:
                chunk = E[start:start + c]
            elif implicit:   # oneDNN rounds the float32 rows and queries to bf16 inside the product
                chunk = f32[:c].copy_(E[start:start + c])
            else:
                chunk = b16[:c].copy_(f32[:c].copy_(E[start:start + c]))
            s = chunk @ qT   # (c, Q)
            g0, full = start // G, c // G
            torch.amax(s[:full * G].view(full, G, nq), 1, out=gmax[g0:g0 + full])
            if full * G < c:   # the last, partial group
                gmax[g0 + full] = s[full * G:].amax(0)
    g, qi, floor = _candidate_groups(torch, gmax.view(supers, S, nq), k, margin)
    # A few thousand groups qualify. Their rows are scored exactly (float32) query by query, each query's groups
    # gathered as whole 16-row blocks: several times faster than one gather and one batched product over all the
    # (group, query) pairs, whose large temporaries cost more than the arithmetic. A true top-K row scores at least
    # the approximate K-th best minus one error bound, above the floor, so the exact scores filter safely.
    full = n // G
    blocks = E[:full * G].view(full, G, d)
    offsets = torch.arange(G)
    tail_rows = torch.arange(full * G, n)
    cand_q, cand_i = [], []
    for j, gj in enumerate(g.split(torch.bincount(qi, minlength=nq).tolist())):
        tail = len(gj) > 0 and int(gj[-1]) == full   # the last, partial group
        if tail:
            gj = gj[:-1]
        rows = (gj[:, None] * G + offsets).flatten()
        s = blocks.index_select(0, gj).view(-1, d).float() @ qf[j]
        if tail:
            rows = torch.cat([rows, tail_rows])
            s = torch.cat([s, E[full * G:].float() @ qf[j]])
        keep = rows[s >= floor[j]]
        cand_q.append(torch.full_like(keep, j))
        cand_i.append(keep)
    return torch.cat(cand_q), torch.cat(cand_i)


def _candidate_groups(torch, gmax, k: int, margin: float):
    """The (group, query) pairs whose group maximum is within ``margin`` of the query's K-th best group maximum,
    sorted by query, then group; and each query's floor (that K-th best less the margin).

    ``gmax`` is (super-groups, ``_SUPER``, Q), padded with -inf. A top-K and a comparison over every group cost
    a fifth of the search at 1M rows, so both run on super-group maxima first: the K-th best super-group maximum
    is a value K distinct groups reach, so it is at most the K-th best group maximum, and every group within the
    margin of that lies in a super-group within the margin of it. Only those super-groups' groups are looked at."""
    supers, S, nq = gmax.shape
    smax = gmax.amax(1).float()   # (super-groups, Q); float32, as every bound below: bf16 would round it
    if supers >= k:
        low = torch.topk(smax, k, dim=0).values[-1] - margin   # (Q,)
    else:   # fewer super-groups than results: their K-th best bounds nothing
        low = torch.full((nq,), -math.inf)
    si, qi = torch.nonzero(smax >= low, as_tuple=True)
    order = torch.argsort(qi, stable=True)
    si, qi = si[order], qi[order]
    vals = gmax[si, :, qi]   # (pairs, S): the group maxima of each candidate super-group, for its query
    # each query's exact K-th best group maximum: its top-K groups all lie in its candidate super-groups
    counts = torch.bincount(qi, minlength=nq)
    pos = torch.arange(len(qi)) - (torch.cumsum(counts, 0) - counts)[qi]
    dense = torch.full((nq, int(counts.max()), S), -math.inf, dtype=vals.dtype)
    dense[qi, pos] = vals
    floor = torch.topk(dense.view(nq, -1), k, dim=1).values[:, -1].float() - margin   # (Q,)
    p, o = torch.nonzero(vals >= floor[qi, None], as_tuple=True)   # ordered by pair: query, group
    return si[p] * S + o, qi[p], floor


def _wide() -> bool:
    """Whether the many-queries pass multiplies in float32: on a CPU without native bf16 (AVX2 only), where
    oneDNN and ATen emulate a bf16 product, an order of magnitude slower than float32 there."""
    if _WIDE is not None:
        return _WIDE
    from clip_mini.runtime.isa import cpu_native_bf16

    return not cpu_native_bf16()


def _implicit_bf16(torch) -> bool:
    """Whether float32 products can be asked to run in bf16 inside oneDNN (``torch.backends.mkldnn.matmul.
    fp32_precision``, torch >= 2.9) on a CPU with native bf16: one conversion pass (float16 -> float32) instead
    of two, the rounding to bf16 done while oneDNN packs the operands (``benchmarks/results/speed/search.json``)."""
    if not _IMPLICIT_BF16:
        return False
    backend = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if backend is None or not hasattr(backend, "fp32_precision") or not torch.backends.mkldnn.is_available():
        return False
    from clip_mini.runtime.isa import cpu_native_bf16

    return cpu_native_bf16()   # the one rule: without native bf16 oneDNN would emulate it (no gain, looser scores)


class _matmul_precision:
    """Sets oneDNN's float32 matmul precision for a block and restores it (``None``: leave it alone). The setting is
    process-wide: a float32 product another thread runs inside the block is rounded to bf16 as well."""

    def __init__(self, torch, precision: str | None):
        self.backend = torch.backends.mkldnn.matmul if precision else None
        self.precision = precision

    def __enter__(self):
        if self.backend is not None:
            self.saved = self.backend.fp32_precision
            self.backend.fp32_precision = self.precision

    def __exit__(self, *exc):
        if self.backend is not None:
            self.backend.fp32_precision = self.saved
