"""Image files: finding them under a folder, and embedding them in batches with a progress bar.

Shared by index builds (``clip_mini.retrieval.build``, through ``clip_mini.retrieval.files``) and zero-shot
evaluation (``clip_mini.eval.scoring``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from clip_mini.errors import InputError

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


# Never entered unless asked otherwise (rclip's defaults): Synology thumbnails, JavaScript packages, git's objects,
# Windows' restore points
DEFAULT_EXCLUDE_DIRS = ("@eaDir", "node_modules", ".git", "System Volume Information")


def image_files(folder: str | Path, exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS,
                include_hidden: bool = False) -> list[str]:
    """Absolute paths of the image files under ``folder`` (recursive, by extension), sorted; none for a folder that
    does not exist (callers that must tell the user check it first).

    Args:
        folder: the folder to search.
        exclude_dirs: directory names never entered, at any depth (rclip's defaults: NAS thumbnails, packages,
            version control, Windows' system folder).
        include_hidden: also list hidden files and enter hidden directories (names starting with ".").

    Directories reached through a symlink are walked after every real directory, and only if no directory
    walked before is the same one (device and inode): a link back to a parent (a loop) or a second link to one
    folder is skipped, never followed forever, and a file is listed once, under its real folder's path where it
    has one. Links to files are listed as files.

    Raises:
        InputError: ``exclude_dirs`` given as one string.
    """
    if isinstance(exclude_dirs, str):
        raise InputError(f"exclude_dirs must be a list of directory names, got one string "
                                  f"{exclude_dirs!r}")
    exclude = set(exclude_dirs)
    visible = (lambda name: True) if include_hidden else (lambda name: not name.startswith("."))
    seen: set[tuple[int, int]] = set()
    trees, found = [str(folder)], []
    for top in trees:   # grows while walking: linked directories are queued behind the real ones
        key = _dir_key(top)
        if key is None or key in seen:   # a loop, a second link to a walked folder, or a link to nothing
            continue
        for root, dirs, files in os.walk(top):   # followlinks=False: links are queued, not entered
            seen.add(_dir_key(root))
            keep = []
            for d in sorted(dirs):
                path = os.path.join(root, d)
                if d in exclude or not visible(d):
                    continue
                if os.path.islink(path):
                    trees.append(path)
                elif _dir_key(path) not in seen:
                    keep.append(d)
            dirs[:] = keep
            found += [os.path.join(root, f) for f in files
                      if visible(f) and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS]
    return sorted(os.path.abspath(p) for p in found)


def _dir_key(path: str) -> Optional[tuple[int, int]]:
    """A directory's identity (device, inode), links followed; None when it cannot be reached (a link loop)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def iter_image_features(embedder, paths: Sequence[str], batch_size: int = 64, workers: int = 0,
                        precision: str = "fp32", progress: bool = True, desc: str = "embedding images",
                        flip_average: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, dict[int, str]]]:
    """Embed image files in batches: yields ``(indices, features (b, d) float32, {index: reason} of failures)``.

    ``flip_average``: each row averaged with its left-right mirror's (``model.clip.ImageForward``; twice the
    image pass).

    Failures are the caller's to report (a skip list, a summary line); here they only count on the progress bar,
    never as Python warnings with a source line.

    Raises:
        InputError: ``precision`` is not fp32, bf16 or fp16.
    """
    if precision not in ("fp32", "bf16", "fp16"):
        raise InputError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    import torch
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from clip_mini.data import ImageDataset, ImageError, build_eval_transform, collate_images, load_image
    from clip_mini.model.clip import ImageForward

    device = torch.device(embedder.device)
    # the same pass as eval and the feature store
    forward = ImageForward(embedder.model, precision, device, flip_average)
    # a bf16 tower: pixels normalised straight to bf16, the same values (data/transforms.py)
    transform = (embedder.transform if forward.input_dtype == torch.float32
                 else build_eval_transform(embedder.model.preprocess, forward.input_dtype))
    # Pinned batches let the copy to a GPU run while the next batch decodes.
    loader = DataLoader(ImageDataset(paths, transform, warn=False), batch_size=batch_size, num_workers=workers,
                        shuffle=False, pin_memory=device.type == "cuda", collate_fn=collate_images)
    skipped = 0
    with tqdm(total=len(paths), desc=desc, unit="img", disable=not progress) as bar, torch.inference_mode():
        for pixels, idx, ok in loader:
            bad = {}
            for i in idx[~ok].tolist():
                try:
                    load_image(paths[i])
                    bad[i] = "unreadable"
                except (ImageError, OSError) as e:
                    bad[i] = getattr(e, "reason", str(e))
            feats = np.zeros((0, embedder.dim), np.float32)
            if ok.all():
                feats = forward(pixels).cpu().numpy()
            elif ok.any():
                feats = forward(pixels[ok]).cpu().numpy()
            if bad:
                skipped += len(bad)
                bar.set_postfix(skipped=skipped, refresh=False)
            bar.update(len(idx))
            yield idx[ok].numpy(), feats, bad
