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
    """0-based rank of the best-ranked positive in each row: how many non-positive items score >= it.

    Ties count against the query: a collapsed tower (every score equal) must rank its positives last, not
    first. A NaN score is never "lower" than anything, so NaN rows rank last too. sim, positives: (Q, N).
    """
    best_pos = sim.masked_fill(~positives, float("-inf")).max(dim=1, keepdim=True).values  # (Q, 1)
    return (~(sim < best_pos) & ~positives).sum(dim=1)


def median_rank(ranks: torch.Tensor) -> float:
    """Median of 1-based ranks; for an even count the mean of the two middle ranks (``torch.median`` would
    return the lower one, flattering the model)."""
    return float(np.median(ranks.double().cpu().numpy()))


def _as_float(x: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    # Tensors on any device (the trainer's features are on the GPU): scored on the CPU, where the ids already are.
    t = x.detach().to("cpu", torch.float32) if torch.is_tensor(x) else torch.as_tensor(np.asarray(x)).float()
    if t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (rows, dim) array, got shape {tuple(t.shape)}")
    bad = (~torch.isfinite(t)).any(dim=1).nonzero().flatten()
    if len(bad):
        raise ValueError(f"{name} has non-finite values in {len(bad)} row(s), first row {bad[0].item()}")
    return t


def _as_ids(ids) -> torch.Tensor:
    return (ids.detach().to("cpu", torch.long) if torch.is_tensor(ids)
            else torch.as_tensor(np.asarray(ids), dtype=torch.long))


@torch.no_grad()
def retrieval_metrics(image_features: torch.Tensor | np.ndarray, text_features: torch.Tensor | np.ndarray,
                      text_image_ids: Sequence[int] | torch.Tensor | np.ndarray,
                      ks: Sequence[int] = KS, chunk: int = 4096) -> dict[str, float]:
    """Recall@K both ways and median rank (1-based; ties count against the query, see ``_ranks_of_first_hit``).

    Args:
        image_features: (N_img, E) L2-normalised, row j is image j.
        text_features: (N_txt, E) L2-normalised.
        text_image_ids: (N_txt,) image index (0..N_img-1) of each caption.

    Returns:
        ``t2i_r1, t2i_r5, t2i_r10, t2i_medr, i2t_r1, ..., i2t_medr, rsum`` (recalls in [0, 1]; a median rank
        over an even number of queries is the mean of the two middle ranks).
    """
    img, txt = _as_float(image_features, "image_features"), _as_float(text_features, "text_features")
    ids = _as_ids(text_image_ids)
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
        out[f"{name}_medr"] = median_rank(ranks + 1)
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

    A class tying the true one ranks ahead of it, so a collapsed image tower scores no better than chance.
    """
    img, cls = _as_float(image_features, "image_features"), _as_float(class_text_features, "class_text_features")
    y = _as_ids(labels)
    if y.numel() != img.shape[0]:
        raise ValueError(f"{y.numel()} labels for {img.shape[0]} images")
    if y.numel() and (y.min() < 0 or y.max() >= cls.shape[0]):
        raise ValueError(f"labels must lie in [0, {cls.shape[0]}), got [{y.min()}, {y.max()}]")
    sim = img @ cls.T  # (N, C)
    ranks = _ranks_of_first_hit(sim, torch.nn.functional.one_hot(y, cls.shape[0]).bool())
    return {f"top{k}": (ranks < k).float().mean().item() for k in ks if k <= cls.shape[0]}
