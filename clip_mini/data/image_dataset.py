"""Image files to pixel tensors for embedding (indexing, evaluation, the frozen-feature pass): no pandas, so an
index run does not pay for importing it (a noticeable share of indexing a small folder).

``ImageDataset`` gives ``(pixels, i, ok)``; ``collate_images`` stacks them, keeping a channels-last transform's
layout (``build_eval_transform(pre, torch.bfloat16)``) instead of transposing every image into NCHW.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from clip_mini.data.images import ImageError, load_image, load_images

if TYPE_CHECKING:
    from clip_mini.data.cache import ImageCache

Transform = Callable[[np.ndarray], torch.Tensor]


class _ImageSource:
    """Shared read path: the cache record of the transform's ``base`` geometry when there is a cache, else a full
    decode (the transform's first step then makes the same record itself)."""

    def __init__(self, transform: Transform, cache: Optional[ImageCache]):
        if cache is not None and getattr(transform, "base", None) is None:
            raise TypeError(f"{type(transform).__name__} has no `base` (size, resize mode): an image cache cannot "
                            "know which record it needs; use build_eval_transform / build_train_transform")
        self.transform, self.cache = transform, cache
        self.bad_files: set[str] = set()   # per process; each file is warned about once

    def _pixels(self, path: str) -> torch.Tensor:
        if self.cache is not None:
            img = self.cache.get(path, self.transform.base)
        else:   # a large JPEG decodes at reduced scale, as the cache's records do (data/cache.py)
            img = load_image(path, min_size=getattr(self.transform, "base", (None,))[0])
        return self.transform(img)

    def _warn(self, path: str, err: Exception) -> None:
        if path not in self.bad_files:
            self.bad_files.add(path)
            warnings.warn(f"skipping unreadable image {path}: {getattr(err, 'reason', err)}", RuntimeWarning,
                          stacklevel=3)


class ImageDataset(_ImageSource, Dataset):
    """Each image once, for embedding (evaluation, indexing).

    ``__getitem__(i)`` returns ``(pixels, i, ok)``; an unreadable file gives zeros and ``ok=False`` (warned
    once, unless ``warn`` is False: a caller that reports the skips itself, as indexing does) so callers drop it
    instead of losing the whole run.
    """

    def __init__(self, paths: Sequence[str], transform: Transform, cache: Optional[ImageCache] = None,
                 warn: bool = True):
        super().__init__(transform, cache)
        self.paths = [str(p) for p in paths]
        self.warn = warn
        self._zeros: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, bool]:
        try:
            return self._pixels(self.paths[i]), i, True
        except (ImageError, OSError) as e:
            return self._failed(i, e)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int, bool]]:
        """A batch of items (a DataLoader's fetcher calls this when it exists). Without a cache the batch's files
        are read ahead on one helper thread (``images.load_images``) while the images before them decode: the
        same items as ``__getitem__`` one by one, without two thread switches per file."""
        if self.cache is not None:
            return [self[i] for i in indices]
        min_size = getattr(self.transform, "base", (None,))[0]
        out = []
        for i, (_, image) in zip(indices, load_images([self.paths[i] for i in indices], min_size=min_size)):
            try:
                if isinstance(image, ImageError):
                    raise image
                out.append((self.transform(image), i, True))
            except (ImageError, OSError) as e:
                out.append(self._failed(i, e))
        return out

    def _failed(self, i: int, err: Exception) -> tuple[torch.Tensor, int, bool]:
        if self.warn:
            self._warn(self.paths[i], err)
        if self._zeros is None:   # the transform's output shape, whatever the transform is
            self._zeros = torch.zeros_like(self.transform(np.zeros((8, 8, 3), np.uint8)))
        return self._zeros.clone(), i, False


def collate_images(batch: Sequence[tuple[torch.Tensor, int, bool]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ImageDataset`` items -> ``(pixels (B, 3, S, S), indices (B,), ok (B,))``.

    Channels-last items (the bf16 eval transform's HWC arrays seen as CHW) are stacked as the HWC arrays they are,
    into a channels-last batch: ``default_collate`` would transpose each into a contiguous NCHW batch, which the
    bf16 CNN tower then transposes back. In a worker process the batch is built in shared memory, as
    ``default_collate`` does, so handing it to the main process copies nothing.
    """
    pixels = [b[0] for b in batch]
    channels_last = pixels[0].dim() == 3 and pixels[0].stride(0) == 1 and pixels[0].shape[0] > 1
    items = [p.permute(1, 2, 0) for p in pixels] if channels_last else pixels
    out = None
    if get_worker_info() is not None:
        out = items[0].new_empty((len(items), *items[0].shape)).share_memory_()
    stacked = torch.stack(items, out=out)
    return (stacked.permute(0, 3, 1, 2) if channels_last else stacked,
            torch.tensor([b[1] for b in batch], dtype=torch.int64), torch.tensor([b[2] for b in batch]))
