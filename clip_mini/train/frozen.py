"""Precomputed outputs of a locked image tower, or of its locked first blocks (``train.frozen_features: N``).

When the image tower is frozen (LiT), its output for a given image and crop never changes, so running it at
every step is wasted work: on a CPU it is most of a step with EfficientNet-Lite0. Instead the tower's pooled
output is computed once per image for ``N`` views (view 0 the eval transform, views 1..N-1 the training
augmentation, each seeded by ``(seed, view, image)``), and training reads those rows: epoch ``e`` uses view
``e % N``. Only the image projection head, the text tower and the temperature then cost anything per step.
Validation images get the eval view once, too.

With ``model.vision.trainable_blocks: k > 0`` only the last ``k`` ViT blocks train, so what is stored is the
token states after block ``depth - k`` ((N_tokens, D) per image, bf16 under bf16 precision); each step runs the
last ``k`` blocks, the final norm and the pooling on them (``ImageEncoder.forward_suffix``), which costs about
``k / depth`` of a tower pass. Token views are large (5,591 images x 145 tokens x 384 x 2 bytes = 623 MB per view
for ViT-S/14 at 168 px), so they are memory-mapped from their files rather than stacked in memory: an epoch
pages in only its own view. Evaluation runs the current last blocks on the stored validation tokens.

Each view is stored in the run directory (``frozen_features/{split}-view{v}.safetensors``, written atomically)
with a key over everything it depends on (the image files' paths and bytes, the tower config and weights,
the precision, the preprocessing and image cache geometry, and for augmented views the augmentation settings and
the seed; with a block prefix, ``k`` and the weights of everything that does not train, never those of the
last ``k`` blocks, which a resumed run has changed), so a resumed run reuses them, a
run with more views computes only the new ones, and a changed input recomputes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from clip_mini.config import Config, PreprocessConfig
from clip_mini.fileio.atomic import sha256_file
from clip_mini.runtime.devices import loader_workers
from clip_mini.train.accum import autocast

FORMAT = 3   # 2: under bf16 the pass runs a bf16-weight copy of the tower (vision.inference_tower); 3: BatchNorm folded


def split_paths(df: pd.DataFrame) -> list[str]:
    """The split's image paths in ``image_id`` order (row j of a feature table = image j)."""
    return df.drop_duplicates("image_id").sort_values("image_id")["path"].astype(str).tolist()


def token_blocks(cfg: Config) -> int:
    """``k`` when the store holds token states before the last ``k`` trainable blocks, else 0 (pooled outputs)."""
    v = cfg.model.vision
    return v.trainable_blocks if v.trainable and v.trainable_blocks else 0


def frozen_state(visual, cfg: Config) -> dict[str, torch.Tensor]:
    """The tower weights the stored outputs depend on and that never train: all of them for a locked tower; with
    a block prefix everything but the last ``k`` blocks (whose weights a resumed run has already changed)."""
    state = visual.state_dict()
    if not token_blocks(cfg):
        return state
    return {n: t for n, t in state.items() if not visual.in_trainable_suffix(n)}


