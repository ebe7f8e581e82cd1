"""Stored embedding rows: float16 (the default) or bfloat16, and how numpy code reads either.

Why bfloat16: a CPU with native bf16 matrix products (AMX/AVX512-BF16) has no fp16 arithmetic, so exact search
over float16 rows must convert every row before it can multiply (``search/``), while bf16 rows go straight into
torch's bf16 matrix-vector and matrix products, which read them at memory speed
(``benchmarks/results/speed/search.json``, ``bf16_storage_*``). The price is precision: 8 significant bits against
float16's 11 (unit rows: a cosine within ~4e-3 of float32 instead of ~5e-4), which is why float16 stays the default
and bfloat16 is a choice (``clip-mini index --dtype bfloat16``).

numpy has no bfloat16 type, so a bf16 index stores the raw bits as a uint16 ``.npy``; ``BF16Rows`` wraps that
memory map and hands numpy code float32 rows (bf16 -> float32 is exact: the bits shifted into the high half).
"""
from __future__ import annotations

import numpy as np

DTYPES = ("float16", "bfloat16")


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 (or anything numpy casts to it) -> bfloat16 bits as uint16, rounded to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    wide = np.left_shift(np.asarray(bits, dtype=np.uint16).astype(np.uint32), 16)
    if out is None:
        return wide.view(np.float32)
    np.copyto(out.view(np.uint32), wide)
    return out


class BF16Rows:
    """A read-only (N, d) view of bfloat16 rows stored as uint16 bits; indexing returns float32 arrays.

    ``bits`` is the uint16 array itself (a memory map for an index on disk), for kernels that read bf16 directly.
    """

    dtype = np.dtype(np.float32)   # what indexing returns
    storage = "bfloat16"

    def __init__(self, bits: np.ndarray):
        if bits.dtype != np.uint16 or bits.ndim != 2:
            raise ValueError(f"bfloat16 rows are stored as a 2-D uint16 array, got {bits.dtype} {bits.shape}")
        self.bits = bits

    @property
    def shape(self) -> tuple[int, int]:
        return self.bits.shape

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return len(self.bits)

    def __getitem__(self, key) -> np.ndarray:
        return bf16_bits_to_f32(self.bits[key])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = bf16_bits_to_f32(self.bits)
        return rows if dtype is None else rows.astype(dtype, copy=False)


def storage_dtype(rows) -> str:
    """"float16" or "bfloat16": how ``rows`` (an index's embeddings) are stored."""
    return rows.storage if isinstance(rows, BF16Rows) else "float16"


def wrap(array: np.ndarray):
    """An index's embeddings as loaded from its ``.npy``: float16 as they are, uint16 bits as ``BF16Rows``."""
    return BF16Rows(array) if array.dtype == np.uint16 else array


def numpy_dtype(dtype: str) -> np.dtype:
    """The ``.npy`` dtype of a storage dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"embedding storage dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return np.dtype(np.float16 if dtype == "float16" else np.uint16)


def encode(block: np.ndarray, dtype: str) -> np.ndarray:
    """Rows (any float dtype) in a storage dtype: float16, or bfloat16 bits (uint16)."""
    return f32_to_bf16_bits(block) if numpy_dtype(dtype) == np.uint16 else np.asarray(block, dtype=np.float16)
