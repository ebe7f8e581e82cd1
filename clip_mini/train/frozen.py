"""Precomputed outputs of a locked image tower (``train.frozen_features: N``).

When the image tower is frozen (LiT), its output for a given image and crop never changes, so running it at
every step is wasted work: on this CPU it is most of a step with EfficientNet-Lite0. Instead the tower's pooled
output is computed once per image for ``N`` views (view 0 the eval transform, views 1..N-1 the training
augmentation, each seeded by ``(seed, view, image)``), and training reads those rows: epoch ``e`` uses view
``e % N``. Only the image projection head, the text tower and the temperature then cost anything per step.
Validation images get the eval view once, too.

The features are stored in the run directory (``frozen_features/{split}.safetensors``, written atomically) with a
key over everything they depend on (the image files' paths, sizes and mtimes, the tower config and weights, the
preprocessing, the augmentation settings, the view count, the seed and the precision), so a resumed run reuses
them and a changed input recomputes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from clip_mini.config import Config
from clip_mini.train.accum import autocast

FORMAT = 1


def split_paths(df: pd.DataFrame) -> list[str]:
    """The split's image paths in ``image_id`` order (row j of a feature table = image j)."""
    return df.drop_duplicates("image_id").sort_values("image_id")["path"].astype(str).tolist()


