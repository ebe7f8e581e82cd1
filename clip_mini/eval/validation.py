"""Validation: contrastive loss and multi-caption retrieval metrics of a model on a split table.

Each image is embedded once and each caption once (eval mode, ``inference_mode``); the loss and the recall
metrics are then computed from those features, so evaluation costs one forward pass over the split.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import torch

from clip_mini.eval.cutoff import calibrate as calibrate_cutoff
from clip_mini.eval.metrics import retrieval_metrics
from clip_mini.model.loss import clip_loss
from clip_mini.model.clip import ImageForward
from clip_mini.runtime.precision import autocast


def _image_features(model, paths: list[str], transform, cache, batch_size: int, device: torch.device,
                    precision: str, workers: int, flip_average: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, E)`` features and an ``(N,)`` bool mask of the images that could be read (their rows are junk);
    ``flip_average`` as in ``ImageForward`` (an index built with it scores as this does)."""
    from torch.utils.data import DataLoader

    from clip_mini.data import ImageDataset

    loader = DataLoader(ImageDataset(paths, transform, cache), batch_size=batch_size, num_workers=workers,
                        generator=torch.Generator(),   # never moves the global RNG (exact resume)
                        pin_memory=device.type == "cuda")
    # The same gradient-free pass as the frozen-feature store and indexing (a bf16-weight tower under bf16), so
    # `clip-mini eval`, the trainer's val rows and stored features all score one set of tower outputs.
    forward = ImageForward(model, precision, device, flip_average)
    out, oks = [], []
    for pixels, _, ok in loader:
        out.append(forward(pixels))
        oks.append(ok)
    return torch.cat(out), torch.cat(oks)


def drop_unreadable(df: pd.DataFrame, ok: torch.Tensor | np.ndarray) -> tuple[pd.DataFrame, list[str]]:
    """The rows of ``df`` whose image is readable, with ``image_id`` made dense again, and the dropped paths.

    An unreadable image embedded as any fixed vector would still be scored (a zero vector ties everything), so
    it leaves the evaluation with all its captions. ``ok`` is indexed by ``image_id``.
    """
    ok = np.asarray(ok, dtype=bool)
    ids = df["image_id"].to_numpy(dtype=np.int64)
    if ok.all():
        return df, []
    dropped = df[~ok[ids]].drop_duplicates("image_id")["path"].astype(str).tolist()
    new_id = np.cumsum(ok) - 1   # old image_id -> new dense image_id (valid where ok)
    kept = df[ok[ids]].copy()
    kept["image_id"] = new_id[kept["image_id"].to_numpy(dtype=np.int64)]
    return kept.reset_index(drop=True), dropped


def _text_features(model, captions: list[str], batch_size: int, device: torch.device,
                   precision: str) -> torch.Tensor:
    out = []
    for s in range(0, len(captions), batch_size):
        tokens = model.tokenize(captions[s:s + batch_size])
        with autocast(device, precision):
            feats = model.encode_text(tokens["input_ids"].to(device), tokens["attention_mask"].to(device))
        out.append(feats.float())
    return torch.cat(out)


def _val_loss(image_features: torch.Tensor, text_features: torch.Tensor, image_ids: np.ndarray,
              scale: torch.Tensor, batch_size: int) -> float:
    """Mean contrastive loss over batches built like training batches (one caption per image where possible).

    Captions are ordered by (occurrence within their image, image), so a batch holds the k-th captions of
    ``batch_size`` different images; the few same-image pairs at boundaries are masked by ``clip_loss``.
    """
    occurrence = pd.Series(image_ids).groupby(image_ids).cumcount().to_numpy()
    order = np.lexsort((image_ids, occurrence))
    total, count = 0.0, 0
    for s in range(0, len(order), batch_size):
        rows = torch.as_tensor(order[s:s + batch_size])
        if len(rows) < 2:
            continue   # a single pair has no negatives
        ids = torch.as_tensor(image_ids[order[s:s + batch_size]], device=image_features.device)
        loss = clip_loss(image_features[ids], text_features[rows.to(text_features.device)], scale, ids)
        total += loss.item() * len(rows)
        count += len(rows)
    return total / max(count, 1)


