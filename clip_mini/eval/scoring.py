"""Scoring a saved model: retrieval on a dataset split, and zero-shot classification with prompt templates.

The split is made by the same ``load_table`` + ``split_by_image`` calls as the trainer, from the same config, and
scored by the trainer's ``clip_mini.eval.metrics`` functions, so ``clip-mini eval`` reproduces the numbers in a run's
``metrics.jsonl``. Val is scored unless the test split is asked for by name; a test scoring writes its line in the
test ledger (``clip_mini.eval.ledger``) before the split is read.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from clip_mini.errors import EvalError

DEFAULT_TEMPLATES = ("a photo of a {}.",)   # the same as clip_mini.embed.DEFAULT_TEMPLATES (torch-free here)


def embed_image_files(embedder, paths: Sequence[str], batch_size: int = 64, workers: int = 0,
                      progress: bool = True, precision: str = "fp32", flip_average: bool = False
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Embed image files; returns (features (n_ok, d) float32, indices of the readable files into ``paths``);
    ``flip_average`` as ``iter_image_features``.

    Unreadable files are left out (and printed), never embedded as a placeholder vector.
    """
    from clip_mini.features.image_files import iter_image_features

    feats, keep = [np.zeros((0, embedder.dim), np.float32)], [np.zeros(0, np.int64)]
    for idx, f, bad in iter_image_features(embedder, list(paths), batch_size, workers, precision, progress,
                                           flip_average=flip_average):
        feats.append(f)
        keep.append(idx.astype(np.int64))
        for i, reason in bad.items():
            print(f"eval: skipping unreadable image {paths[i]}: {reason}")
    return np.concatenate(feats), np.concatenate(keep)


def trained_settings(model_dir: str | Path) -> dict:
    """The evaluation settings a trained model directory records (``config.json`` ``trained``): ``precision``
    and ``eval_batch_size`` where the trainer wrote them, else an empty dict (older or hand-made models)."""
    from clip_mini.fileio.manifest import read_json

    trained = read_json(Path(model_dir) / "config.json").get("trained")
    if not isinstance(trained, dict):
        return {}
    return {k: trained[k] for k in ("precision", "eval_batch_size") if k in trained}


def _resolve_precision(precision: Optional[str], device: str) -> str:
    """``--precision`` by the one hardware rule (``auto`` / None: bf16 where the device computes it natively, else
    fp32), not the precision the model was trained at: a bf16-trained model scored on a CPU without bf16 runs fp32."""
    from clip_mini.runtime.devices import resolve_device, resolve_precision

    if precision not in (None, "auto", "fp32", "bf16", "fp16"):
        raise EvalError(f"--precision must be auto, fp32, bf16 or fp16, got {precision!r}")
    return resolve_precision(precision, resolve_device(device))


