"""Datasets, collate and sampler: from a checked caption table to batches of pixels and token ids.

``load_table`` is the one place where bad inputs are weeded out (header check of every image, empty
captions), with a report. What slips through (a file that breaks after the check, corrupt data mid-file)
is handled at read time: ``CaptionDataset`` substitutes the next readable row and warns once per file, so one
bad file never ends an epoch.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset, Sampler

from clip_mini.config import DataConfig
from clip_mini.data.cache import ImageCache
from clip_mini.data.image_dataset import Transform, _ImageSource
from clip_mini.data.images import ImageError, check_images
from clip_mini.data.readers import DataError, dense_ids, read_captions


def load_table(cfg: DataConfig, report_dir: Optional[str | Path] = None, progress: bool = True) -> pd.DataFrame:
    """Read ``cfg.captions``, header-check every image, drop what is unusable and report it.

    Prints one line with the counts kept and skipped. When ``report_dir`` is given and anything was skipped,
    writes ``report_dir/skipped.csv`` (columns ``path, reason``; a skipped caption's path is
    ``captions_file:row``). ``image_id`` is re-densified after dropping.

    Raises:
        DataError: the captions file is unusable, or no image in it is.
    """
    df, skipped = read_captions(cfg.captions, cfg.image_root, cfg.format, cfg.sep, cfg.image_col,
                                cfg.caption_col)
    paths = df["path"].unique()
    bad = check_images(paths, progress=progress and len(paths) > 2000)
    if len(bad) == len(paths):
        first = next(iter(bad.items()))
        raise DataError(f"{cfg.captions}: none of its {len(paths)} images is usable (e.g. {first[0]}: {first[1]}); "
                        "check data.image_root")
    n_rows = len(df)
    if bad:
        df = df[~df["path"].isin(bad.keys())].reset_index(drop=True)
        df["image_id"] = dense_ids(df["path"])
    line = (f"data: {df['image_id'].nunique()} images, {len(df)} captions from {cfg.captions}; skipped "
            f"{len(bad)} bad images ({n_rows - len(df)} captions) and {len(skipped)} empty captions")
    rows = list(bad.items()) + skipped
    if report_dir is not None and rows:
        from clip_mini.fileio.atomic import atomic_path

        with atomic_path(Path(report_dir) / "skipped.csv") as tmp:
            pd.DataFrame(rows, columns=["path", "reason"]).to_csv(tmp, index=False)
        line += f" (see {Path(report_dir) / 'skipped.csv'})"
    print(line)
    return df


class CaptionDataset(_ImageSource, Dataset):
    """(image, caption) rows of a caption table.

    Args:
        df: table with ``path``, ``caption``, ``image_id`` (from ``load_table`` / ``split_by_image``).
        transform: array -> (3, S, S) float tensor (``build_train_transform`` / ``build_eval_transform``).
        cache: optional ``ImageCache``; the transform's ``base`` picks the record geometry.

    ``__getitem__(i)`` returns ``(pixels, caption, image_id)``. If row ``i``'s image fails to decode, the next
    row with a readable image (wrapping around) is returned instead: deterministic, and the substitute is a
    genuine pair, so the batch stays correct.
    """

    def __init__(self, df: pd.DataFrame, transform: Transform, cache: Optional[ImageCache] = None):
        super().__init__(transform, cache)
        if len(df) == 0:
            raise DataError("CaptionDataset needs at least one row")
        # Plain lists: pandas row access per item costs orders of magnitude more than a list index.
        self.paths = df["path"].astype(str).tolist()
        self.captions = df["caption"].astype(str).tolist()
        self.image_ids = df["image_id"].astype(int).tolist()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str, int]:
        n = len(self.paths)
        for step in range(n):
            j = (i + step) % n
            path = self.paths[j]
            if path in self.bad_files:
                continue
            try:
                return self._pixels(path), self.captions[j], self.image_ids[j]
            except (ImageError, OSError) as e:
                self._warn(path, e)
        raise DataError(f"no readable image left in the dataset ({len(self.bad_files)} bad files)")


class CaptionCollate:
    """Stack pixels and tokenize captions with padding to the longest caption in the batch.

    Args:
        tokenizer: a HuggingFace fast tokenizer (adds [CLS]/[SEP]).
        max_length: longest token sequence kept, special tokens included.

    Returns (from ``__call__``): ``pixels`` (B, 3, S, S) float32, ``input_ids`` (B, L) long,
    ``attention_mask`` (B, L) long, ``image_ids`` (B,) long.
    """

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch: Sequence[tuple[torch.Tensor, str, int]]) -> dict[str, torch.Tensor]:
        tok = self.tokenizer([b[1] for b in batch], padding="longest", truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        return {
            "pixels": torch.stack([b[0] for b in batch]).float(),
            "input_ids": tok["input_ids"].long(),
            "attention_mask": tok["attention_mask"].long(),
            "image_ids": torch.tensor([int(b[2]) for b in batch], dtype=torch.long),
        }


class OneCaptionPerImageSampler(Sampler[int]):
    """Each epoch visits every image exactly once, with one of its captions drawn at random.

    Two captions of one image therefore never meet in a batch (they would be false negatives for the
    contrastive loss). The order depends only on ``(seed, epoch)``, so a resumed run can skip the first k
    batches of an epoch and see the same rest. With ``world_size > 1`` the epoch's list is padded by
    wrapping to a multiple of ``world_size`` and rank r takes every world_size-th row from r: disjoint,
    equal shares.

    Args:
        image_ids: image id of each row of the dataset (``CaptionDataset.image_ids``).
        seed: base seed (>= 0).
        rank, world_size: this process's share in distributed training.
    """

    def __init__(self, image_ids: Sequence[int], seed: int, rank: int = 0, world_size: int = 1):
        ids = np.asarray(image_ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("OneCaptionPerImageSampler needs at least one row")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self._rows = np.argsort(ids, kind="stable")          # rows grouped by image
        _, self._starts, self._counts = np.unique(ids[self._rows], return_index=True, return_counts=True)
        self.n_images = len(self._starts)
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0
        self.num_samples = math.ceil(self.n_images / world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        """This rank's row indices for the current epoch."""
        rng = np.random.default_rng([self.seed, self.epoch])
        perm = rng.permutation(self.n_images)
        pick = self._starts[perm] + (rng.random(self.n_images) * self._counts[perm]).astype(np.int64)
        rows = self._rows[pick]
        total = self.num_samples * self.world_size
        rows = np.resize(rows, total)   # np.resize repeats from the start: padding by wrapping
        return rows[self.rank:total:self.world_size]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples


def load_splits(cfg, report_dir: Optional[str | Path] = None, progress: bool = True
                ) -> dict[str, pd.DataFrame]:
    """Read and check ``cfg.data``'s captions (``skipped.csv`` into ``report_dir``), then split by image.

    The trainer and ``clip-mini eval`` both call this, so they see the same splits.
    """
    from clip_mini.data.splits import split_by_image

    d = cfg.data
    df = load_table(d, report_dir=report_dir, progress=progress)
    return split_by_image(df, val=d.val, test=d.test, seed=d.seed, val_list=d.val_list, test_list=d.test_list)
