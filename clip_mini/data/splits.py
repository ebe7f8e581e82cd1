"""Image-grouped splits: all captions of an image land in the same split, so no image leaks into evaluation.

The split is deterministic from ``seed`` and independent of row order: unique image paths are sorted, then
permuted by a seeded generator. Validation and test sizes are fractions of the images when < 1, counts when
>= 1. Split files (one image name per line) take precedence for the split they name.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd

from clip_mini.data.readers import DataError, dense_ids, read_input_file

NameList = Union[str, os.PathLike, Sequence[str]]
SPLITS = ("train", "val", "test")


def split_by_image(df: pd.DataFrame, val: float = 0.1, test: float = 0.0, seed: int = 0,
                   val_list: Optional[NameList] = None, test_list: Optional[NameList] = None,
                   ) -> dict[str, pd.DataFrame]:
    """Split a caption table by image into train / val / test.

    Args:
        df: table from ``read_captions`` / ``load_table`` (columns ``path, image, caption, image_id``).
        val, test: fraction (< 1) or count (>= 1) of images; ignored for a split given by a list.
        seed: seed for the permutation of images.
        val_list, test_list: a text file of image names (one per line, ``#`` comments) or a sequence of
            names. Names match the ``image`` column, or its base name (Flickr8k split files list bare names).

    Returns:
        ``{"train", "val", "test"}`` -> tables with rows in their original order and index reset. Each
        split's ``image_id`` is re-densified to 0..k-1 within that split (first-appearance order), so it can
        index the split's own image list directly; the global ids are not kept.

    Raises:
        DataError: a list names no image in the table, an image is in both lists, or train would be empty.
    """
    images = np.array(sorted(df["path"].unique()))
    assign = pd.Series("train", index=images, dtype=object)
    fixed = {}
    for name, names in (("val", val_list), ("test", test_list)):
        if names is not None:
            fixed[name] = _match(df, names, name)
    if "val" in fixed and "test" in fixed:
        both = set(fixed["val"]) & set(fixed["test"])
        if both:
            raise DataError(f"{len(both)} image(s) are in both val_list and test_list, e.g. {sorted(both)[0]}")
    for name, paths in fixed.items():
        assign[list(paths)] = name
    rng = np.random.default_rng(seed)
    free = images[(assign == "train").to_numpy()]
    free = free[rng.permutation(len(free))]
    # val from the front of the permutation, test from the back: neither depends on the other's size, so
    # resizing val for tuning never moves a test image, and val is the same as before a test split was added.
    k_val, k_test = (0 if n in fixed else _count(s, len(images), n) for n, s in (("val", val), ("test", test)))
    assign[free[:k_val]] = "val"
    assign[free[max(k_val, len(free) - k_test):]] = "test"   # overlap would leave no train: refused below
    if not (assign == "train").any():
        raise DataError(f"the split leaves no training images (data.val={_fmt_size(val)}, "
                        f"data.test={_fmt_size(test)}, {len(images)} images); use a smaller data.val or data.test")
    labels = df["path"].map(assign)
    return {name: _subset(df, (labels == name).to_numpy()) for name in SPLITS}


def _count(size: float, n: int, name: str) -> int:
    if not size >= 0:   # also NaN
        raise DataError(f"data.{name} must be >= 0 (a fraction < 1 or a count of images), got {size}")
    if size >= 1 and size != int(size):
        raise DataError(f"data.{name}={size} is neither a fraction (< 1) nor a whole count of images; "
                        f"use a whole number such as {int(size)}, or a fraction such as 0.1")
    k = int(round(size * n)) if size < 1 else int(size)
    if k >= n:
        what = f"{k} images" if size >= 1 else f"{size} of the images ({k})"
        fix = f"at most {n - 1}, or a fraction such as 0.1" if n > 1 else "0: too few images to hold any out"
        raise DataError(f"the {name} split of {what} would take all {n} images; use a smaller data.{name} ({fix})")
    return k


def _fmt_size(size: float) -> str:
    """A split size as the config would say it: counts as integers (300, not 300.0), fractions as they are."""
    return str(int(size)) if size >= 1 and size == int(size) else str(size)


def _subset(df: pd.DataFrame, mask: np.ndarray) -> pd.DataFrame:
    out = df.loc[mask].reset_index(drop=True)
    out["image_id"] = dense_ids(out["path"]) if len(out) else []
    return out


def read_name_list(names: NameList) -> list[str]:
    """Names from a split file (blank lines and ``#`` comments ignored) or from a sequence."""
    if isinstance(names, (str, os.PathLike)):
        path = Path(names)
        raw = read_input_file(path, "split file")
        try:
            lines = raw.decode("utf-8-sig").splitlines()
        except UnicodeDecodeError as e:
            line = raw[:e.start].count(b"\n") + 1
            raise DataError(f"{path}: line {line}: not valid UTF-8; re-save the file as UTF-8") from None
        return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return [str(n).strip() for n in names]


def _match(df: pd.DataFrame, names: NameList, split: str) -> list[str]:
    wanted = read_name_list(names)
    by_name = dict(zip(df["image"], df["path"]))
    by_base = {}
    for image, path in by_name.items():
        by_base.setdefault(os.path.basename(image), set()).add(path)
    paths, missing = [], 0
    for n in dict.fromkeys(wanted):
        if n in by_name:
            paths.append(by_name[n])
        elif len(by_base.get(n, ())) == 1:   # ambiguous base names (same file name in two folders) don't match
            paths.append(next(iter(by_base[n])))
        else:
            missing += 1
    source = names if isinstance(names, (str, os.PathLike)) else f"{split}_list"
    if not paths:
        raise DataError(f"{source}: none of its {len(wanted)} names is in the captions table "
                        f"(e.g. {wanted[0] if wanted else 'empty list'!r})")
    if missing:
        # Not fatal: images dropped by the bad-file check are legitimately absent.
        print(f"data: {missing} of {len(wanted)} names in {source} are not in the captions table; ignored")
    return list(dict.fromkeys(paths))
