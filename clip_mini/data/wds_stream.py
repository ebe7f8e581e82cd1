"""Training from WebDataset shards: a stream per (rank, loader worker) over disjoint shards, epochs by sample count.

Epoch e shuffles the shard list with ``(seed, e)``; rank r takes every world-th shard from r, and its loader worker
w every W-th of those (W = ``data.workers``, or 1), so no two processes read the same shard in an epoch. Each
stream cycles over its shards (an epoch is ``data.samples`` samples, not one pass: streams run out at different
times), mixes them in a shuffle buffer seeded by ``(seed, e, r, w)``, and seeds every sample's augmentation and
caption choice by its position in that stream. The stream is therefore a pure function of (seed, epoch, shard
list, world size, W), and micro-batch m of an epoch comes from stream ``m % W``.

Resume: a run resumed at step s of epoch e rebuilds the same streams and skips, without decoding, the samples
the steps before s used. It repeats the interrupted run's batches exactly as long as no image before the resume
point failed to decode (an undecodable image is replaced by the stream's next sample, which the skip, counting
samples with an image and a caption, does not know of) and the shards are unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import pandas as pd
from torch.utils.data import IterableDataset, get_worker_info

from clip_mini.data.images import ImageError
from clip_mini.data.mirror import maybe_flip, mirror_item
from clip_mini.data.readers import DataError
from clip_mini.data.steps import step_batches
from clip_mini.data.webdataset import Sample, SkipLog, decode_image, expand_shards, iter_shard, shard_identity_of

CAPTION_SAMPLE = 50_000   # captions read for the tokenizer and the truncation report (the stream has no table)


def plan_streams(n_micro: int, start: int, n_streams: int, micro: int) -> list[tuple[int, int]]:
    """Per stream w: (micro-batches to yield from ``start`` on, samples to skip), for micro-batches m % W == w."""
    out = []
    for w in range(n_streams):
        before = len(range(w, start, n_streams))
        out.append((len(range(w, n_micro, n_streams)) - before, before * micro))
    return out


def stream_shards(shards: Sequence[str], seed: int, epoch: int, rank: int, world: int, w: int, n_streams: int
                  ) -> list[str]:
    order = np.random.default_rng([seed, epoch]).permutation(len(shards))
    return [shards[i] for i in order[rank::world][w::n_streams]]


class ShardStream(IterableDataset):
    """Samples ``(pixels, caption, image_id)`` of one epoch for one rank; see the module docstring.

    ``micro``: stream samples per micro-batch. ``hflip_swap``: a sample is mirrored, image and caption, when the flip
    draw of its key says so; ``pairs``: each sample is followed by its mirrored copy (``clip_mini.data.mirror``), so a
    micro-batch holds ``2 * micro`` items.
    """

    def __init__(self, shards: Sequence[str], augment, seed: int, epoch: int, rank: int, world: int,
                 n_streams: int, plan: list[tuple[int, int]], first: int, micro: int, shuffle_buffer: int,
                 hflip_swap: bool = False, pairs: bool = False):
        self.shards, self.augment, self.seed, self.epoch = list(shards), augment, seed, epoch
        self.rank, self.world, self.n_streams, self.plan = rank, world, n_streams, plan
        self.first, self.micro, self.buffer = first, micro, max(1, shuffle_buffer)
        self.hflip_swap, self.pairs = hflip_swap, pairs

    def __iter__(self):
        info = get_worker_info()
        # DataLoader worker i serves stream (first + i) % W, so its round-robin starts at the resume point's stream
        w = (self.first + (info.id if info else 0)) % self.n_streams
        n_batches, skip = self.plan[w]
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, w])
        mine = stream_shards(self.shards, self.seed, self.epoch, self.rank, self.world, w, self.n_streams)
        log = SkipLog(f"train (rank {self.rank}, stream {w})")
        want, pos = n_batches * self.micro, skip
        samples = _shuffled(_cycle(mine, log), rng, self.buffer)
        for _ in range(skip):
            next(samples)
        while want > 0:
            s = next(samples)
            key = (self.seed, self.epoch, self.rank, w, pos)
            pos += 1
            try:
                img = decode_image(s, f"{s.shard}:{s.key}")
            except ImageError as e:
                log(s.shard, s.key, e.reason)
                continue   # the next sample takes its place
            self.augment.key = key
            want -= 1
            item = (self.augment(img), _caption(s, key), _sample_id(s))
            if self.hflip_swap:
                item = maybe_flip(item, key)
            yield item
            if self.pairs:
                yield mirror_item(item)


def _cycle(shards: list[str], log: SkipLog) -> Iterator[Sample]:
    while True:
        n = 0
        for url in shards:
            for s in iter_shard(url, log):
                n += 1
                yield s
        if n == 0:
            raise DataError(f"no usable sample in shards {shards[:3]}{' ...' if len(shards) > 3 else ''}")


def _shuffled(samples: Iterator[Sample], rng: np.random.Generator, size: int) -> Iterator[Sample]:
    buf = []
    for s in samples:
        if len(buf) < size:
            buf.append(s)
            continue
        j = int(rng.integers(size))
        buf[j], s = s, buf[j]
        yield s


def _caption(s: Sample, key: tuple) -> str:
    """The .txt caption, or one of the .json's ``captions`` (drawn per sample, as the folder path draws per epoch)."""
    caps = _json_captions(s)
    if len(caps) > 1:
        return caps[int(np.random.default_rng(key).integers(len(caps)))]
    return s.caption