def inputs_digest(cfg: Config, paths: list[str], tower_state: dict[str, torch.Tensor],
                  pre: PreprocessConfig) -> str:
    """Hash of what every view depends on: the image files (path and the sha256 of their bytes), the tower
    config and weights, the precision, the preprocessing (``pre``: size, mean, std, resize mode), ``data.cache``
    and the cache record geometry. Computed once per split; ``features_key`` adds what differs between views.

    The files are keyed by content, not by mtime: the same images restored or checked out again keep the stored
    features (hashing reads each file once, far cheaper than the tower pass it saves)."""
    from clip_mini.data.cache import cache_geometry

    h = hashlib.sha256()
    files = []
    for p in paths:
        try:
            files.append((p, sha256_file(p)))
        except OSError:
            files.append((p, None))   # unreadable now: its row is zeros, recomputed if it comes back
    # The cache on or off gives the same pixels by construction (transforms.py); it is keyed anyway, so that a
    # future change to either read path can never be masked by stale features.
    pixels = {"preprocess": dataclasses.asdict(pre), "cache": cfg.data.cache,
              "cache_geometry": cache_geometry(cfg.data, pre)}
    h.update(json.dumps({"format": FORMAT, "files": files, "vision": dataclasses.asdict(cfg.model.vision),
                         "token_blocks": token_blocks(cfg), "precision": cfg.train.precision, **pixels},
                        sort_keys=True, default=str).encode())
    for name in sorted(tower_state):   # the weights themselves: a different checkpoint, different features
        h.update(name.encode())
        h.update(tower_state[name].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def features_key(digest: str, cfg: Config, view: int) -> str:
    """Key of one view's stored features; a mismatch means recompute.

    View 0 (the eval transform) depends on ``inputs_digest`` only, so runs that differ in their view count or
    augmentation share it; an augmented view also depends on the augmentation and the seed.
    """
    aug = ({"data": {k: getattr(cfg.data, k) for k in ("scale_min", "color_jitter", "hflip")},
            "seed": cfg.train.seed} if view else {})
    from clip_mini.data.cache import VERSION as decode_version   # how images are decoded (large JPEGs: reduced)

    blob = json.dumps({"inputs": digest, "view": view, "decode": decode_version, **aug}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


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


class TowerPass:
    """The locked tower as the frozen-feature pass runs it, built once for all the views of a split.

    Under bf16 a bf16-weight copy (``vision.inference_tower``: faster than autocast) run as it is;
    ``blocks = k > 0``: the token states before the last ``k`` blocks; ``compile``: through ``torch.compile``
    (``clip_mini.model.layers.compile_pass``: one compilation for every view and batch, eager if compiling fails).
    """

    def __init__(self, model, precision: str, blocks: int = 0, compile: bool = False):
        from clip_mini.model.vision import inference_tower, pixel_dtype

        model.visual.eval()
        self.tower = inference_tower(model.visual, precision)
        self.cast = precision if self.tower is model.visual else "fp32"   # a bf16 copy runs without autocast
        self.input_dtype = pixel_dtype(self.tower)   # the eval view's pixels can come in it
        self.run = (lambda x: self.tower.forward_prefix(x, blocks)) if blocks else self.tower
        if compile:
            from clip_mini.model.layers.compile_pass import CompiledPass

            self.run = CompiledPass(self.run, "the frozen-feature pass")

    def __call__(self, pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
        from clip_mini.model.vision import tower_input

        with autocast(device, self.cast):
            return self.run(tower_input(self.tower, pixels.to(device, non_blocking=True)))


@torch.inference_mode()
def compute_view(model, dataset: _ViewDataset, view: int, batch_size: int, device: torch.device, precision: str,
                 workers: int, desc: str, blocks: int = 0, tower: Optional[TowerPass] = None,
                 check=None, left_after: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, D)`` tower outputs of one view (``blocks = k > 0``: ``(N, T, D)`` token states before the last
    ``k`` blocks) and an ``(N,)`` bool mask of the images that could be read. ``tower``: the pass to run (a
    ``TowerPass`` of ``model``, ``precision`` and ``blocks``), built here when not given. ``check``:
    ``check(images done, images of the whole pass, seconds)`` after the first batches (``train.budget``), the
    whole pass being this view and ``left_after`` more images."""
    from clip_mini.data import collate_images

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tower = tower or TowerPass(model, precision, blocks)
    dataset.view = view
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                        generator=torch.Generator(),   # never moves the global RNG (exact resume)
                        pin_memory=device.type == "cuda", collate_fn=collate_images)
    rows, oks, start, tick = None, [], 0, time.perf_counter()
    for i, (pixels, _, ok) in enumerate(tqdm(loader, desc=desc, unit="batch", dynamic_ncols=True)):
        out = tower(pixels, device)
        if rows is None:   # filled in place: a token view is hundreds of MB, a list + cat would hold it twice
            rows = torch.empty((len(dataset), *out.shape[1:]), dtype=dtype)
        rows[start:start + len(out)] = out.to(dtype).cpu()
        start += len(out)
        oks.append(ok)
        if check is not None and (i == 2 or start == len(dataset)):   # after the first batches (a settled rate)
            check(start, len(dataset) + left_after, time.perf_counter() - tick)
            check = None
    assert rows is not None and start == len(dataset), "the view covers every image"
    return rows, torch.cat(oks)


def _read_view(path: Path, key: str, n: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    from clip_mini.fileio.atomic import read_keyed_tensors

    got = read_keyed_tensors(path, key, ("features", "ok"))
    if got is None:
        return None
    features, ok = got["features"], got["ok"]
    return (features, ok) if features.shape[0] == n and ok.shape == (n,) else None


def load_or_compute(model, cfg: Config, df: pd.DataFrame, split: str, views: int, run: Path, cache,
                    device: torch.device, augment=None, write: bool = True, only: Optional[list[int]] = None,
                    check=None, left_after: int = 0):
    """Features of a split and its ``(N,)`` readable mask: each view read from
    ``frozen_features/{split}-view{v}.safetensors`` when its key matches, else computed (and stored, if ``write``).

    Returns:
        ``(features, ok)``: features a ``(views, N, D)`` tensor of tower outputs, or under
        ``model.vision.trainable_blocks: k > 0`` a list of ``views`` ``(N, T, D)`` token-state tensors,
        memory-mapped from their files (a stored view is never loaded whole). With ``only``: just those views
        are read or computed and stored, and None is returned (a rank's share of the pass, ``prepare``).
    """
    from clip_mini.data import build_eval_transform
    from clip_mini.fileio.atomic import write_keyed_tensors

    paths = split_paths(df)
    blocks = token_blocks(cfg)
    digest = inputs_digest(cfg, paths, frozen_state(model.visual, cfg), model.preprocess)
    dataset, tower, features, ok_all = None, None, [], torch.ones(len(paths), dtype=torch.bool)
    for view in range(views) if only is None else only:
        key = features_key(digest, cfg, view)
        path = run / "frozen_features" / f"{split}-view{view}.safetensors"
        got = _read_view(path, key, len(paths))
        if got is None:
            if dataset is None:
                tower = TowerPass(model, cfg.train.precision, blocks, cfg.train.compile_tower)
                # a bf16 tower's eval view: pixels normalised straight to bf16, the same values (data/transforms.py)
                eval_transform = build_eval_transform(model.preprocess, tower.input_dtype)
                dataset = _ViewDataset(paths, eval_transform, augment, cache, cfg.train.seed)
            what = f"token states before the last {blocks} blocks" if blocks else "image features"
            got = compute_view(model, dataset, view, cfg.train.eval_batch_size, device, cfg.train.precision,
                               loader_workers(cfg.data.workers),
                               desc=f"frozen {what} ({split}, view {view + 1}/{views})",
                               blocks=blocks, tower=tower, check=check,
                               left_after=len(paths) * (views - view - 1) + left_after)
            check = None   # one projection, from the first view computed
            if write:
                write_keyed_tensors(path, {"features": got[0], "ok": got[1]}, key)
                if blocks:   # drop the in-memory copy for the memory-mapped file
                    got = _read_view(path, key, len(paths)) or got
        features.append(got[0])
        ok_all &= got[1]
    if only is not None:
        return None
    return (features if blocks else torch.stack(features)), ok_all


class FrozenFeatureDataset(Dataset):
    """(tower features, caption, image_id) rows; ``epoch`` (set by the loader) picks view ``epoch % views``.

    ``features`` is indexed ``[view][image]``: a ``(views, N, D)`` tensor or a list of per-view tensors.

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
        view = self.epoch % len(self.features)
        n = len(self.captions)
        for step in range(n):
            j = (i + step) % n
            image = self.image_ids[j]
            if self.ok[image]:
                return self.features[view][image], self.captions[j], image
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
            is_main: bool, barrier, check=None, rank: int = 0, world_size: int = 1
            ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train": ((N views, I, D), ok), "val": ((I, D), ok)}``.

    Distributed, the views (the train views and the val view) are dealt out to the ranks in turn: each computes
    and stores its own on its own device, all wait (``barrier``, a long-wait group: a view of a large split takes
    as long as it takes), then every rank reads every view from the files. One process computes them all, with
    ``check``: the budget's projection of the pass (``compute_view``), made once.
    """
    from clip_mini.data import build_train_transform
    from clip_mini.train.inputs import SeededAugment

    views = cfg.train.frozen_features
    augment = SeededAugment(build_train_transform(model.preprocess, cfg.data)) if views > 1 else None
    if world_size > 1:
        jobs = [("train", v) for v in range(views)] + [("val", 0)]
        mine = [job for i, job in enumerate(jobs) if i % world_size == rank]
        for split, n in (("train", views), ("val", 1)):
            only = [v for s, v in mine if s == split]
            if only:
                load_or_compute(model, cfg, splits[split], split, n, run, cache, device,
                                augment if split == "train" else None, write=True, only=only)
        barrier()
        check = None   # every view is on disk now
    n_val = len(split_paths(splits["val"]))
    train = load_or_compute(model, cfg, splits["train"], "train", views, run, cache, device, augment,
                            write=is_main, check=check, left_after=n_val)
    val, ok = load_or_compute(model, cfg, splits["val"], "val", 1, run, cache, device, write=is_main, check=check)
    return {"train": train, "val": (val[0], ok)}   # val: (N, D) or (N, T, D), the one eval view


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


@torch.inference_mode()
def val_tower_features(model, val: tuple[torch.Tensor, torch.Tensor], batch_size: int, device: torch.device,
                       precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features, ok)`` as ``evaluate_model`` takes them: stored tower outputs as they are; stored token states
    through the current last blocks (eval mode, in batches), i.e. what the model gives on the pixels."""
    features, ok = val
    if features.ndim == 2:
        return features, ok
    model.visual.eval()   # the caller restores training mode
    rows = []
    for s in range(0, len(features), batch_size):
        with autocast(device, precision):
            rows.append(model.visual.forward_suffix(features[s:s + batch_size].to(device)))
    return torch.cat(rows), ok
