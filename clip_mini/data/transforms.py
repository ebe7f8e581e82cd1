"""Image transforms (albumentations): uint8 RGB (H, W, 3) in, normalised float32 (3, S, S) tensor out.

The eval transform is a pure function of ``PreprocessConfig`` (saved as ``preprocess.json``), so a model
directory alone reproduces it. Each transform starts with a resize (``resize_op``) whose geometry it exposes as
``base`` (size, resize mode); the image cache stores exactly that first step, which therefore becomes the identity
on cached images, so the cache on or off gives the same pixels. The training transform's first step keeps more
pixels than the eval one (``train_base_size``): its random crops are then shrunk to the output size, never
enlarged, and training images are as sharp as evaluation images.

albumentations and OpenCV (about 0.6 s to import) are imported by the code that builds or runs a transform, not
by this module: the readers, datasets and image cache import it for ``train_base_size`` and ``resize_op``.
"""
from __future__ import annotations

import functools
import math
import os

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")   # no network check when albumentations is imported

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from clip_mini.config import DataConfig, PreprocessConfig

if TYPE_CHECKING:
    import albumentations as A

# Bilinear (cv2.INTER_LINEAR), switched to INTER_AREA whenever an image shrinks: area averaging avoids aliasing on
# 500 px photos going to 64 px, while INTER_AREA alone would enlarge (small crops, small images) like nearest
# neighbour.
RESIZE = dict(interpolation=1, area_for_downscale="image")
CROP_RATIO = (3 / 4, 4 / 3)   # RandomResizedCrop's aspect-ratio range


def train_base_size(size: int, scale_min: float) -> int:
    """Side (square for "squash", shorter side for "center_crop") the training transform first resizes to.

    A random crop covers at least ``scale_min`` of an image whose shorter side is the base, at an aspect ratio in
    ``CROP_RATIO``, so its shorter side is at least ``base * sqrt(scale_min * 3/4)`` (>= ``size`` by the second term):
    crops are shrunk to ``size``, never enlarged. The base is also at least ``2 * size`` because shrinking by a
    small factor with INTER_AREA blurs nearly as much as enlarging: a crop from a copy at ``size`` or a little above
    it is much blurrier than the same crop shrunk once from the full image, and one from a ``2 * size`` copy comes
    close to it (``benchmarks/results/studies/train_sharpness.json``).
    """
    return max(2 * size, math.ceil(size / math.sqrt(scale_min * CROP_RATIO[0]) - 1e-9))


def resize_op(size: int, mode: str) -> A.BasicTransform:
    """First eval step: "squash" resizes to size x size; "center_crop" scales the shorter side to size."""
    import albumentations as A

    if mode == "squash":
        return A.Resize(height=size, width=size, **RESIZE)
    if mode == "center_crop":
        return A.SmallestMaxSize(max_size=size, **RESIZE)
    raise ValueError(f"unknown resize_mode {mode!r} (use 'squash' or 'center_crop')")


