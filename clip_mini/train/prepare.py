"""The one-time work before the first step, in one place: the image cache (filled up front in a budget run), the
frozen-feature pass of a locked image tower, the text pass of a locked text tower, and the training inputs.

All of it is timed on the run's clock (``cache_fill``, ``feature_pass``, ``text_pass``) and, in a budget run,
counts against the budget: each long pass checks its own projection against the deadline after its first batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from clip_mini.config import Config
from clip_mini.data.mirror import swap_left_right, swaps_captions
from clip_mini.train import text_cache
from clip_mini.train.budget import feature_pass_check, fill_cache
from clip_mini.train.build import TrainError
from clip_mini.train.clock import RunClock
from clip_mini.train.distributed import all_min, barrier
from clip_mini.train.inputs import build_train_inputs, make_image_cache


@dataclass
class Prepared:
    """What the step loop and the evaluations read."""

    inputs: Any                       # ``TrainInputs``: per-epoch loaders, collate, steps_per_epoch
    steps_per_epoch: int              # the same on every rank (the smallest)
    cache: Any = None                 # the decoded-image cache, or None
    frozen_feats: Optional[dict] = None   # a locked image tower's outputs per split


def prepare(cfg: Config, model, splits: dict[str, pd.DataFrame], run: Path, info, clock: RunClock,
            deadline: Optional[float] = None) -> Prepared:
    """Run the one-time work and build the training inputs. ``deadline``: the budget's end (``time.time()``
    scale), which the cache fill and the frozen-feature pass check their projections against; None: no budget.

    Raises:
        BudgetError: one-time work alone would pass the deadline (before any training).
        TrainError: the train split is smaller than one global batch.
    """
    t, main, device = cfg.train, info.is_main, info.device
    budget_s = (deadline - clock.started) if deadline is not None else None
    cache = make_image_cache(cfg, model.preprocess, splits)
    # every rank decides on the cache from its own free disk: agree first (one rank alone filling or waiting hangs)
    if not all_min(int(cache is not None), device):
        cache = None
    frozen_feats = None
    if deadline is not None and cache is not None and not t.frozen_features:   # filled first: timed steps are real
        if main:
            with clock("cache_fill"):
                paths = sorted({p for df in splits.values() for p in df["path"].unique()})
                fill_cache(cache, paths, model.preprocess, deadline, budget_s, progress=main)
        barrier()
    if t.frozen_features:
        from clip_mini.train import frozen as frozen_io

        with clock("feature_pass"):
            frozen_feats = frozen_io.prepare(model, cfg, splits, run, cache, device, main, barrier,
                                             check=feature_pass_check(deadline, budget_s) if deadline else None,
                                             rank=info.rank, world_size=info.world_size)   # views split over ranks
        inputs = frozen_io.build_frozen_train_inputs(cfg, splits["train"], *frozen_feats["train"], model.tokenizer,
                                                     model.cfg.text.max_length, info.rank, info.world_size)
    else:
        inputs = build_train_inputs(cfg, splits["train"], model.preprocess, model.tokenizer,
                                    model.cfg.text.max_length, info.rank, info.world_size, cache)
    if t.captions_per_image > 1 and not text_cache.wanted(cfg):   # a trained text tower: tokens of each caption
        from clip_mini.data.caption_groups import CaptionGroupCollate, group_by_image

        groups = group_by_image(splits["train"]["caption"].astype(str).tolist(), splits["train"]["image_id"].tolist())
        inputs.collate = CaptionGroupCollate(inputs.collate, model.tokenizer, model.cfg.text.max_length, groups,
                                             t.captions_per_image)
    if text_cache.wanted(cfg):   # a locked text tower: its rows once per distinct caption, not every step
        with clock("text_pass"):
            captions = splits["train"]["caption"].tolist()
            # data.hflip: swap / data.mirror_pairs: the mirrored captions need rows too
            rows_for = captions + [swap_left_right(c) for c in captions] if swaps_captions(cfg.data) else captions
            index, rows = text_cache.load_or_compute_rows(
                model, rows_for, t.eval_batch_size * 4, device, t.precision,
                run / "frozen_features" / "text-tower.safetensors", progress=main, write=main)
            groups = (text_cache.caption_groups(captions, splits["train"]["image_id"].tolist(), index)
                      if t.captions_per_image > 1 else None)
            inputs.collate = text_cache.TextRowCollate(inputs.collate, index, rows, t.captions_per_image, groups)
    steps_per_epoch = all_min(inputs.steps_per_epoch, device)
    if steps_per_epoch == 0:
        global_batch = t.batch_size * t.accum_freq * info.world_size
        need = (f"the {global_batch // 2} sources of one batch of {global_batch} (data.mirror_pairs)"
                if cfg.data.mirror_pairs else f"one batch of {global_batch}")
        raise TrainError(f"the train split has {splits['train']['image_id'].nunique()} images, fewer than {need}; "
                         "lower train.batch_size or train.accum_freq")
    return Prepared(inputs, steps_per_epoch, cache, frozen_feats)