def features_key(cfg: Config, paths: list[str], views: int, tower_state: dict[str, torch.Tensor]) -> str:
    """Hash of everything the stored features depend on; a mismatch means recompute."""
    h = hashlib.sha256()
    files = []
    for p in paths:
        try:
            st = os.stat(p)
            files.append((p, st.st_size, st.st_mtime_ns))
        except OSError:
            files.append((p, -1, -1))   # unreadable now: its row is zeros, recomputed if it comes back
    data = {k: getattr(cfg.data, k) for k in ("scale_min", "color_jitter", "hflip")} if views > 1 else {}
    h.update(json.dumps({"format": FORMAT, "files": files, "vision": dataclasses.asdict(cfg.model.vision),
                         "data": data, "views": views, "seed": cfg.train.seed,
                         "precision": cfg.train.precision}, sort_keys=True, default=str).encode())
    for name in sorted(tower_state):   # the weights themselves: a different checkpoint, different features
        h.update(name.encode())
        h.update(tower_state[name].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class _ViewDataset(Dataset):
    """Image i under view ``view``: the eval transform for view 0, else the seeded training augmentation."""

    def __init__(self, paths: list[str], eval_transform, augment, cache, seed: int):
        from clip_mini.data import ImageDataset

        self.eval = ImageDataset(paths, eval_transform, cache)
        self.aug = ImageDataset(paths, augment, cache) if augment is not None else None
        self.augment, self.seed, self.view = augment, seed, 0

    def __len__(self) -> int:
        return len(self.eval)

    def __getitem__(self, i: int):
        if self.view == 0:
            return self.eval[i]
        self.augment.key = (self.seed, self.view, int(i))
        return self.aug[i]


@torch.inference_mode()
def compute_features(model, dataset: _ViewDataset, views: int, batch_size: int, device: torch.device,
                     precision: str, workers: int, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(views, N, D)`` tower outputs and an ``(N,)`` bool mask of images that could be read."""
    n, out, ok_all = len(dataset), [], torch.ones(len(dataset), dtype=torch.bool)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model.visual.eval()
    bar = tqdm(total=n * views, desc=desc, unit="img", dynamic_ncols=True)
    for view in range(views):
        dataset.view = view
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                            generator=torch.Generator())   # never moves the global RNG (exact resume)
        rows, done = [], 0
        for pixels, _, ok in loader:
            with autocast(device, precision):
                rows.append(model.visual(pixels.to(device)).to(dtype).cpu())
            ok_all[done:done + len(ok)] &= ok
            done += len(ok)
            bar.update(len(ok))
        out.append(torch.cat(rows))
    bar.close()
    return torch.stack(out), ok_all


def load_or_compute(model, cfg: Config, df: pd.DataFrame, split: str, views: int, run: Path, cache,
                    device: torch.device, augment=None, write: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The split's stored features when their key matches, else computed now (and stored, if ``write``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    from clip_mini.data import build_eval_transform
    from clip_mini.io import atomic_path

    paths = split_paths(df)
    key = features_key(cfg, paths, views, model.visual.state_dict())
    path = run / "frozen_features" / f"{split}.safetensors"
    if path.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                stored_key = (f.metadata() or {}).get("key")
            if stored_key == key:
                t = load_file(str(path))
                if t["features"].shape[:2] == (views, len(paths)):
                    return t["features"], t["ok"]
        except (SafetensorError, OSError, KeyError):
            pass   # damaged or foreign: recompute (it is a cache, never the only copy of anything)
    dataset = _ViewDataset(paths, build_eval_transform(model.preprocess), augment, cache, cfg.train.seed)
    features, ok = compute_features(model, dataset, views, cfg.train.eval_batch_size, device, cfg.train.precision,
                                    cfg.data.workers, desc=f"frozen image features ({split})")
    if write:
        with atomic_path(path) as tmp:
            save_file({"features": features.contiguous(), "ok": ok}, str(tmp), metadata={"key": key})
    return features, ok


class FrozenFeatureDataset(Dataset):
    """(tower features, caption, image_id) rows; ``epoch`` (set by the loader) picks view ``epoch % views``.

    A row whose image could not be read when the features were computed is replaced by the next readable row,
    as ``CaptionDataset`` does for pixels, so the pair stays genuine.
    """

    def __init__(self, df: pd.DataFrame, features: torch.Tensor, ok: torch.Tensor):
        self.features, self.ok = features, ok
        self.captions = df["caption"].astype(str).tolist()
        self.image_ids = df["image_id"].astype(int).tolist()
        self.epoch = 0
        if not bool(ok.any()):
            from clip_mini.data import DataError

            raise DataError("no training image could be read while computing the frozen image features")

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int):
        view = self.epoch % self.features.shape[0]
        n = len(self.captions)
        for step in range(n):
            j = (i + step) % n
            image = self.image_ids[j]
            if self.ok[image]:
                return self.features[view, image], self.captions[j], image
        raise AssertionError("unreachable: at least one image is readable")


class FeatureCollate:
    """``CaptionCollate`` for feature rows: the stacked rows go under ``tower_features`` instead of ``pixels``."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        out = self.collate(batch)
        out["tower_features"] = out.pop("pixels")
        return out


def prepare(model, cfg: Config, splits: dict[str, pd.DataFrame], run: Path, cache, device: torch.device,
            is_main: bool, barrier) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train": ((N views, I, D), ok), "val": ((I, D), ok)}``; rank 0 computes and stores, then the others read."""
    from clip_mini.data import build_train_transform
    from clip_mini.train.inputs import SeededAugment

    views = cfg.train.frozen_features
    augment = SeededAugment(build_train_transform(model.preprocess, cfg.data)) if views > 1 else None
    out = {}
    for rank_turn in (True, False):   # rank 0 first; then, after the barrier, everyone else (finding the files)
        if is_main == rank_turn:
            out["train"] = load_or_compute(model, cfg, splits["train"], "train", views, run, cache, device,
                                           augment, write=is_main)
            val, ok = load_or_compute(model, cfg, splits["val"], "val", 1, run, cache, device, write=is_main)
            out["val"] = (val[0], ok)   # (N, D): the one eval view
        if rank_turn:
            barrier()
    return out


def build_frozen_train_inputs(cfg: Config, df: pd.DataFrame, features: torch.Tensor, ok: torch.Tensor, tokenizer,
                              max_length: int, rank: int = 0, world_size: int = 1):
    """``TrainInputs`` whose batches carry ``tower_features`` rows instead of pixels."""
    from clip_mini.data import CaptionCollate, OneCaptionPerImageSampler
    from clip_mini.train.inputs import TrainInputs

    sampler = OneCaptionPerImageSampler(df["image_id"].tolist(), seed=cfg.train.seed, rank=rank,
                                        world_size=world_size)
    t = cfg.train
    steps = len(sampler) // (t.batch_size * t.accum_freq)
    # workers: 0, rows are slices of one in-memory tensor; worker processes would only add pickling
    return TrainInputs(FrozenFeatureDataset(df, features, ok), sampler,
                       FeatureCollate(CaptionCollate(tokenizer, max_length)), t.batch_size, t.accum_freq, 0, steps)