def _json_captions(s: Sample) -> list[str]:
    try:
        caps = json.loads(s.meta)["captions"] if s.meta else []
    except (ValueError, KeyError, TypeError):
        return []
    return [c.strip() for c in caps if isinstance(c, str) and c.strip()] if isinstance(caps, list) else []


def _sample_id(s: Sample) -> int:
    return int.from_bytes(hashlib.blake2b(f"{s.shard}#{s.key}".encode(), digest_size=7).digest(), "little")


class WdsTrainInputs:
    """The WebDataset counterpart of ``train.inputs.TrainInputs`` (same ``loader`` and ``steps_per_epoch``)."""

    def __init__(self, shards: list[str], augment, collate, micro_batch: int, accum_freq: int, workers: int,
                 steps_per_epoch: int, seed: int, rank: int, world: int, shuffle_buffer: int,
                 hflip_swap: bool = False, pairs: bool = False):
        self.shards, self.augment, self.collate = shards, augment, collate
        self.hflip_swap, self.pairs = hflip_swap, pairs
        self.micro_batch, self.accum_freq, self.workers = micro_batch, accum_freq, workers
        self.steps_per_epoch, self.seed, self.rank, self.world = steps_per_epoch, seed, rank, world
        self.shuffle_buffer = shuffle_buffer
        self.n_streams = max(1, workers)
        if len(shards) < world * self.n_streams:
            raise DataError(f"{len(shards)} train shards cannot give {world} process(es) x {self.n_streams} loader "
                            "stream(s) disjoint shards: write smaller shards (clip-mini convert --shard-size) or "
                            "lower data.workers")

    def loader(self, epoch: int, start_step: int = 0) -> Iterator[list[dict]]:
        n_micro = self.steps_per_epoch * self.accum_freq
        first = start_step * self.accum_freq
        if first >= n_micro:
            return
        sources = self.micro_batch // 2 if self.pairs else self.micro_batch   # stream samples per micro-batch
        plan = plan_streams(n_micro, first, self.n_streams, sources)
        ds = ShardStream(self.shards, self.augment, self.seed, epoch, self.rank, self.world, self.n_streams, plan,
                         first % self.n_streams, sources, self.shuffle_buffer, self.hflip_swap, self.pairs)
        yield from step_batches(ds, self.collate, self.workers, epoch, self.accum_freq, batch_size=self.micro_batch)