DEFAULT_SPLIT = "val"   # choices are made on val; the test split is scored only when named (and then ledgered)
# what a test scoring's ledger line keeps of the result
LEDGER_KEYS = ("t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "rsum", "loss")


def evaluate_retrieval(model_dir: str | Path, config: str | Path, split: Optional[str] = None,
                       overrides: Optional[list[str]] = None, batch_size: Optional[int] = None, workers: int = 0,
                       progress: bool = True, precision: Optional[str] = None, device: str = "auto",
                       flip_average: bool = False) -> dict:
    """Multi-caption recall@1/5/10 both ways, median rank and contrastive loss of a model on one split.

    The split comes from ``data.load_splits`` (as in the trainer; for a WebDataset config, ``data.format:
    webdataset``, the validation shards' images as the trainer extracts them), the pixels from its image cache
    (when ``data.cache`` is on) and eval transform, and the scores from its ``evaluate_model``, run at the
    trainer's batch size and at the precision the hardware rule picks (the trainer's own on the machine it ran
    on), so there, for the run's own model and config, the numbers equal the ones in its ``metrics.jsonl``. Unreadable images are left out with their captions (``n_dropped_images``,
    ``n_dropped_captions``).

    A test scoring (``split="test"``) writes its line in the test ledger first
    (``clip_mini.eval.ledger.record_test_scoring``) and completes it with the numbers, or the error, after.

    Args:
        split: "train", "val" or "test"; None: val (``DEFAULT_SPLIT``).
        batch_size: images / captions per forward pass and pairs per loss batch (the loss depends on it).
            None: the ``eval_batch_size`` the model directory records, else the config's
            ``train.eval_batch_size``.
        precision: ``"auto"`` / None (bf16 where ``device`` computes it natively, else fp32), ``"fp32"``,
            ``"bf16"`` or ``"fp16"`` autocast.
        device: "auto", "cpu", "cuda" or "cuda:N".
        flip_average: each image's row averaged with its mirror's, as ``clip-mini index --flip-average`` stores
            them (twice the image pass; no longer the trainer's numbers); recorded in the result and the ledger.

    Raises:
        EvalError: unknown or empty split, or unknown precision.
    """
    from clip_mini.config import load_config

    if split not in (None, "train", "val", "test"):
        raise EvalError(f"--split must be train, val or test, got {split!r}")
    precision = _resolve_precision(precision, device)
    cfg = load_config(config, overrides)
    wds = cfg.data.format == "webdataset"
    if split is None:
        split = DEFAULT_SPLIT
        if progress:
            print(f"eval: no --split given: scoring the {split} split (--split test scores test, and records "
                  f"that in the test ledger)", file=sys.stderr)
    if wds and split != "val":
        raise EvalError(f"{config} reads WebDataset shards: its one scored split is val (data.val_shards, else the "
                        f"last of data.shards), not {split!r}; use --split val")
    if not wds and split in ("val", "test") and not (getattr(cfg.data, split) or getattr(cfg.data, f"{split}_list")):
        # known from the config alone: say so before load_splits checks every image of the dataset
        raise EvalError(f"split {split!r} of {config} is empty (data.{split}={getattr(cfg.data, split)}, no "
                        f"data.{split}_list); choose another --split or set data.{split}")
    batch_size = batch_size or trained_settings(model_dir).get("eval_batch_size") or cfg.train.eval_batch_size
    run = dict(split=split, batch_size=batch_size, workers=workers, progress=progress, precision=precision,
               device=device, flip_average=bool(flip_average))
    if split != "test":
        return _score_split(model_dir, config, cfg, **run)
    from clip_mini.eval.ledger import config_hash, record_test_scoring

    with record_test_scoring(variant=Path(model_dir).as_posix(), source="clip-mini eval", config=config,
                             config_hash=config_hash(cfg.to_dict()), precision=precision,
                             flip_average=bool(flip_average)) as line:
        out = _score_split(model_dir, config, cfg, **run)
        line.test, line.test_images = {"model": {k: out[k] for k in LEDGER_KEYS if k in out}}, out["n_images"]
    return out


def _score_split(model_dir: str | Path, config: str | Path, cfg, split: str, batch_size: int, workers: int,
                 progress: bool, precision: str, device: str, flip_average: bool) -> dict:
    """``evaluate_retrieval``'s scoring, once the split and the settings are checked."""
    from clip_mini.data import load_splits, make_cache
    from clip_mini.embed import load
    from clip_mini.eval.validation import evaluate_model

    if cfg.data.format == "webdataset":
        from clip_mini.data.wds_stream import val_split

        df = val_split(cfg.data)   # the trainer's validation table: the val shards' images, extracted once
    else:
        df = load_splits(cfg, progress=progress)[split]
    if len(df) == 0:
        raise EvalError(f"split {split!r} of {config} is empty (data.{split}={getattr(cfg.data, split, None)}); "
                        f"choose another --split or set data.{split}")
    embedder = load(model_dir, device=device, batch_size=batch_size)
    if progress:
        print(f"eval: {df['image_id'].nunique()} images, {len(df)} captions ({split}), {precision}, "
              f"batch {batch_size}{', flip averaging' if flip_average else ''}", file=sys.stderr)
    cache = make_cache(cfg.data, embedder.model.preprocess, df["path"].nunique())
    metrics = evaluate_model(embedder.model, df, embedder.transform, batch_size=batch_size, cache=cache,
                             workers=workers, precision=precision, flip_average=flip_average)
    return {"split": split, "precision": precision, "batch_size": batch_size, "flip_average": flip_average,
            **metrics}


def class_text_features(encoder, classes: Sequence[str], templates: Sequence[str],
                        precision: str = "fp32") -> np.ndarray:
    """One L2-normalised row per class: ``Embedder.label_embeddings`` (the mean of its normalised template
    embeddings, as in CLIP) under ``precision``'s autocast."""
    import torch

    from clip_mini.runtime.precision import autocast

    if hasattr(encoder, "precision"):
        # An Embedder runs its own autocast at its own precision inside encode_text, which would override an
        # autocast opened here (the text side then ran fp32 whatever was asked): it is told the precision instead.
        before, encoder.precision = encoder.precision, precision
        try:
            return _label_embeddings(encoder, classes, templates)
        finally:
            encoder.precision = before
    with autocast(torch.device(getattr(encoder, "device", "cpu")), precision):
        return _label_embeddings(encoder, classes, templates)


def _label_embeddings(encoder, classes: Sequence[str], templates: Sequence[str]) -> np.ndarray:
    from clip_mini.errors import InputError

    try:
        return encoder.label_embeddings(classes, templates)
    except InputError as e:
        raise EvalError(str(e)) from None


def read_labels(labels: str | Path, images: Optional[str | Path] = None, label_col: str = "label"
                ) -> tuple[list[str], list[str], list[int]]:
    """Ground truth for zero-shot classification: ``(classes, image paths, class index per image)``.

    Args:
        labels: a ``.txt`` file of class names (one per line) with ``images`` an ImageFolder (one subfolder per
            class, named as in the file); or a CSV with an ``image`` column and ``label_col`` (classes = the
            sorted distinct labels; image paths resolve as for a captions file).
    """
    labels = Path(labels)
    if not labels.is_file():
        raise EvalError(f"labels file not found: {labels}")
    if labels.suffix.lower() == ".csv":
        from clip_mini.data import read_captions

        df, _ = read_captions(labels, image_root=images, fmt="csv", caption_col=label_col)
        df = df.drop_duplicates("path")
        classes = sorted(df["caption"].unique())
        index = {c: i for i, c in enumerate(classes)}
        return classes, df["path"].tolist(), [index[c] for c in df["caption"]]
    from clip_mini.features.image_files import image_files

    classes = [ln.strip() for ln in labels.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if images is None:
        raise EvalError(f"{labels} lists class names: give --images FOLDER with one subfolder per class")
    paths, targets = [], []
    for i, name in enumerate(classes):
        folder = Path(images) / name
        found = image_files(folder) if folder.is_dir() else []
        paths += found
        targets += [i] * len(found)
    if not paths:
        raise EvalError(f"no images in class subfolders of {images} named as in {labels} (e.g. {classes[:3]})")
    return classes, paths, targets


def evaluate_zero_shot(model_dir: str | Path, labels: str | Path, images: Optional[str | Path] = None,
                       label_col: str = "label", templates: Sequence[str] = DEFAULT_TEMPLATES,
                       batch_size: int = 64, workers: int = 0, progress: bool = True,
                       precision: Optional[str] = None, device: str = "auto", flip_average: bool = False) -> dict:
    """Top-1/top-5 zero-shot accuracy: each image gets the class whose prompt embedding is nearest.

    ``precision`` and ``flip_average`` as in ``evaluate_retrieval``. Unreadable images are left out
    (``n_dropped_images``).
    """
    from clip_mini.embed import load
    from clip_mini.eval.metrics import zero_shot_accuracy

    precision = _resolve_precision(precision, device)
    classes, paths, targets = read_labels(labels, images, label_col)
    if len(classes) < 2:
        raise EvalError(f"{labels}: zero-shot classification needs at least 2 classes, found {classes}")
    embedder = load(model_dir, device=device, batch_size=batch_size)
    class_features = class_text_features(embedder, classes, templates, precision)
    image_features, ok = embed_image_files(embedder, paths, batch_size, workers, progress, precision, flip_average)
    if len(ok) == 0:
        raise EvalError(f"none of the {len(paths)} images listed by {labels} could be read (e.g. {paths[0]})")
    acc = zero_shot_accuracy(image_features, class_features, np.asarray(targets)[ok])
    return {"n_images": int(len(ok)), "n_dropped_images": len(paths) - int(len(ok)), "n_classes": len(classes),
            "templates": list(templates), "precision": precision, "flip_average": bool(flip_average), **acc,
            "labels": os.fspath(labels)}
