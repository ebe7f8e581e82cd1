"""Several captions of each image in one step (``train.captions_per_image``), for a text tower that trains.

The sampler draws one caption per image; each item then brings ``per_image`` captions: the drawn one, then the
image's next captions in table order, cyclically (repeats when the image has fewer). A fixed count keeps every
batch's shape, which the distributed gather needs; the random draw makes the set vary when an image has more.
Batches carry the tokens of all of them and ``text_ids`` (the image of each text row), which the loss reads as
positives of their image (``clip_mini.model.loss.multi_positive_nll``).

A locked text tower reads stored rows instead of tokens (``clip_mini.train.text_cache.TextRowCollate``), picked
by the same rule (``next_in_group``).
"""
from __future__ import annotations

from typing import Hashable, Sequence, TypeVar

import torch

T = TypeVar("T", bound=Hashable)


def group_by_image(captions: Sequence[T], image_ids: Sequence[int]) -> dict[int, list[T]]:
    """Each image id's distinct captions (or caption rows), in table order."""
    groups: dict[int, dict[T, None]] = {}
    for caption, image_id in zip(captions, image_ids):
        groups.setdefault(int(image_id), {})[caption] = None
    return {k: list(v) for k, v in groups.items()}


def next_in_group(group: Sequence[T], drawn: T, per_image: int) -> list[T]:
    """``drawn`` and the ``per_image - 1`` members of ``group`` after it, cyclically."""
    start = group.index(drawn)
    return [group[(start + j) % len(group)] for j in range(per_image)]


class CaptionGroupCollate:
    """Wraps a collate of ``(image, caption, image_id)`` items (``CaptionCollate``): its ``input_ids`` and
    ``attention_mask`` become the tokens of ``per_image`` captions of each item's image, in item order, and
    ``text_ids`` names the image of each row."""

    def __init__(self, collate, tokenizer, max_length: int, groups: dict[int, list[str]], per_image: int):
        if per_image < 2:
            raise ValueError(f"per_image must be >= 2 (one caption per image needs no wrapper), got {per_image}")
        self.collate, self.tokenizer, self.max_length = collate, tokenizer, max_length
        self.groups, self.per_image = groups, per_image

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        out = self.collate(batch)
        texts = [c for b in batch for c in next_in_group(self.groups[int(b[2])], str(b[1]), self.per_image)]
        tok = self.tokenizer(texts, padding="longest", truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        out["input_ids"], out["attention_mask"] = tok["input_ids"].long(), tok["attention_mask"].long()
        out["text_ids"] = out["image_ids"].repeat_interleave(self.per_image)
        return out
