"""The error bound every exact-search kernel's short list rests on.

The approximate kernels score rows in float32 (after rounding rows, queries or results to a 16-bit type, where they
do), keep those near the approximate K-th best, and re-score them exactly (``shortlist.rescore``). A row is left
out only if its approximate score is below the floor: the approximate K-th best less ``margin``, twice the bound on
how far an approximate score can be from the exact one. So no true top-K row is lost, ties included.
"""
from __future__ import annotations

import numpy as np

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


def quantized_margin(query_norm: np.ndarray, query_error: np.ndarray, query_hat_norm: np.ndarray,
                     row_error: float, code_norm: float, roundings: int = 3) -> np.ndarray:
    """Per query: how far below the approximate K-th best a true top-K row can score when the approximate scores
    are products of quantized rows and queries (the int8 kernel, ``exact_int8``): twice the bound on
    |approximate - exact|.

    A row x is approximated by x^ (its codes times its scale: ``codes``), a query q by q^; the product
    q^ . x^ is exact in integers, then scaled in float32 (``roundings`` roundings to 2^-24). With
    q . x = q^ . x^ + q . (x - x^) + (q - q^) . x^ and Cauchy-Schwarz,

        |q . x - approximate| <= |q| max|x - x^| + |q - q^| max|x^| + ((1 + 2^-24)^r - 1) |q^| max|x^|

    where ``row_error`` = max over rows of |x - x^| and ``code_norm`` = max over rows of |x^| (both computed from
    the stored values in float64, ``codes``), and ``query_norm``, ``query_error``, ``query_hat_norm`` are |q|,
    |q - q^| and |q^| per query, in float64. The float64 evaluation of these terms is covered by a relative 1e-9,
    and the margin's rounding to float32 and the float32 subtraction that sets the floor (the K-th best less the
    margin: half an ulp of a score) by 2^-20 times the largest score, at least 1."""
    rounding = (1 + F32_U) ** roundings - 1
    top = np.asarray(query_hat_norm, np.float64) * code_norm   # the largest |approximate score|, about
    bound = (np.asarray(query_norm, np.float64) * row_error + np.asarray(query_error, np.float64) * code_norm
             + rounding * top)
    return (2 * bound * (1 + 1e-9) + 2.0 ** -20 * np.maximum(top, 1.0)).astype(np.float32)
