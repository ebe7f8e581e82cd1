"""The error bound every exact-search kernel's short list rests on.

The approximate kernels score rows in float32 (after rounding rows, queries or results to a 16-bit type, where they
do), keep those near the approximate K-th best, and re-score them exactly (``shortlist.rescore``). A row is left
out only if its approximate score is below the floor: the approximate K-th best less ``margin``, twice the bound on
how far an approximate score can be from the exact one. So no true top-K row is lost, ties included.
"""
from __future__ import annotations

FP16_U, BF16_U = 2.0 ** -11, 2.0 ** -8   # unit roundoffs (round to nearest)
F32_U = 2.0 ** -24


def margin(u: float, roundings: int, d: int) -> float:
    """How far below the approximate K-th best a true top-K row can score: twice the bound on |approximate - exact|
    (its own error, and that of the rows that set the K-th best).

    The approximate score rounds ``roundings`` of {the row, the query, the result} to unit roundoff ``u`` (fp16 mv:
    query and result; a bf16 product over stored bf16 rows: query and result; over float16 rows converted by
    torch: all three; rounded by oneDNN inside the product, whose result stays float32: row and query) and
    accumulates d products in float32 (gamma_d = d 2^-24 / (1 - d 2^-24)), so it is within
    ((1 + u)^r (1 + gamma_d) - 1) * sum |e_i q_i| of the exact one; sum |e_i q_i| <= |e| |q| <= 1.01 for unit
    vectors rounded to fp16 or bf16 (norms within 2^-8 of 1)."""
    gamma = d * F32_U / (1 - d * F32_U)
    return 2 * 1.01 * ((1 + u) ** roundings * (1 + gamma) - 1)
