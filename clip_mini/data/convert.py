"""``clip-mini convert --to-webdataset``: a captions table (CSV/TSV, Flickr8k, COCO, or a config's split) to shards.

Each image becomes one sample ``KEY.<ext>`` (the file's own bytes, not re-encoded) + ``KEY.txt`` (its first
caption) + ``KEY.json`` (``{"image": name, "captions": [all of them]}``), as img2dataset lays samples out; keys
are 9-digit running numbers in the written order. Images are shuffled (seeded) before writing: a trainer's shuffle
buffer only mixes nearby samples, so a dataset sorted by source would otherwise give batches of one kind.
The output folder is written whole or not at all; ``stats.json`` beside the shards records the pattern and the
sample count (``data.samples`` for an epoch over every sample).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from clip_mini.data.readers import DataError


def convert_to_webdataset(df: pd.DataFrame, out: str | Path, shard_size: int = 1000, seed: Optional[int] = 0,
                          progress: bool = True) -> dict:
    """Write the images of a caption table (columns ``path``, ``image``, ``caption``) as WebDataset shards.

    Args:
        df: one row per caption (images with several captions have several rows).
        out: output folder (replaced atomically); shards are ``out/000000.tar``, ``out/000001.tar``, ...
        shard_size: samples per shard.
        seed: shuffle seed for the sample order; None keeps the table's order.

    Returns:
        ``{"pattern", "shards", "samples", "skipped"}`` (also written to ``out/stats.json``).

    Raises:
        DataError: an empty table or a bad shard size; an unreadable image is skipped and listed, not fatal.
    """
    from webdataset import TarWriter

    from clip_mini.fileio.atomic import atomic_dir, atomic_write_json

    if shard_size < 1:
        raise DataError(f"--shard-size must be >= 1, got {shard_size}")
    groups = list(df.groupby("path", sort=False))
    if not groups:
        raise DataError("nothing to convert: the caption table is empty")
    order = np.random.default_rng(seed).permutation(len(groups)) if seed is not None else np.arange(len(groups))
    n_shards = (len(groups) + shard_size - 1) // shard_size
    out, written, skipped = Path(out), 0, []
    with atomic_dir(out) as tmp:
        writer = None
        for i in _progress(order, progress):
            path, rows = groups[i]
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                skipped.append((path, e.strerror or str(e)))
                continue
            if written % shard_size == 0:
                if writer is not None:
                    writer.close()
                writer = TarWriter(str(tmp / f"{written // shard_size:06d}.tar"), encoder=False, mtime=0)
            ext = os.path.splitext(path)[1].lower().lstrip(".") or "jpg"
            caps = rows["caption"].astype(str).tolist()
            meta = {"image": str(rows["image"].iloc[0]), "captions": caps}
            writer.write({"__key__": f"{written:09d}", ext: data, "txt": caps[0].encode("utf-8"),
                          "json": json.dumps(meta, ensure_ascii=False).encode("utf-8")})
            written += 1
        if writer is not None:
            writer.close()
        if written == 0:
            raise DataError(f"none of the {len(groups)} images could be read (e.g. {skipped[0][0]}: {skipped[0][1]})")
        n_shards = (written + shard_size - 1) // shard_size
        stats = {"pattern": str(out / f"{{000000..{n_shards - 1:06d}}}.tar"), "shards": n_shards,
                 "samples": written, "skipped": [list(s) for s in skipped]}
        atomic_write_json(tmp / "stats.json", stats)
    return stats


def _progress(order, progress: bool):
    from tqdm import tqdm

    return tqdm(order, desc="writing shards", unit="img", disable=not progress)


def table_for(args) -> pd.DataFrame:
    """The caption table the ``convert`` arguments name: ``--captions FILE`` or ``--data CONFIG [--split S]``."""
    if args.captions is not None:
        from clip_mini.data.readers import read_captions

        df, _ = read_captions(args.captions, args.image_root, args.format)
        return df
    from clip_mini.config import load_config
    from clip_mini.data.dataset import load_splits

    cfg = load_config(args.data)
    splits = load_splits(cfg, report_dir=None, progress=False)
    if args.split is None:
        return pd.concat([splits[s] for s in ("train", "val", "test") if s in splits], ignore_index=True)
    if args.split not in splits or splits[args.split].empty:
        raise DataError(f"{args.data}: split {args.split!r} is empty (set data.val / data.test)")
    return splits[args.split]
