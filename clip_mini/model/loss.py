"""Symmetric contrastive (InfoNCE) loss with same-image masking and a distributed gather that keeps gradients.

Kept apart from the model (as in open_clip's ``ClipLoss``): the model returns normalised features and the scale,
the loss owns the labels. Several captions of one photo in a batch are positives of the same image, so they are
removed from each other's negatives instead of being pushed apart. With ``text_ids`` (``train.captions_per_image``
> 1) the text side holds several captions per image and every one of them is a positive of its image.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
              image_ids: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
              text_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean of image→text and text→image cross-entropy over the scaled cosine-similarity matrix.

    Args:
        image_features: (B, E) L2-normalised, row i pairs with text row i.
        text_features: (B, E) L2-normalised.
        logit_scale: scalar, already exponentiated (the multiplier, e.g. 1/0.07).
        image_ids: (B,) image of each pair; other pairs with the same image are masked out as negatives.
        label_smoothing: share of each target spread over the row (``F.cross_entropy``'s; masked entries get none).
        text_ids: (T,) image of each text row, when ``text_features`` is (T, E) with T != B in general: every
            (image, caption) pair of one image is a positive (``multi_positive_nll``), with ``image_ids`` required.
    """
    logits_per_image = logit_scale * image_features @ text_features.T  # (B, B)
    if text_ids is not None:
        if label_smoothing:
            raise ValueError("label_smoothing is for one caption per image (no text_ids)")
        positive = image_ids[:, None] == text_ids[None, :]   # (B, T)
        return 0.5 * (multi_positive_nll(logits_per_image, positive)
                      + multi_positive_nll(logits_per_image.T, positive.T))
    if image_ids is not None:
        same = image_ids[:, None] == image_ids[None, :]
        same.fill_diagonal_(False)
        # -inf drops the entry from the softmax; the diagonal (the target) is always kept.
        logits_per_image = logits_per_image.masked_fill(same, float("-inf"))
    labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    if label_smoothing:
        # F.cross_entropy would spread mass onto the -inf entries too (an infinite loss): smooth by hand
        logp_i, logp_t = logits_per_image.log_softmax(1), logits_per_image.T.log_softmax(1)
        return 0.5 * (_smoothed_nll(logp_i, label_smoothing) + _smoothed_nll(logp_t, label_smoothing))
    return 0.5 * (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels))


def multi_positive_nll(logits: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the mean, over the row's positives p, of -log softmax(p) over {p} and the negatives.

    Each positive competes with the row's negatives only (the other positives are masked, as ``clip_loss``
    masks other captions of the same image), so with one positive per row this is the cross-entropy.
    Every row needs at least one positive.
    """
    negatives = logits.masked_fill(positive, float("-inf")).logsumexp(1, keepdim=True)   # (R, 1); -inf if none
    nll = torch.logaddexp(negatives, logits) - logits   # (R, C): -log p of each column taken as the positive
    return ((nll * positive).sum(1) / positive.sum(1)).mean()


def _smoothed_nll(logp: torch.Tensor, eps: float) -> torch.Tensor:
    """Cross-entropy against (1 - eps) on the diagonal plus eps spread evenly over each row's finite entries."""
    finite = torch.isfinite(logp)
    uniform = torch.where(finite, logp, torch.zeros_like(logp)).sum(1) / finite.sum(1)   # mean log-prob per row
    return -((1 - eps) * logp.diagonal() + eps * uniform).mean()


def siglip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor, image_ids: Optional[torch.Tensor] = None,
                text_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss (Zhai et al. 2023): every (image, caption) pair is a binary problem.

    Positives are the diagonal and, with ``image_ids``, every other caption of the same image. Summed over the
    B x B pairs and divided by B, as in the paper; start with ``logit_scale = 10`` and ``logit_bias = -10`` so the
    many negatives do not dominate the first steps. ``text_ids``: the image of each text row when there are
    several captions per image (B x T pairs, still divided by B).
    """
    logits = logit_scale * image_features @ text_features.T + logit_bias   # (B, T)
    if text_ids is not None:
        positive = image_ids[:, None] == text_ids[None, :]
    elif image_ids is None:
        positive = torch.eye(len(logits), dtype=torch.bool, device=logits.device)
    else:
        positive = image_ids[:, None] == image_ids[None, :]
    signs = positive.to(logits.dtype) * 2 - 1
    return -F.logsigmoid(signs * logits).sum() / len(logits)


def gather_features(image_features: torch.Tensor, text_features: torch.Tensor,
                    image_ids: Optional[torch.Tensor] = None, text_ids: Optional[torch.Tensor] = None):
    """All-gather features from every rank, keeping the autograd graph for the local shard.

    ``torch.distributed.nn.all_gather`` sums gradients back to their owners, so every rank computing the full
    global loss and DDP averaging parameter gradients gives exactly the single-process gradient of that loss.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return image_features, text_features, image_ids, text_ids
    from torch.distributed.nn import all_gather

    image_features = torch.cat(all_gather(image_features), 0)
    text_features = torch.cat(all_gather(text_features), 0)
    return image_features, text_features, _gather_ids(image_ids), _gather_ids(text_ids)


def _gather_ids(ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if ids is None:
        return None
    out = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(out, ids)
    return torch.cat(out, 0)


class SigLipLoss(nn.Module):
    """``siglip_loss`` over the global batch; ``logit_params`` is ``[scale, bias]`` (``CLIPModel.logit_params``)."""

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_params: torch.Tensor,
                image_ids: Optional[torch.Tensor] = None, text_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        image_features, text_features, image_ids, text_ids = gather_features(image_features, text_features,
                                                                             image_ids, text_ids)
        return siglip_loss(image_features, text_features, logit_params[0], logit_params[1], image_ids, text_ids)


class ClipLoss(nn.Module):
    """``clip_loss`` over the global batch when running distributed (each rank holds the full matrix)."""

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                image_ids: Optional[torch.Tensor] = None, text_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        image_features, text_features, image_ids, text_ids = gather_features(image_features, text_features,
                                                                             image_ids, text_ids)
        return clip_loss(image_features, text_features, logit_scale, image_ids, self.label_smoothing, text_ids)
