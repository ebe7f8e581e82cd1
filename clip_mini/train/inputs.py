"""Training inputs: the split tables, and per-epoch loaders whose batches depend only on (seed, epoch, position).

Exact resume needs every batch to be reproducible from where the run stopped. The sampler's order already
depends only on ``(seed, epoch)``; the random crop and colour jitter are made so too by reseeding the
augmentation for every sample from ``(seed, epoch, row)``, whatever process (main or DataLoader worker) draws
it and however many samples that process drew before (the ``data.hflip: swap`` draw too, from the same key). A
resumed epoch then simply starts its batch list at the step it stopped at.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from clip_mini.config import Config, PreprocessConfig
from clip_mini.data.dataset import load_splits as load_table_splits
from clip_mini.data.mirror import maybe_flip, mirror_item
from clip_mini.data.steps import PersistentSteps, step_batches
from clip_mini.runtime.devices import loader_workers


def load_splits(cfg: Config, report_dir=None, progress: bool = True) -> dict[str, pd.DataFrame]:
    """The caption-table splits (shared with clip-mini eval); with ``data.format: webdataset`` a caption sample
    and the extracted validation shards instead (``clip_mini.data.wds_stream.wds_splits``)."""
    if cfg.data.format != "webdataset":
        return load_table_splits(cfg, report_dir=report_dir, progress=progress)
    if cfg.train.frozen_features:
        from clip_mini.data.readers import DataError

        raise DataError("train.frozen_features stores features per image of a table; it does not stream "
                        "WebDataset shards (set train.frozen_features: 0)")
    from clip_mini.data.wds_stream import wds_splits

    return wds_splits(cfg.data, report_dir=report_dir, progress=progress)


def make_image_cache(cfg: Config, pre: PreprocessConfig, splits: dict[str, pd.DataFrame]):
    """The decoded-image cache for every split's images (None when ``data.cache`` is off or the disk is full)."""
    from clip_mini.data import make_cache

    return make_cache(cfg.data, pre, sum(df["path"].nunique() for df in splits.values()))


class SeededAugment:
    """Callable transform that gives the albumentations pipeline fresh generators seeded by ``key`` per image.

    ``key`` (a tuple of ints) is set by ``EpochDataset`` just before the wrapped dataset calls the transform.
    """

    def __init__(self, transform):
        self.compose = transform.compose   # albumentations Compose inside clip_mini.data's ImageTransform
        self.base = transform.base         # the image cache record geometry the transform starts from
        self.key: tuple[int, ...] = (0,)

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        rng = np.random.default_rng(self.key)   # SeedSequence mixing of the whole key
        self.compose.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        return self.compose(image=image)["image"].contiguous()   # (3, S, S) float32


class EpochDataset(Dataset):
    """A ``CaptionDataset`` whose augmentation for row i in epoch e is seeded by ``(seed, e, i)``.

    ``hflip_swap`` (``data.hflip: swap``): row i is mirrored, image and caption (``clip_mini.data.mirror``), when the
    flip draw of its key says so. ``mirror_pairs``: indices ``n + i`` (n rows) are row i's mirrored copy, the same
    augmented pixels flipped, with its left/right words swapped and ``mirror.mirror_id``'s id; a batch holding both
    computes the row once (``__getitems__``).
    """

    def __init__(self, dataset, augment: SeededAugment, seed: int, hflip_swap: bool = False,
                 mirror_pairs: bool = False):
        self.dataset, self.augment, self.seed, self.epoch = dataset, augment, seed, 0
        self.hflip_swap, self.mirror_pairs = hflip_swap, mirror_pairs

    def __len__(self) -> int:
        return len(self.dataset) * (2 if self.mirror_pairs else 1)

    def _where(self, i) -> tuple[int, int, bool]:
        """(epoch, row, mirrored) of an index: ``i`` or ``(epoch, i)``."""
        # (epoch, row) from a persistent worker (data.steps.PersistentSteps), whose copy of .epoch is stale
        epoch, i = i if isinstance(i, tuple) else (self.epoch, i)
        n = len(self.dataset)
        if not 0 <= int(i) < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} rows")
        return int(epoch), int(i) % n, int(i) >= n

    def _row(self, epoch: int, row: int):
        key = (self.seed, epoch, row)
        self.augment.key = key
        item = self.dataset[row]
        return maybe_flip(item, key) if self.hflip_swap else item

    def __getitem__(self, i):
        epoch, row, mirrored = self._where(i)
        item = self._row(epoch, row)
        return mirror_item(item) if mirrored else item

    def __getitems__(self, indices) -> list:
        """A batch (the DataLoader fetcher calls this): each row read and augmented once, its mirror flipped from it."""
        done: dict[tuple[int, int], tuple] = {}
        out = []
        for i in indices:
            epoch, row, mirrored = self._where(i)
            if (epoch, row) not in done:
                done[(epoch, row)] = self._row(epoch, row)
            item = done[(epoch, row)]
            out.append(mirror_item(item) if mirrored else item)
        return out