# -- the tables the trainer needs beside the stream: a caption sample (tokenizer) and the validation split ----------
def wds_splits(data, report_dir: Optional[str | Path] = None, progress: bool = True) -> dict[str, pd.DataFrame]:
    """``{"train": caption sample, "val": table of extracted images}`` for ``data.format: webdataset``.

    The validation shards (``data.val_shards``, else the last of ``data.shards``) are unpacked once into the image
    cache folder (keyed by the shards' names, sizes and mtimes) so evaluation reads them like any image files.
    """
    train, val = split_shards(data)
    log = SkipLog("data (val)")
    val_df = _extract_val(val, data, log)
    rows, n = [], 0
    for url in train:
        for s in iter_shard(url, SkipLog("data (captions)", show=0), images=False):
            rows += [(f"{s.shard}#{s.key}", s.key, c, n) for c in _json_captions(s) or [s.caption]]
            n += 1
            if len(rows) >= CAPTION_SAMPLE:
                break
        if len(rows) >= CAPTION_SAMPLE:
            break
    if not rows:
        raise DataError(f"no usable sample in the train shards {data.shards!r}")
    if report_dir is not None and log.rows:
        log.write_csv(Path(report_dir) / "skipped_val.csv")
    print(f"data: webdataset, {len(train)} train shards, epoch = {data.samples} samples (data.samples); "
          f"val: {val_df['image_id'].nunique()} images from {len(val)} shards; the tokenizer and the truncation "
          f"report read the captions of the first {n} train samples")
    return {"train": pd.DataFrame(rows, columns=["path", "image", "caption", "image_id"]), "val": val_df}


def val_split(data, report_dir: Optional[str | Path] = None) -> pd.DataFrame:
    """The validation table alone (``wds_splits``'s "val": the same extracted images and captions, so ``clip-mini
    eval`` scores what the trainer's validation scored), without reading the train shards' captions."""
    _, val = split_shards(data)
    log = SkipLog("data (val)")
    df = _extract_val(val, data, log)
    if report_dir is not None and log.rows:
        log.write_csv(Path(report_dir) / "skipped_val.csv")
    return df


def split_shards(data) -> tuple[list[str], list[str]]:
    if not data.shards:
        raise DataError("data.format: webdataset needs data.shards (a tar path or brace pattern)")
    if not data.samples or data.samples < 1:
        raise DataError("data.format: webdataset needs data.samples, the epoch size in samples (a stream has no "
                        "length; clip-mini convert prints and stats.json records the count)")
    train = expand_shards(data.shards)
    if data.val_shards:
        val = expand_shards(data.val_shards)
    elif len(train) >= 2:
        train, val = train[:-1], train[-1:]
    else:
        raise DataError(f"{data.shards!r} is one shard: set data.val_shards, or write 2+ shards to hold one out")
    if set(train) & set(val):
        raise DataError("data.val_shards overlaps data.shards: validation images would be trained on")
    return train, val


def _extract_val(val: list[str], data, log: SkipLog) -> pd.DataFrame:
    from clip_mini.data.cache import default_cache_dir
    from clip_mini.fileio.atomic import atomic_dir

    ident = json.dumps([(u, *shard_identity_of(u)) for u in val])
    root = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    out = root / "wds-val" / hashlib.sha256(ident.encode()).hexdigest()[:20]
    table = out / "val.csv"
    if not table.is_file():
        with atomic_dir(out) as tmp:
            rows = []
            for url in val:
                for s in iter_shard(url, log):
                    name = f"{len(rows):07d}.{s.image_ext}"
                    (tmp / name).write_bytes(s.image)
                    for cap in _json_captions(s) or [s.caption]:
                        rows.append((name, f"{s.shard}#{s.key}", cap))
            if not rows:
                raise DataError(f"no usable sample in the validation shards {val[:3]}")
            pd.DataFrame(rows, columns=["file", "image", "caption"]).to_csv(tmp / "val.csv", index=False)
    df = pd.read_csv(table, dtype=str, keep_default_na=False)
    df["path"] = [os.path.join(out, f) for f in df["file"]]
    df["image_id"] = pd.factorize(df["path"])[0]
    return df[["path", "image", "caption", "image_id"]]
