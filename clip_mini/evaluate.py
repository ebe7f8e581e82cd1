"""Retrieval metrics with the multi-caption protocol, and zero-shot classification.

A text query hits at K if its own image is among the top K images; an image query hits at K if any of its
captions is among the top K texts. Shared by the trainer's per-epoch evaluation and ``clip-mini eval``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

KS = (1, 5, 10)


def _ranks_of_first_hit(sim: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """0-based rank of the best-ranked positive in each row. sim, positives: (Q, N)."""
    # The rank of the best positive = number of items scoring strictly higher than it (ties count in our favour
    # only when scores are exactly equal, which random features never give).
    best_pos = sim.masked_fill(~positives, float("-inf")).max(dim=1, keepdim=True).values  # (Q, 1)
    return (sim > best_pos).sum(dim=1)


@torch.no_grad()
def retrieval_metrics(image_features: torch.Tensor | np.ndarray, text_features: torch.Tensor | np.ndarray,
                      text_image_ids: Sequence[int] | torch.Tensor | np.ndarray,
                      ks: Sequence[int] = KS, chunk: int = 4096) -> dict[str, float]:
    """Recall@K both ways and median rank (1-based).

    Args:
        image_features: (N_img, E) L2-normalised, row j is image j.
        text_features: (N_txt, E) L2-normalised.
        text_image_ids: (N_txt,) image index (0..N_img-1) of each caption.

    Returns:
        ``t2i_r1, t2i_r5, t2i_r10, t2i_medr, i2t_r1, ..., i2t_medr, rsum`` (recalls in [0, 1]).
    """
    img = torch.as_tensor(np.asarray(image_features) if not torch.is_tensor(image_features) else image_features)
    txt = torch.as_tensor(np.asarray(text_features) if not torch.is_tensor(text_features) else text_features)
    img, txt = img.float(), txt.float()
    ids = torch.as_tensor(np.asarray(text_image_ids), dtype=torch.long)
    n_img = img.shape[0]
    if ids.numel() != txt.shape[0]:
        raise ValueError(f"{ids.numel()} caption image ids for {txt.shape[0]} captions")
    if n_img == 0 or txt.shape[0] == 0:
        raise ValueError("retrieval metrics need at least one image and one caption")
    if ids.min() < 0 or ids.max() >= n_img:
        raise ValueError(f"caption image ids must lie in [0, {n_img}), got [{ids.min()}, {ids.max()}]")
    t2i, i2t = [], []
    for s in range(0, txt.shape[0], chunk):
        sim = txt[s:s + chunk] @ img.T  # (q, N_img)
        pos = torch.zeros_like(sim, dtype=torch.bool)
        pos[torch.arange(sim.shape[0]), ids[s:s + chunk]] = True
        t2i.append(_ranks_of_first_hit(sim, pos))
    for s in range(0, n_img, chunk):
        sim = img[s:s + chunk] @ txt.T  # (q, N_txt)
        pos = ids[None, :] == torch.arange(s, s + sim.shape[0])[:, None]
        i2t.append(_ranks_of_first_hit(sim, pos))
    out: dict[str, float] = {}
    for name, ranks in (("t2i", torch.cat(t2i)), ("i2t", torch.cat(i2t))):
        for k in ks:
            out[f"{name}_r{k}"] = (ranks < k).float().mean().item()
        out[f"{name}_medr"] = float((ranks + 1).float().median().item())
    out["rsum"] = sum(out[f"{n}_r{k}"] for n in ("t2i", "i2t") for k in ks)
    return out


@torch.no_grad()
def zero_shot_accuracy(image_features: torch.Tensor, class_text_features: torch.Tensor,
                       labels: Sequence[int], ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    """Top-K accuracy of classifying images by their nearest class prompt embedding.

    Args:
        image_features: (N, E) L2-normalised.
        class_text_features: (C, E) L2-normalised, one row per class (prompt templates already averaged).
        labels: (N,) true class index of each image.
    """
    img = torch.as_tensor(image_features).float()
    cls = torch.as_tensor(class_text_features).float()
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    sim = img @ cls.T  # (N, C)
    ranks = (sim > sim.gather(1, y[:, None])).sum(1)
    return {f"top{k}": (ranks < k).float().mean().item() for k in ks if k <= cls.shape[0]}
