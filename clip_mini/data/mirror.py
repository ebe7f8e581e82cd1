"""Label-consistent mirroring: a horizontal flip of the image with "left" and "right" swapped in its caption.

A plain horizontal flip (``data.hflip: true``) makes every caption that says "left" or "right" false half the
time, so it is off for captions that name positions. Flipping the image and swapping those words together
(``data.hflip: swap``) keeps every pair true, for any dataset. ``data.mirror_pairs`` goes further: every source in a
training batch comes with its mirrored self, so the contrastive loss has to read the position words to tell the
two apart (hard negatives). A mirrored copy whose caption has no left/right word keeps its source's ``image_id``
(its identical text is a positive of both images, never a negative); one whose caption changed gets its own id,
``mirror_id``.

The rewrite is lexical: "left" the verb ("the man left the room") or "right" meaning correct ("all right") is
swapped too. Such captions are rare in Flickr8k-style data and their image is still the right one; the generated
shapes captions only use the positional senses.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import torch

_SIDE = re.compile(r"\b(left|right)(most)?\b", re.IGNORECASE)
_OTHER = {"left": "right", "right": "left"}
FLIP_STREAM = 0x6D6972   # appended to an augmentation key: the flip draw, independent of the crop and jitter draws


def _match_case(word: str, like: str) -> str:
    if like.isupper():
        return word.upper()
    if like[0].isupper():
        return word[0].upper() + word[1:]
    return word


def swap_left_right(caption: str) -> str:
    """``caption`` with the whole words "left" and "right" (and "leftmost", "rightmost") swapped, each in the case
    it was written in ("Left" -> "Right", "LEFT" -> "RIGHT"); any other caption comes back unchanged."""
    def swap(m: re.Match) -> str:
        side, most = m.group(1), m.group(2) or ""
        return _match_case(_OTHER[side.lower()], side) + most
    return _SIDE.sub(swap, caption)


def swaps_captions(data) -> bool:
    """Whether ``data`` (a ``DataConfig``) mirrors training images with their captions rewritten."""
    return data.hflip == "swap" or bool(data.mirror_pairs)


def flips(key: Sequence[int]) -> bool:
    """The ``data.hflip: swap`` draw (probability 0.5) for the sample whose augmentation key is ``key``."""
    return bool(np.random.default_rng([*map(int, key), FLIP_STREAM]).random() < 0.5)


def mirror_id(image_id: int, changed: bool) -> int:
    """The mirrored copy's image id: its source's when the caption did not change (a positive of it), else a new
    one, ``-1 - image_id``, which no source has (source ids are >= 0)."""
    return -1 - int(image_id) if changed else int(image_id)


def mirror_item(item: tuple[torch.Tensor, str, int]) -> tuple[torch.Tensor, str, int]:
    """``(pixels, caption, image_id)`` -> the mirrored sample: pixels flipped left-right (last axis), the caption's
    left/right swapped, and ``mirror_id``'s id."""
    pixels, caption, image_id = item
    swapped = swap_left_right(caption)
    return torch.flip(pixels, dims=(-1,)), swapped, mirror_id(image_id, swapped != caption)


def maybe_flip(item: tuple[torch.Tensor, str, int], key: Sequence[int]) -> tuple[torch.Tensor, str, int]:
    """``data.hflip: swap`` on one sample: mirrored (same image id: it is the same image) when ``flips(key)``."""
    if not flips(key):
        return item
    pixels, caption, image_id = item
    return torch.flip(pixels, dims=(-1,)), swap_left_right(caption), image_id
