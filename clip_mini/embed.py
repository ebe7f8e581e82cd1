"""Embedding functions over a saved model directory: ``clip_mini.load(dir).encode_text / encode_image``.

Inputs are checked up front so a bad item is named before any work is done; outputs are (n, d) float32 arrays of
L2-normalised rows computed in batches under ``torch.inference_mode`` with the directory's own preprocessing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch


class InputError(ValueError):
    """An input to ``encode_text`` / ``encode_image`` is unusable; the message names the item."""


class Embedder:
    """Text and image embedding functions for one saved model."""

    def __init__(self, model, device: str = "cpu", batch_size: int = 64):
        self.model = model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        self._transform = None
        self.fingerprint = getattr(model, "fingerprint", None)
        self.dim = model.cfg.embed_dim

    @property
    def transform(self):
        """The model's eval transform, built on first use: albumentations costs seconds to import, and a
        text-only user never needs it."""
        if self._transform is None:
            from clip_mini.data import build_eval_transform

            self._transform = build_eval_transform(self.model.preprocess)
        return self._transform

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", batch_size: int = 64) -> "Embedder":
        from clip_mini.model import CLIPModel

        return cls(CLIPModel.from_pretrained(model_dir), device=device, batch_size=batch_size)

    @torch.inference_mode()
    def encode_text(self, captions: Sequence[str]) -> np.ndarray:
        """Embed captions: (n, d) float32, rows L2-normalised."""
        captions = _check_list(captions, "captions")
        for i, c in enumerate(captions):
            if not isinstance(c, str):
                raise InputError(f"caption {i} is a {type(c).__name__}, not a string: {c!r:.80}")
            if not c.strip():
                raise InputError(f"caption {i} is empty")
        out = []
        for start in range(0, len(captions), self.batch_size):
            tokens = self.model.tokenize(captions[start:start + self.batch_size])
            feats = self.model.encode_text(tokens["input_ids"].to(self.device),
                                           tokens["attention_mask"].to(self.device))
            out.append(feats.float().cpu().numpy())
        return np.concatenate(out).astype(np.float32, copy=False)

    @torch.inference_mode()
    def encode_image(self, images: Sequence[Any]) -> np.ndarray:
        """Embed images given as paths, PIL images or numpy arrays: (n, d) float32, rows L2-normalised."""
        from clip_mini.data import ImageError, load_image

        images = _check_list(images, "images")
        out = []
        for start in range(0, len(images), self.batch_size):
            batch = []
            for i, item in enumerate(images[start:start + self.batch_size], start):
                try:
                    batch.append(self.transform(load_image(item)))
                except ImageError as e:
                    raise InputError(f"image {i}: {e}") from None
            pixels = torch.stack(batch).to(self.device)
            out.append(self.model.encode_image(pixels).float().cpu().numpy())
        return np.concatenate(out).astype(np.float32, copy=False)

    def encode_pixels(self, pixels: torch.Tensor) -> np.ndarray:
        """Embed already-preprocessed pixels (B, 3, S, S)."""
        with torch.inference_mode():
            return self.model.encode_image(pixels.to(self.device)).float().cpu().numpy()


def _check_list(items: Any, what: str) -> list:
    if isinstance(items, (str, bytes, Path)) or not hasattr(items, "__len__"):
        raise InputError(f"{what} must be a list, got {type(items).__name__}; wrap a single item as [item]")
    if isinstance(items, np.ndarray) and what == "images":
        raise InputError("images must be a list of arrays, not one array; wrap a single image as [array]")
    items = list(items)
    if not items:
        raise InputError(f"{what} is empty: nothing to encode")
    return items
