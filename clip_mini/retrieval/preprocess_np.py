"""The eval image transform in numpy: what ``clip_mini.data.build_eval_transform`` computes, without torch,
albumentations or OpenCV (seconds of imports on a query that needs milliseconds of arithmetic).

The eval transform resizes with OpenCV (``resize_op``: bilinear, switched to area averaging when an image shrinks),
optionally centre-crops, then normalises. Both OpenCV filters are separable, so each is one (out, in) weight
matrix per axis applied to the uint8 image; the weights follow OpenCV's ``resize.cpp``:

* ``INTER_AREA`` with both axes shrinking: each output pixel averages the input pixels its footprint covers,
  fractional coverage at the edges weighted by the covered fraction.
* ``INTER_LINEAR`` (both axes grow), and ``INTER_AREA`` when an axis grows (OpenCV then uses two taps per axis
  with its "area" coefficients), two taps with edge clamping.

OpenCV rounds its bilinear weights to 1/2048 and works in fixed point, so a pixel can differ by one grey level
(``tests/test_preprocess_np.py`` bounds the difference at 1 and checks the embeddings agree).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def _area_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) averaging weights for shrinking: output pixel i covers input [i*s, (i+1)*s)."""
    s = n_in / n_out
    edges = np.arange(n_out + 1) * s
    lo, hi = edges[:-1, None], edges[1:, None]
    cells = np.arange(n_in)[None]
    cover = np.clip(np.minimum(hi, cells + 1) - np.maximum(lo, cells), 0, None)   # overlap of [c, c+1) and [lo, hi)
    return cover / s


def _two_taps(n_in: int, n_out: int, area_mode: bool) -> tuple[np.ndarray, np.ndarray]:
    """OpenCV's two-tap rule per output pixel: source indices (n_out, 2) and 11-bit fixed-point weights (n_out, 2).

    Bilinear uses half-pixel centres; INTER_AREA on a growing axis uses OpenCV's own "area" coefficients.
    """
    scale, inv = n_in / n_out, n_out / n_in
    idx = np.zeros((n_out, 2), np.int64)
    coef = np.zeros((n_out, 2), np.int64)
    for d in range(n_out):
        if area_mode:
            sx = math.floor(d * scale)
            fx = float(np.float32((d + 1) - (sx + 1) * inv))
            fx = 0.0 if fx <= 0 else fx - math.floor(fx)
        else:
            fx = float(np.float32((d + 0.5) * scale - 0.5))
            sx = math.floor(fx)
            fx -= sx
        if sx < 0:
            sx, fx = 0, 0.0
        if sx >= n_in - 1:
            sx, fx = n_in - 1, 0.0
        idx[d] = sx, min(sx + 1, n_in - 1)
        coef[d] = round((1.0 - fx) * 2048), round(fx * 2048)
    return idx, coef


def _resize_two_tap(image: np.ndarray, height: int, width: int, area_mode: bool) -> np.ndarray:
    """OpenCV's uint8 bilinear in its fixed point: integer horizontal pass, then the vertical pass as its SIMD
    kernel computes it (each row >> 4, times the weight, >> 16, summed, + 2, >> 2)."""
    (x_idx, x_coef), (y_idx, y_coef) = _two_taps(image.shape[1], width, area_mode), _two_taps(image.shape[0], height,
                                                                                               area_mode)
    src = image.astype(np.int64)
    rows = src[:, x_idx[:, 0]] * x_coef[:, 0, None] + src[:, x_idx[:, 1]] * x_coef[:, 1, None]   # (H, W', 3)
    top = ((rows[y_idx[:, 0]] >> 4) * y_coef[:, 0, None, None]) >> 16
    bottom = ((rows[y_idx[:, 1]] >> 4) * y_coef[:, 1, None, None]) >> 16
    return np.clip((top + bottom + 2) >> 2, 0, 255).astype(np.uint8)


def resize_uint8(image: np.ndarray, height: int, width: int, area: bool) -> np.ndarray:
    """Resize an (H, W, 3) uint8 image like ``cv2.resize`` with INTER_AREA (``area``) or INTER_LINEAR."""
    h, w = image.shape[:2]
    if not (area and height <= h and width <= w):
        # Bilinear, or INTER_AREA with a growing axis (OpenCV then uses two taps with its area coefficients).
        return _resize_two_tap(image, height, width, area_mode=area)
    wy, wx = _area_weights(h, height), _area_weights(w, width)
    out = np.einsum("oh,hwc->owc", wy, image.astype(np.float64))
    out = np.einsum("pw,owc->opc", wx, out)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def eval_pixels(image: np.ndarray, pre: dict[str, Any]) -> np.ndarray:
    """(H, W, 3) uint8 RGB -> (3, S, S) float32: ``build_eval_transform(PreprocessConfig(**pre))`` in numpy."""
    size, mode = int(pre["image_size"]), pre.get("resize_mode", "squash")
    h, w = image.shape[:2]
    if mode == "squash":
        # albumentations' Resize uses INTER_AREA when either side shrinks.
        out = resize_uint8(image, size, size, area=size < h or size < w)
    elif mode == "center_crop":
        # SmallestMaxSize: shorter side to size, rounded; INTER_AREA when the scale is below 1. Then CenterCrop.
        scale = size / min(h, w)
        nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
        out = resize_uint8(image, nh, nw, area=scale < 1.0)
        top, left = (nh - size) // 2, (nw - size) // 2
        out = out[top:top + size, left:left + size]
    else:
        raise ValueError(f"unknown resize_mode {mode!r} (use 'squash' or 'center_crop')")
    mean = np.asarray(pre["mean"], np.float32) * 255.0
    std = np.asarray(pre["std"], np.float32) * 255.0
    return ((out.astype(np.float32) - mean) / std).transpose(2, 0, 1).copy()
