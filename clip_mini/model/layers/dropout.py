"""Dropout with a cheaper mask on CPU, for the text tower's training pass.

torch's CPU dropout draws one Bernoulli sample per element from the Mersenne Twister generator on a single thread: in
a profile of a text tower's training step (MiniLM with dropout 0.1) ``aten::bernoulli_`` is the largest cost after the
matrix products (``benchmarks/results/speed/train_dropout.json`` compares the two). Here one 64-bit draw (``random_``
on an int64 tensor gives 63 uniform bits) yields three 16-bit fields, each compared with a threshold: a third of the
generator calls, and the same distribution up to the keep probability's rounding to 1/65536 (the scale uses the
rounded probability, so the expectation is unchanged). It draws from torch's CPU generator, so ``torch.manual_seed``
and ``torch.set_rng_state`` replay the masks (gradient accumulation's re-forward relies on that). On a GPU it is
``F.dropout`` (Philox is already fast).
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

_FIELDS = 65536   # values of a 16-bit field
# int64 ``random_`` leaves the top bit 0: skip the field holding it (the last one on a little-endian machine)
_UNIFORM = slice(0, 3) if sys.byteorder == "little" else slice(1, 4)


def keep_mask(shape: torch.Size, p: float) -> tuple[torch.Tensor, float]:
    """A bool tensor of ``shape`` with each element True with probability ``1 - p`` (to 1/65536), and that
    rounded keep probability."""
    n = math.prod(shape)
    threshold = round(p * _FIELDS)
    words = torch.empty((n + 2) // 3, dtype=torch.int64).random_()
    fields = words.view(torch.int16).view(-1, 4)[:, _UNIFORM].reshape(-1)[:n]
    return fields.view(shape) >= threshold - _FIELDS // 2, 1.0 - threshold / _FIELDS


def fast_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)`` in distribution, with the cheaper CPU mask."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or round(p * _FIELDS) >= _FIELDS:   # p that rounds to 1: nothing kept
        return F.dropout(x, p, training)
    keep, q = keep_mask(x.shape, p)
    return x * keep.to(x.dtype).mul_(1.0 / q)


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same ``p``, same ``train()``/``eval()`` behaviour) drawing its mask with ``fast_dropout``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_dropout(x, self.p, self.training)


def swap_dropouts(module: nn.Module) -> int:
    """Replace every ``nn.Dropout`` under ``module`` with ``Dropout`` (same ``p``); returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, Dropout(child.p))
                swapped += 1
    return swapped


def eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' DistilBERT ``eager_attention_forward`` (plain matmul-softmax-matmul attention), with the
    attention probabilities dropped out by ``fast_dropout``; registered as ``clip_mini_eager``."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = fast_dropout(F.softmax(weights, dim=-1), dropout, module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


EAGER = "clip_mini_eager"


def register_eager_attention() -> str:
    """Register ``eager_attention`` with transformers under ``EAGER`` (idempotent), with eager's additive mask
    format (transformers builds a model's mask by its attention's name); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(EAGER, eager_attention)
    AttentionMaskInterface.register(EAGER, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return EAGER
