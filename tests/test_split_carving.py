"""Split carving order: the test split never moves when val is resized, and adding a test split keeps val."""
from __future__ import annotations

import pandas as pd
import pytest

from clip_mini.data.readers import DataError
from clip_mini.data.splits import split_by_image


def _table(n_images: int = 60, per_image: int = 2) -> pd.DataFrame:
    rows = [(f"/d/{i:03d}.jpg", f"{i:03d}.jpg", f"caption {j} of {i}") for i in range(n_images) for j in range(per_image)]
    df = pd.DataFrame(rows, columns=["path", "image", "caption"])
    df["image_id"] = pd.factorize(df["path"])[0]
    return df


def _paths(split: pd.DataFrame) -> set[str]:
    return set(split["path"])


def test_test_split_is_independent_of_val_size():
    df = _table()
    tests = [_paths(split_by_image(df, val=v, test=10, seed=2)["test"]) for v in (0, 5, 20, 0.5)]
    assert len(tests[0]) == 10 and all(t == tests[0] for t in tests)


def test_adding_a_test_split_keeps_val():
    df = _table()
    before = _paths(split_by_image(df, val=12, seed=5)["val"])
    after = split_by_image(df, val=12, test=20, seed=5)
    assert _paths(after["val"]) == before
    assert not _paths(after["test"]) & before


def test_val_and_test_filling_everything_is_refused():
    with pytest.raises(DataError, match="no training images"):
        split_by_image(_table(10), val=6, test=6)
    with pytest.raises(DataError, match="no training images"):
        split_by_image(_table(10), val=5, test=5)