@functools.cache
def _lut_normalize() -> type:
    """The ``LutNormalize`` class, defined on first use: its base class is albumentations' ``A.Normalize``."""
    import albumentations as A
    import cv2

    class LutNormalize(A.Normalize):
        """``A.Normalize`` (mean/std, "standard") with one 3-channel table lookup for uint8 RGB images.

        albucore normalises uint8 through a table per channel and merges the three float planes; for equal means
        and stds (the 0.5 models) it takes another, slow path that costs most of the decode work when indexing small
        photos. One ``cv2.LUT`` with a 3-channel table of the same float32 values (``(i - mean) * (1 / (std *
        255))``, as albucore computes them) gives the same bits at a fraction of the cost
        (``tests/test_data_pipeline.py`` checks it against ``A.Normalize``). Anything else goes to ``A.Normalize``
        itself.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            mean, denominator = self.mean_np.reshape(1, -1), self.denominator.reshape(1, -1)
            self._lut = np.ascontiguousarray(((np.arange(256, dtype=np.float32)[:, None] - mean) * denominator)
                                             .astype(np.float32)[:, None, :])   # (256, 1, C): cv2's C-channel table

        def apply(self, img: np.ndarray, **params) -> np.ndarray:
            if (self.normalization == "standard" and img.dtype == np.uint8 and img.ndim == 3
                    and img.shape[2] == self._lut.shape[2] == 3):
                return cv2.LUT(img, self._lut)
            return super().apply(img, **params)

    LutNormalize.__qualname__ = "LutNormalize"   # pickled by reference as clip_mini.data.transforms.LutNormalize
    return LutNormalize


def __getattr__(name: str):
    """``LutNormalize`` (module attribute, created with albumentations on first access)."""
    if name == "LutNormalize":
        globals()[name] = _lut_normalize()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _normalise(pre: PreprocessConfig) -> list[A.BasicTransform]:
    from albumentations.pytorch import ToTensorV2

    return [_lut_normalize()(mean=tuple(pre.mean), std=tuple(pre.std), max_pixel_value=255.0), ToTensorV2()]


class ImageTransform:
    """Picklable wrapper: array (or anything ``load_image`` takes) -> float32 (3, S, S) tensor.

    Albumentations 2.x keeps one random generator per ``Compose``; forked DataLoader workers would inherit
    the same state and apply identical "random" crops. The generator is therefore reseeded from
    ``torch.initial_seed()`` (distinct per worker and per epoch) the first time a new process uses it.

    ``base`` is the (size, resize mode) of the first step: an image cache record of that geometry can stand in for
    the decoded file and gives the same output.
    """

    def __init__(self, compose: A.Compose, image_size: int, base: tuple[int, str],
                 bf16_table: np.ndarray | None = None):
        self.compose = compose
        self.image_size = image_size
        self.base = base
        self.bf16_table = bf16_table   # (256, 1, 3) uint16: normalised values as bf16 bits (bf16 eval transform)
        self._pid = os.getpid()

    def __call__(self, image) -> torch.Tensor:
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
                or image.shape[2] != 3:
            from clip_mini.data.images import load_image

            image = load_image(image, min_size=self.base[0])
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self.compose.set_random_seed(torch.initial_seed() % 2**32)
        out = self.compose(image=image)["image"]
        if self.bf16_table is not None:   # (S, S, 3) uint8 -> bf16 bits -> a channels-last (3, S, S) view
            import cv2

            return torch.from_numpy(cv2.LUT(out, self.bf16_table)).view(torch.bfloat16).permute(2, 0, 1)
        return out.contiguous()   # (3, S, S) float32


def build_eval_transform(pre: PreprocessConfig, dtype: torch.dtype = torch.float32
                         ) -> Callable[[np.ndarray], torch.Tensor]:
    """Deterministic transform recorded by ``preprocess.json``: resize (and centre crop), normalise.

    ``dtype=torch.bfloat16``: the same values rounded to bf16, as a channels-last (3, S, S) view of the (S, S, 3)
    array, for a bf16 tower (``vision.inference_tower``; stack with ``collate_images``). The table lookup that
    normalises writes bf16 bits directly: no float32 image, no transposing copy, no cast of the batch, and
    bitwise the float32 transform's output cast to bf16 (``tests/test_data_pipeline.py``). That saves much of the
    float32 path's work per image when indexing for a bf16 tower.
    """
    import albumentations as A

    steps = [resize_op(pre.image_size, pre.resize_mode)]
    if pre.resize_mode == "center_crop":
        steps.append(A.CenterCrop(height=pre.image_size, width=pre.image_size))
    base = (pre.image_size, pre.resize_mode)
    if dtype == torch.float32:
        return ImageTransform(A.Compose(steps + _normalise(pre)), pre.image_size, base)
    if dtype != torch.bfloat16:
        raise ValueError(f"eval transform dtype must be float32 or bfloat16, got {dtype}")
    table = _normalise(pre)[0]._lut   # the float32 transform's own table, so the two cannot drift apart
    bits = torch.from_numpy(table).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return ImageTransform(A.Compose(steps), pre.image_size, base, np.ascontiguousarray(bits))


def build_train_transform(pre: PreprocessConfig, cfg: DataConfig, seed: int | None = None
                          ) -> Callable[[np.ndarray], torch.Tensor]:
    """Training augmentation: resize to ``train_base_size`` (as the eval transform's first step, with more pixels),
    mild random resized crop, light colour jitter, optional horizontal flip.

    Hue is never jittered: captions name colours ("a red circle", "a man in a blue shirt"), and a hue shift
    would make them false. Flip is off by default because captions say "left" and "right"; ``hflip: swap`` flips
    the image together with its caption, which a transform cannot see: the training dataset does it
    (``clip_mini.data.mirror``), so this transform then has no flip of its own.

    Args:
        pre: output size, mean and std (the model's).
        cfg: ``scale_min`` (crop area lower bound), ``color_jitter`` (brightness/contrast/saturation
            strength, 0 disables), ``hflip`` (true: a flip of the image alone).
        seed: seed of the augmentation stream in the main process (default ``cfg.seed``); DataLoader workers
            reseed, see ``ImageTransform``.
    """
    import albumentations as A

    s, base = pre.image_size, train_base_size(pre.image_size, cfg.scale_min)
    # "center_crop" keeps the aspect ratio and crops from the whole picture, not from the eval centre square
    steps = [resize_op(base, pre.resize_mode),
             A.RandomResizedCrop(size=(s, s), scale=(cfg.scale_min, 1.0), ratio=CROP_RATIO, **RESIZE)]
    if cfg.color_jitter > 0:
        j = cfg.color_jitter
        steps.append(A.ColorJitter(brightness=j, contrast=j, saturation=j, hue=0.0, p=0.8))
    if cfg.hflip is True:   # "swap" flips in the dataset, with the caption
        steps.append(A.HorizontalFlip(p=0.5))
    return ImageTransform(A.Compose(steps + _normalise(pre), seed=cfg.seed if seed is None else seed), s,
                          (base, pre.resize_mode))
