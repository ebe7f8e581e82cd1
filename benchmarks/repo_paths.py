"""Paths as benchmark JSONs record them: relative to the repository, so a result names the same data on every
checkout (the shared data folder reads ``../shared/...``) and carries no machine's absolute layout."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def relative_to_repo(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root, with forward slashes (``../shared/data/flickr8k/images``)."""
    return Path(os.path.relpath(Path(path).resolve(), ROOT)).as_posix()
