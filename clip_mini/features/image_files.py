"""Image files: finding them under a folder, and embedding them in batches with a progress bar.

Shared by index builds (``clip_mini.retrieval.build``, through ``clip_mini.retrieval.files``) and zero-shot
evaluation (``clip_mini.eval.scoring``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from clip_mini.errors import InputError

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


def image_files(folder: str | Path) -> list[str]:
    """Absolute paths of the image files under ``folder`` (recursive, by extension; hidden entries skipped), sorted;
    none for a folder that does not exist (callers that must tell the user check it first)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in files
                  if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS]
    return sorted(os.path.abspath(p) for p in found)


def iter_image_features(embedder, paths: Sequence[str], batch_size: int = 64, workers: int = 0,
                        precision: str = "fp32", progress: bool = True, desc: str = "embedding images",
                        ) -> Iterator[tuple[np.ndarray, np.ndarray, dict[int, str]]]:
    """Embed image files in batches: yields ``(indices, features (b, d) float32, {index: reason} of failures)``.

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
    forward = ImageForward(embedder.model, precision, device)   # the same pass as eval and the feature store
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