@dataclass
class TrainInputs:
    dataset: EpochDataset
    sampler: "object"          # clip_mini.data.OneCaptionPerImageSampler
    collate: "object"          # clip_mini.data.CaptionCollate
    micro_batch: int
    accum_freq: int
    workers: int
    steps_per_epoch: int
    pairs: bool = False        # data.mirror_pairs: each micro-batch is micro_batch / 2 rows, each beside its mirror
    _persistent: Optional[PersistentSteps] = field(default=None, repr=False)

    def loader(self, epoch: int, start_step: int = 0) -> Iterator[list[dict]]:
        """Yield the steps of ``epoch`` from ``start_step`` on; each step is a list of ``accum_freq`` micro-batches.

        Incomplete last steps are dropped, so every step has the same global batch (a smaller batch would mean
        fewer negatives and a differently scaled loss). With ``pairs`` a micro-batch takes ``micro_batch / 2`` of the
        sampler's rows, each followed by its mirrored copy (dataset index ``n + row``).
        """
        self.sampler.set_epoch(epoch)
        self.dataset.epoch = epoch
        rows = self.sampler.indices()
        take = self.micro_batch // 2 if self.pairs else self.micro_batch   # sampler rows per micro-batch
        per_step = take * self.accum_freq
        micro = [rows[s:s + take].tolist()
                 for s in range(start_step * per_step, self.steps_per_epoch * per_step, take)]
        if self.pairs:
            n = len(self.dataset.dataset)
            micro = [[j for r in b for j in (r, n + r)] for b in micro]
        if not micro:
            return
        if not self.workers or not isinstance(self.dataset, EpochDataset):
            yield from step_batches(self.dataset, self.collate, self.workers, epoch, self.accum_freq,
                                    batch_sampler=micro)
            return
        # worker processes started once for the run, not once per epoch; the indices carry the epoch
        if self._persistent is None:
            self._persistent = PersistentSteps(self.dataset, self.collate, self.workers,
                                               pin_memory=torch.cuda.is_available())
        yield from self._persistent.steps([[(epoch, r) for r in b] for b in micro], self.accum_freq)


def build_train_inputs(cfg: Config, df: pd.DataFrame, pre: PreprocessConfig, tokenizer, max_length: int,
                       rank: int = 0, world_size: int = 1, cache=None) -> TrainInputs:
    """Dataset, sampler and collate for the training split; ``steps_per_epoch`` is this rank's count."""
    from clip_mini.data import CaptionCollate, CaptionDataset, OneCaptionPerImageSampler, build_train_transform

    augment = SeededAugment(build_train_transform(pre, cfg.data))
    t, d = cfg.train, cfg.data
    swap, pairs = d.hflip == "swap", bool(d.mirror_pairs)
    sources = t.batch_size // 2 if pairs else t.batch_size   # sampled rows per micro-batch
    if cfg.data.format == "webdataset":   # streamed shards: the epoch is data.samples, split over the ranks
        from clip_mini.data.wds_stream import WdsTrainInputs, split_shards

        steps = cfg.data.samples // (world_size * sources * t.accum_freq)   # data.samples: sources, mirrors aside
        return WdsTrainInputs(split_shards(cfg.data)[0], augment, CaptionCollate(tokenizer, max_length),
                              t.batch_size, t.accum_freq, loader_workers(cfg.data.workers), steps, t.seed, rank,
                              world_size, cfg.data.shuffle_buffer, hflip_swap=swap, pairs=pairs)
    dataset = EpochDataset(CaptionDataset(df, augment, cache=cache), augment, cfg.train.seed, hflip_swap=swap,
                           mirror_pairs=pairs)
    sampler = OneCaptionPerImageSampler(df["image_id"].tolist(), seed=cfg.train.seed, rank=rank,
                                        world_size=world_size)
    steps = len(sampler) // (sources * t.accum_freq)   # an epoch: every image once as a source (and its mirror)
    return TrainInputs(dataset, sampler, CaptionCollate(tokenizer, max_length), t.batch_size, t.accum_freq,
                       loader_workers(cfg.data.workers), steps, pairs)   # workers None: 4 with a GPU, else 0
