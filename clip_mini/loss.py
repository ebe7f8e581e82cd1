"""Symmetric contrastive (InfoNCE) loss with same-image masking and a distributed gather that keeps gradients.

Kept apart from the model (as in open_clip's ``ClipLoss``): the model returns normalised features and the scale,
the loss owns the labels. Several captions of one photo in a batch are positives of the same image, so they are
removed from each other's negatives instead of being pushed apart.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
              image_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean of image→text and text→image cross-entropy over the scaled cosine-similarity matrix.

    Args:
        image_features: (B, E) L2-normalised, row i pairs with text row i.
        text_features: (B, E) L2-normalised.
        logit_scale: scalar, already exponentiated (the multiplier, e.g. 1/0.07).
        image_ids: (B,) image of each pair; other pairs with the same image are masked out as negatives.
    """
    logits_per_image = logit_scale * image_features @ text_features.T  # (B, B)
    if image_ids is not None:
        same = image_ids[:, None] == image_ids[None, :]
        same.fill_diagonal_(False)
        # -inf drops the entry from the softmax; the diagonal (the target) is always kept.
        logits_per_image = logits_per_image.masked_fill(same, float("-inf"))
    labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    return 0.5 * (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels))


def gather_features(image_features: torch.Tensor, text_features: torch.Tensor,
                    image_ids: Optional[torch.Tensor] = None):
    """All-gather features from every rank, keeping the autograd graph for the local shard.

    ``torch.distributed.nn.all_gather`` sums gradients back to their owners, so every rank computing the full
    global loss and DDP averaging parameter gradients gives exactly the single-process gradient of that loss.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return image_features, text_features, image_ids
    from torch.distributed.nn import all_gather

    image_features = torch.cat(all_gather(image_features), 0)
    text_features = torch.cat(all_gather(text_features), 0)
    if image_ids is not None:
        ids = [torch.empty_like(image_ids) for _ in range(dist.get_world_size())]
        dist.all_gather(ids, image_ids)
        image_ids = torch.cat(ids, 0)
    return image_features, text_features, image_ids


class ClipLoss(nn.Module):
    """``clip_loss`` over the global batch when running distributed (each rank holds the full matrix)."""

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                image_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        image_features, text_features, image_ids = gather_features(image_features, text_features, image_ids)
        return clip_loss(image_features, text_features, logit_scale, image_ids)
