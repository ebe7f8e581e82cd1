"""Image transforms (albumentations): uint8 RGB (H, W, 3) in, normalised float32 (3, S, S) tensor out.

The eval transform is a pure function of ``PreprocessConfig`` (saved as ``preprocess.json``), so a model
directory alone reproduces it. ``resize_op`` is shared with the image cache: the cache stores exactly the
first step of the eval transform, which therefore becomes the identity on cached images and gives the same
pixels as a fresh decode.
"""
from __future__ import annotations

import os

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")   # no network check on import

from typing import Callable

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2

from clip_mini.config import DataConfig, PreprocessConfig

# Bilinear, switched to INTER_AREA whenever an image shrinks: area averaging avoids aliasing on 500 px photos
# going to 64 px, while INTER_AREA alone would enlarge (small crops, small images) like nearest neighbour.
RESIZE = dict(interpolation=cv2.INTER_LINEAR, area_for_downscale="image")


def resize_op(size: int, mode: str) -> A.BasicTransform:
    """First eval step: "squash" resizes to size x size; "center_crop" scales the shorter side to size."""
    if mode == "squash":
        return A.Resize(height=size, width=size, **RESIZE)
    if mode == "center_crop":
        return A.SmallestMaxSize(max_size=size, **RESIZE)
    raise ValueError(f"unknown resize_mode {mode!r} (use 'squash' or 'center_crop')")


def _normalise(pre: PreprocessConfig) -> list[A.BasicTransform]:
    return [A.Normalize(mean=tuple(pre.mean), std=tuple(pre.std), max_pixel_value=255.0), ToTensorV2()]


class ImageTransform:
    """Picklable wrapper: array (or anything ``load_image`` takes) -> float32 (3, S, S) tensor.

    Albumentations 2.x keeps one random generator per ``Compose``; forked DataLoader workers would inherit
    the same state and apply identical "random" crops. The generator is therefore reseeded from
    ``torch.initial_seed()`` (distinct per worker and per epoch) the first time a new process uses it.
    """

    def __init__(self, compose: A.Compose, image_size: int):
        self.compose = compose
        self.image_size = image_size
        self._pid = os.getpid()

    def __call__(self, image) -> torch.Tensor:
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
                or image.shape[2] != 3:
            from clip_mini.data.images import load_image

            image = load_image(image)
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self.compose.set_random_seed(torch.initial_seed() % 2**32)
        out = self.compose(image=image)["image"]   # (3, S, S) float32
        return out.contiguous()


def build_eval_transform(pre: PreprocessConfig) -> Callable[[np.ndarray], torch.Tensor]:
    """Deterministic transform recorded by ``preprocess.json``: resize (and centre crop), normalise."""
    steps = [resize_op(pre.image_size, pre.resize_mode)]
    if pre.resize_mode == "center_crop":
        steps.append(A.CenterCrop(height=pre.image_size, width=pre.image_size))
    return ImageTransform(A.Compose(steps + _normalise(pre)), pre.image_size)


def build_train_transform(pre: PreprocessConfig, cfg: DataConfig, seed: int | None = None
                          ) -> Callable[[np.ndarray], torch.Tensor]:
    """Training augmentation: mild random resized crop, light colour jitter, optional horizontal flip.

    Hue is never jittered: captions name colours ("a red circle", "a man in a blue shirt"), and a hue shift
    would make them false. Flip is off by default because captions say "left" and "right".

    Args:
        pre: output size, mean and std (the model's).
        cfg: ``scale_min`` (crop area lower bound), ``color_jitter`` (brightness/contrast/saturation
            strength, 0 disables), ``hflip``.
        seed: seed of the augmentation stream in the main process (default ``cfg.seed``); DataLoader workers
            reseed, see ``ImageTransform``.
    """
    s = pre.image_size
    steps = [A.RandomResizedCrop(size=(s, s), scale=(cfg.scale_min, 1.0), ratio=(3 / 4, 4 / 3),
                                 **RESIZE)]
    if cfg.color_jitter > 0:
        j = cfg.color_jitter
        steps.append(A.ColorJitter(brightness=j, contrast=j, saturation=j, hue=0.0, p=0.8))
    if cfg.hflip:
        steps.append(A.HorizontalFlip(p=0.5))
    return ImageTransform(A.Compose(steps + _normalise(pre), seed=cfg.seed if seed is None else seed), s)
