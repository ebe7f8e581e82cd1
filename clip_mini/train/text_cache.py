"""Outputs of a locked text tower (``model.text.trainable: false``), computed once per distinct training caption.

A locked tower runs in eval mode (no dropout), so a caption's [CLS] state is the same at every step. Rather than
run the tower on every batch, the trainer runs it once over the split's distinct captions before the first step
(sorted by length, so a batch pads little) and each batch then carries its captions' rows under ``text_tower``:
a step costs the image side, the text head and the loss. With MiniLM-L6 locked and a small ViT learning from
scratch this takes the text forward out of every step (benchmarks/quality_flickr8k.py, variant ``e``).
WebDataset streams have no finite caption list and keep running the tower per batch.
"""
from __future__ import annotations

from typing import Sequence

import torch
from tqdm import tqdm

from clip_mini.precision import autocast


def wanted(cfg) -> bool:
    """Whether the trainer precomputes the text tower: a locked tower over a finite caption table."""
    return not cfg.model.text.trainable and cfg.data.format != "webdataset"


@torch.no_grad()   # not inference_mode: the rows feed the text head, whose backward saves its input
def text_tower_rows(model, captions: Sequence[str], batch_size: int, device: torch.device, precision: str,
                    progress: bool = True) -> tuple[dict[str, int], torch.Tensor]:
    """``(row of each distinct caption, (n_distinct, tower width) float32)``: the tower's output in eval mode."""
    distinct = sorted(set(map(str, captions)), key=lambda c: (len(c), c))
    was_training = model.text.training
    model.text.eval()
    out = []
    try:
        for s in tqdm(range(0, len(distinct), batch_size), desc="text tower (locked)", disable=not progress,
                      leave=False, dynamic_ncols=True):
            tok = model.tokenize(distinct[s:s + batch_size])
            with autocast(device, precision):
                out.append(model.text(tok["input_ids"].to(device), tok["attention_mask"].to(device)).float())
    finally:
        model.text.train(was_training)
    width = model.text.width
    rows = torch.cat(out) if out else torch.empty(0, width)
    return {c: i for i, c in enumerate(distinct)}, rows


class TextRowCollate:
    """Wraps a collate of ``(image, caption, image_id)`` items: adds the captions' tower rows as ``text_tower``."""

    def __init__(self, collate, index: dict[str, int], rows: torch.Tensor):
        self.collate, self.index, self.rows = collate, index, rows.cpu()

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        out = self.collate(batch)
        out["text_tower"] = self.rows[[self.index[str(b[1])] for b in batch]]
        return out
