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
(``tests/test_search_query.py`` bounds the difference at 1 and checks the embeddings agree).

Memory and time follow the output, not the input's shape: each output pixel lists only the few input pixels it
reads, and a centre crop computes only its window. An upload 1 pixel wide and a million long used to need
gigabytes of temporaries here.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np


def _area_taps(n_in: int, n_out: int, outputs: range) -> tuple[np.ndarray, np.ndarray]:
    """Averaging weights for shrinking an axis of ``n_in`` pixels to ``n_out``, for the output pixels ``outputs``:
    source indices and weights, both (len(outputs), K), K the most input cells one output pixel touches.

    Output pixel i covers input [i*s, (i+1)*s), s = n_in / n_out, each cell weighted by the fraction of it covered.
    Only the cells under each footprint are listed: a dense (n_out, n_in) matrix took 1.8 GB for an axis a million
    pixels long. A listed cell outside the footprint (or past the last pixel) gets weight 0.
    """
    s = n_in / n_out
    out = np.arange(outputs.start, outputs.stop)[:, None]
    lo, hi = out * s, (out + 1) * s
    first = np.floor(lo).astype(np.int64)
    cells = first + np.arange(int((np.ceil(hi) - first).max()))[None]
    cover = np.clip(np.minimum(hi, cells + 1) - np.maximum(lo, cells), 0, None)   # overlap of [c, c+1) and [lo, hi)
    return np.minimum(cells, n_in - 1), cover / s


def _area_rows(image: np.ndarray, idx: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Weighted sums over axis 0: out[o] = sum_k weight[o, k] * image[idx[o, k]], in float64, one tap at a time
    so the only temporaries are the size of the output."""
    out = image[idx[:, 0]] * weight[:, 0, None, None]
    for k in range(1, idx.shape[1]):
        out += image[idx[:, k]] * weight[:, k, None, None]
    return out


def _two_taps(n_in: int, n_out: int, area_mode: bool, outputs: range) -> tuple[np.ndarray, np.ndarray]:
    """OpenCV's two-tap rule for the output pixels ``outputs``: source indices (len, 2) and 11-bit fixed-point
    weights (len, 2).

    Bilinear uses half-pixel centres; INTER_AREA on a growing axis uses OpenCV's own "area" coefficients.
    """
    scale, inv = n_in / n_out, n_out / n_in
    idx = np.zeros((len(outputs), 2), np.int64)
    coef = np.zeros((len(outputs), 2), np.int64)
    for i, d in enumerate(outputs):
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
        idx[i] = sx, min(sx + 1, n_in - 1)
        coef[i] = round((1.0 - fx) * 2048), round(fx * 2048)
    return idx, coef


def _resize_two_tap(image: np.ndarray, height: int, width: int, area_mode: bool, rows: range, cols: range
                    ) -> np.ndarray:
    """OpenCV's uint8 bilinear in its fixed point: integer horizontal pass, then the vertical pass as its SIMD
    kernel computes it (each row >> 4, times the weight, >> 16, summed, + 2, >> 2).

    The horizontal pass runs only on the (at most 2 per output row) source rows the vertical pass reads, so its
    int64 temporaries are the size of the output, not of the input's height times the output's width.
    """
    x_idx, x_coef = _two_taps(image.shape[1], width, area_mode, cols)
    y_idx, y_coef = _two_taps(image.shape[0], height, area_mode, rows)
    used, y_idx = np.unique(y_idx, return_inverse=True)
    y_idx = y_idx.reshape(-1, 2)
    src = image[used].astype(np.int64)
    horiz = src[:, x_idx[:, 0]] * x_coef[:, 0, None] + src[:, x_idx[:, 1]] * x_coef[:, 1, None]   # (used, W', 3)
    top = ((horiz[y_idx[:, 0]] >> 4) * y_coef[:, 0, None, None]) >> 16
    bottom = ((horiz[y_idx[:, 1]] >> 4) * y_coef[:, 1, None, None]) >> 16
    return np.clip((top + bottom + 2) >> 2, 0, 255).astype(np.uint8)


def resize_uint8(image: np.ndarray, height: int, width: int, area: bool,
                 crop: Optional[tuple[int, int, int, int]] = None) -> np.ndarray:
    """Resize an (H, W, 3) uint8 image like ``cv2.resize`` with INTER_AREA (``area``) or INTER_LINEAR.

    Args:
        crop: ``(top, left, crop_height, crop_width)``: compute only that window of the ``height`` x ``width``
            result (the same pixels as resizing in full and slicing; each output pixel depends only on its own
            taps). A centre crop of a very long image then costs its window, not the whole resized strip.
    """
    h, w = image.shape[:2]
    top, left, out_h, out_w = crop or (0, 0, height, width)
    rows, cols = range(top, top + out_h), range(left, left + out_w)
    if not (area and height <= h and width <= w):
        # Bilinear, or INTER_AREA with a growing axis (OpenCV then uses two taps with its area coefficients).
        return _resize_two_tap(image, height, width, area, rows, cols)
    out = _area_rows(image, *_area_taps(h, height, rows))                                   # (out_h, W, 3)
    out = _area_rows(out.transpose(1, 0, 2), *_area_taps(w, width, cols)).transpose(1, 0, 2)  # (out_h, out_w, 3)
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
        out = resize_uint8(image, nh, nw, area=scale < 1.0, crop=((nh - size) // 2, (nw - size) // 2, size, size))
    else:
        raise ValueError(f"unknown resize_mode {mode!r} (use 'squash' or 'center_crop')")
    mean = np.asarray(pre["mean"], np.float32) * 255.0
    std = np.asarray(pre["std"], np.float32) * 255.0
    return ((out.astype(np.float32) - mean) / std).transpose(2, 0, 1).copy()