@torch.inference_mode()
def evaluate_model(model, df: pd.DataFrame, transform, batch_size: int = 128, cache=None,
                   device: Optional[torch.device] = None, precision: str = "fp32", workers: int = 0,
                   tower_features: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   flip_average: bool = False) -> dict[str, float]:
    """Validation loss and retrieval metrics of ``model`` on a split table.

    Args:
        model: a ``CLIPModel`` (left in eval mode; the caller restores training mode).
        df: split table with ``path``, ``caption`` and dense ``image_id`` (as ``split_by_image`` returns).
        transform: the eval transform (``build_eval_transform(model.preprocess)``).
        batch_size: images / captions per forward pass, and pairs per loss batch.
        cache: optional ``ImageCache`` matching the transform's size.
        device, precision, workers: where and how to run.
        tower_features: ``(features, ok)`` of a locked image tower for the split's images in ``image_id``
            order (``train.frozen_features``); only the image head then runs.
        flip_average: each image's row averaged with its mirror's (``ImageForward``: twice the image pass), as
            ``clip-mini index --flip-average`` stores them; not with ``tower_features``. The trainer leaves it off.

    Returns:
        ``loss`` plus ``retrieval_metrics`` keys (``t2i_r1`` ... ``i2t_medr``, ``rsum``), computed over the
        readable images only, and the counts ``n_images``, ``n_captions`` (scored), ``n_dropped_images`` and
        ``n_dropped_captions`` (unreadable images and their captions, left out and reported by a printed line).

    Raises:
        DataError: no image of the split could be read.
    """
    from clip_mini.data import DataError

    if flip_average and tower_features is not None:
        raise ValueError("flip_average needs the pixels: precomputed tower_features hold no mirror images")
    device = device or next(model.parameters()).device
    model.eval()
    paths = df.drop_duplicates("image_id").sort_values("image_id")["path"].tolist()   # row j = image j
    if tower_features is None:
        image_features, ok = _image_features(model, paths, transform, cache, batch_size, device, precision,
                                             workers, flip_average)
    else:
        feats, ok = tower_features
        with autocast(device, precision):
            image_features = model.project_image(feats.to(device)).float()
    ok = ok.bool().cpu()
    kept, dropped = drop_unreadable(df, ok)
    if dropped:
        if not len(kept):
            raise DataError(f"none of the {len(paths)} evaluation images could be read (e.g. {dropped[0]})")
        print(f"eval: left out {len(dropped)} unreadable image(s) and their {len(df) - len(kept)} caption(s), "
              f"e.g. {dropped[0]}")
    image_features = image_features[ok.to(image_features.device)]
    ids = kept["image_id"].to_numpy(dtype=np.int64)
    text_features = _text_features(model, kept["caption"].astype(str).tolist(), batch_size, device, precision)
    metrics = {"loss": _val_loss(image_features, text_features, ids, model.scale().float(), batch_size)}
    metrics.update(retrieval_metrics(image_features.cpu(), text_features.cpu(), torch.from_numpy(ids.copy())))
    # the model's own "nothing matches" cut-off (clip_mini.eval.cutoff): saved with it, read by search
    metrics.update(calibrate_cutoff(image_features.cpu().numpy(), text_features.cpu().numpy(), ids))
    metrics.update(n_images=len(image_features), n_captions=len(kept), n_dropped_images=len(dropped),
                   n_dropped_captions=len(df) - len(kept))
    # captions cut short by model.text.max_length: a count in every result, one line per process
    from clip_mini.model.text import report_truncation

    metrics["truncated_captions"] = report_truncation(model.tokenizer, kept["caption"].astype(str).tolist(),
                                                      model.cfg.text.max_length, "evaluation")
    return metrics
