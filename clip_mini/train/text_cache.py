"""Outputs of a locked text tower (``model.text.trainable: false``), computed once per distinct training caption.

A locked tower runs in eval mode (no dropout), so a caption's [CLS] state is the same at every step. Rather than
run the tower on every batch, the trainer runs it once over the split's distinct captions before the first step
(sorted by length, so a batch pads little) and each batch then carries its captions' rows under ``text_tower``:
a step costs the image side, the text head and the loss. With MiniLM-L6 locked and a small ViT learning from
scratch this takes the text forward out of every step (benchmarks/quality/quality_flickr8k.py, variant ``e``).
WebDataset streams have no finite caption list and keep running the tower per batch.

The rows are stored in the run directory (``frozen_features/text-tower.safetensors``, written atomically) under
a key over everything they depend on (the distinct captions, the text config, the tokenizer's vocabulary, the
tower's weights and the precision), so a resumed run reads them instead of running the tower again: over
Flickr8k's 27,955 training captions MiniLM-L6 takes about a minute on 2 cores, once per process otherwise.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from clip_mini.data.caption_groups import group_by_image, next_in_group
from clip_mini.runtime.precision import autocast

FORMAT = 1   # of the stored rows' key


def wanted(cfg) -> bool:
    """Whether the trainer precomputes the text tower: a locked tower over a finite caption table."""
    return not cfg.model.text.trainable and cfg.data.format != "webdataset"


def distinct_captions(captions: Sequence[str]) -> list[str]:
    """The distinct captions in row order of the stored table: by length (a batch pads little), then text."""
    return sorted(set(map(str, captions)), key=lambda c: (len(c), c))


@torch.no_grad()   # not inference_mode: the rows feed the text head, whose backward saves its input
def text_tower_rows(model, captions: Sequence[str], batch_size: int, device: torch.device, precision: str,
                    progress: bool = True) -> tuple[dict[str, int], torch.Tensor]:
    """``(row of each distinct caption, (n_distinct, tower width) float32)``: the tower's output in eval mode."""
    distinct = distinct_captions(captions)
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
    """Wraps a collate of ``(image, caption, image_id)`` items: adds the captions' tower rows as ``text_tower``.

    With ``per_image`` > 1 and ``groups`` (each image id's distinct caption rows in table order), each item brings
    ``per_image`` rows: its drawn caption, then the image's next captions cyclically (repeats when it has fewer),
    plus ``text_ids`` (the image id of each row). A fixed count keeps every batch's shape, which the distributed
    gather needs; the sampler's random draw makes the set of rows vary when an image has more captions.
    """

    def __init__(self, collate, index: dict[str, int], rows: torch.Tensor, per_image: int = 1,
                 groups: Optional[dict[int, list[int]]] = None):
        if per_image > 1 and groups is None:
            raise ValueError("per_image > 1 needs each image's caption rows (groups)")
        self.collate, self.index, self.rows = collate, index, rows.cpu()
        self.per_image, self.groups = per_image, groups

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        out = self.collate(batch)
        drawn = [self.index[str(b[1])] for b in batch]
        if self.per_image == 1:
            out["text_tower"] = self.rows[drawn]
            return out
        picked = [r for row, b in zip(drawn, batch) for r in next_in_group(self.groups[int(b[2])], row, self.per_image)]
        out["text_tower"] = self.rows[picked]
        out["text_ids"] = out["image_ids"].repeat_interleave(self.per_image)
        return out


def caption_groups(captions: Sequence[str], image_ids: Sequence[int], index: dict[str, int]) -> dict[int, list[int]]:
    """Each image id's distinct caption rows (``index``'s), in table order."""
    return group_by_image([index[str(c)] for c in captions], image_ids)


def rows_key(model, distinct: list[str], precision: str) -> str:
    """Hash of what the stored rows depend on; a different hash means run the tower again."""
    h = hashlib.sha256()
    vocab = model.tokenizer.get_vocab() if model.tokenizer is not None else {}
    h.update(json.dumps({"format": FORMAT, "text": dataclasses.asdict(model.cfg.text), "precision": precision,
                         "vocab": sorted(vocab.items())}, sort_keys=True, default=str).encode())
    for c in distinct:
        h.update(c.encode())
        h.update(b"\0")
    state = model.text.state_dict()
    for name in sorted(state):   # the weights themselves: another checkpoint, other rows
        h.update(name.encode())
        h.update(state[name].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _read_rows(path: Path, key: str, n: int, width: int) -> Optional[torch.Tensor]:
    from clip_mini.fileio.atomic import read_keyed_tensors

    got = read_keyed_tensors(path, key, ("rows",))
    rows = None if got is None else got["rows"]
    return rows if rows is not None and rows.shape == (n, width) and rows.dtype == torch.float32 else None


def load_or_compute_rows(model, captions: Sequence[str], batch_size: int, device: torch.device, precision: str,
                         path: Path, progress: bool = True, write: bool = True) -> tuple[dict[str, int], torch.Tensor]:
    """``text_tower_rows``, read from ``path`` when its key matches, else computed (and stored there if
    ``write``)."""
    from clip_mini.fileio.atomic import write_keyed_tensors

    distinct = distinct_captions(captions)
    key = rows_key(model, distinct, precision)
    rows = _read_rows(path, key, len(distinct), model.text.width)
    if rows is not None:
        return {c: i for i, c in enumerate(distinct)}, rows
    index, rows = text_tower_rows(model, distinct, batch_size, device, precision, progress)
    if write:
        write_keyed_tensors(path, {"rows": rows}, key)
    return index, rows
