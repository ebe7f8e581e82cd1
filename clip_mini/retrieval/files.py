"""The image folder an index is built from: its image files, or an error naming the folder.

The file walk (exclusions, hidden entries, symlink loops) and the batched embedding pass live in
``clip_mini.features.image_files`` (evaluation uses them too); this module adds the index's own error for a folder
that is missing or a file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from clip_mini.errors import InputError
from clip_mini.features.image_files import DEFAULT_EXCLUDE_DIRS, IMAGE_EXTENSIONS, image_files  # noqa: F401
from clip_mini.retrieval.format import EmbeddingIndexError


def scan_images(folder: str | Path, exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS,
                include_hidden: bool = False) -> list[str]:
    """Absolute paths of the image files under ``folder`` (``features.image_files``: recursive, by extension,
    ``exclude_dirs`` never entered, hidden entries skipped unless ``include_hidden``, symlink loops skipped).

    Raises:
        EmbeddingIndexError: ``folder`` does not exist or is a file, or ``exclude_dirs`` is one string.
    """
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "not found"
        raise EmbeddingIndexError(f"image folder {what}: {folder}")
    try:
        return image_files(folder, exclude_dirs, include_hidden)
    except InputError as e:
        raise EmbeddingIndexError(str(e)) from None
