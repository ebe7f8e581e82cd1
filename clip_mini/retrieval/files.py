"""The image folder an index is built from: its image files, or an error naming the folder.

The file walk and the batched embedding pass live in ``clip_mini.features.image_files`` (evaluation uses them
too); this module adds the index's own error for a folder that is missing or a file.
"""
from __future__ import annotations

from pathlib import Path

from clip_mini.features.image_files import image_files
from clip_mini.retrieval.format import EmbeddingIndexError


def scan_images(folder: str | Path) -> list[str]:
    """Absolute paths of the image files under ``folder`` (recursive, by extension; hidden entries skipped).

    Raises:
        EmbeddingIndexError: ``folder`` does not exist or is a file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "not found"
        raise EmbeddingIndexError(f"image folder {what}: {folder}")
    return image_files(folder)
