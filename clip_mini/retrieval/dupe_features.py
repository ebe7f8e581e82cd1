"""Features for ``clip-mini dupes`` that see copies better than the search embedding: the image tower's own states.

The stored search embedding is trained to put a photo near its captions, so it also puts two photos of one scene
near each other, and a copy in a viewer's frame far from its original. ``dupes`` reads instead the image tower's
last patch states (``ImageEncoder.token_grid``; DINOv2's for the built-in ``photos`` model), from the picture at
``SCALE`` times the model's own input side (224 px for the 168 px ``photos`` model: a 16 x 16 grid of patches),
averaged over the middle ``CENTRE`` of each side of the grid (its 4 x 4 central patches). Each patch state has
attended to the whole picture, but what an edit adds or takes at the edges (a viewer's frame, a caption band, a
crop, the corners a turn cuts off) weighs little in the middle ones. One unit row of the tower's width per image:
384 values for a ViT-S, 768 bytes in float16. ``benchmarks/studies/dupes_planted.py`` measures it against the stored
embeddings and chose ``TOWER_THRESHOLD``; ``SCALE`` and ``CENTRE`` were chosen on a third planted set of photos,
disjoint from the study's held-out set (``benchmarks/studies/dupes_recipe.py``).

The rows are computed on demand, not at index time: from each row's image (its file, or its member of a shard),
checked against the sha256 the index recorded, by the index's model (or another: ``model_dir``), one tower pass
per image at ``SCALE`` times the indexing size (with ``photos`` on a 2-core CPU, 138-151 ms a photo: 1.8 to 1.9
times what indexing it took, in the study). They are cached in
``<index>/dupe-features/<model fingerprint>-<recipe>.npz`` keyed by content hash (64 bytes of hash beside each
row), so the next run, or a run after images were added, only computes what is new. A row whose image is gone,
unreadable, or changed since it was indexed is left out of the groups and reported (re-index to bring it back). A
cache that cannot be written (a read-only index) only costs the next run the same pass.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from clip_mini.fileio.atomic import atomic_path
from clip_mini.errors import OutputError
from clip_mini.retrieval.dupes import DEFAULT_MAX_PAIRS, DEFAULT_THRESHOLD, check_threshold, find_duplicates
from clip_mini.retrieval.dupe_groups import Linkage
from clip_mini.retrieval.format import EmbeddingIndexError

RECIPE = "size1.33-centre0.25-v1"   # in the cache's name: a change of what is computed never reads an old cache
SCALE = 4 / 3      # the picture's side, in the model's own input side (rounded to whole patches)
CENTRE = 0.25      # share of each side of the patch grid averaged (its middle)
# The planted-copy study (benchmarks/studies/dupes_planted.py) chose this on its tuning set with the built-in photos
# model; another model's tower spreads its rows differently and may want another (``--threshold``).
TOWER_THRESHOLD = 0.855
FEATURES = ("auto", "tower", "embedding")
CACHE_DIR = "dupe-features"
_BATCH = 32


def centre_rows(grid, share: float = CENTRE):
    """(B, h, w, D) states -> (B, D) float32 unit rows: the mean over the middle ``share`` of each side (at least
    one cell, centred; an odd remainder puts the extra cell after the centre)."""
    import torch

    _, h, w, _ = grid.shape
    ch, cw = max(1, round(h * share)), max(1, round(w * share))
    top, left = (h - ch) // 2, (w - cw) // 2
    pooled = grid[:, top:top + ch, left:left + cw].float().mean(dim=(1, 2))
    return torch.nn.functional.normalize(pooled, dim=-1)


def dupes_transform(model):
    """The model's eval transform at ``SCALE`` times its side (a ViT's rounded to whole patches)."""
    import dataclasses

    from clip_mini.data import build_eval_transform

    pre = model.preprocess
    side = pre.image_size * SCALE
    if model.cfg.vision.backbone == "vit":
        patch = model.cfg.vision.patch_size
        side = max(1, round(side / patch)) * patch
    return build_eval_transform(dataclasses.replace(pre, image_size=int(round(side))))


def cache_file(index_path: str | Path, fingerprint: str) -> Path:
    return Path(index_path) / CACHE_DIR / f"{fingerprint}-{RECIPE}.npz"


def read_cache(path: Path) -> dict[str, np.ndarray]:
    """``{sha256: row}`` from a cache file; {} when it is missing or damaged (its rows are computed again)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            hashes, rows = z["sha256"], z["features"]
        if hashes.ndim != 1 or rows.ndim != 2 or len(hashes) != len(rows):
            return {}
        return {h.decode("ascii"): r for h, r in zip(hashes.tolist(), rows)}
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        return {}


def write_cache(path: Path, rows: dict[str, np.ndarray]) -> None:
    hashes = sorted(rows)
    dim = len(next(iter(rows.values()))) if rows else 0
    feats = np.stack([rows[h] for h in hashes]).astype(np.float16) if rows else np.zeros((0, dim), np.float16)
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, sha256=np.array(hashes, dtype="S64"), features=feats)


@dataclass
class TowerFeatures:
    """Unit rows (float16) for the index rows ``rows``; ``left_out``: ``{index row: reason}``."""
    features: np.ndarray
    rows: np.ndarray
    left_out: dict[int, str] = field(default_factory=dict)
    computed: int = 0
    cached: int = 0
    seconds: float = 0.0          # the tower pass over the computed rows (reading and decoding included)
    cache: Optional[Path] = None  # None: the cache could not be written
    model_dir: str = ""


def _image_bytes(items: dict[str, list], rows: list[int]):
    """``(row, bytes or OSError/DataError)`` for each row, in order: the file (read ahead on a helper thread) or the
    shard member."""
    if "shard" in items:
        from clip_mini.data.readers import DataError
        from clip_mini.retrieval.wds_source import read_image

        for r in rows:
            try:
                yield r, read_image(items, r)
            except (DataError, OSError) as e:
                yield r, e
        return
    from clip_mini.data.images import DEFAULT_MAX_FILE_BYTES
    from clip_mini.fileio.bounded_read import read_files

    for r, (_, data) in zip(rows, read_files([items["path"][r] for r in rows], max_bytes=DEFAULT_MAX_FILE_BYTES)):
        yield r, data


def tower_features(index, model_dir: Optional[str | Path] = None, device: str = "auto", batch_size: int = _BATCH,
                   progress: bool = False) -> TowerFeatures:
    """The dupes rows of every index row whose image can still be read (see the module), cached beside the index.

    Raises:
        EmbeddingIndexError: no model (the index records none, or its directory is gone, and none is given).
        ModelDirError / WeightsError: the model cannot be loaded.
    """
    import time

    from clip_mini.embed import load

    model_dir = index._model_dir(model_dir)
    embedder = load(model_dir, device=device)
    path = cache_file(index.path, embedder.fingerprint or "unknown")
    cached = read_cache(path)
    items, n = index.items, len(index)
    hashes = items["sha256"]
    todo = [r for r in range(n) if hashes[r] not in cached]
    found: dict[str, np.ndarray] = {}
    left_out: dict[int, str] = {}
    t0 = time.perf_counter()
    if todo:
        found, left_out = _compute(embedder, items, todo, batch_size, progress)
    seconds = time.perf_counter() - t0
    rows = {h: cached[h] for h in set(hashes) if h in cached}
    rows.update(found)
    keep = np.array([r for r in range(n) if hashes[r] in rows], dtype=np.int64)
    dim = embedder.model.visual.trunk.num_features
    feats = (np.stack([rows[hashes[r]] for r in keep]).astype(np.float16) if len(keep)
             else np.zeros((0, dim), np.float16))
    out_path: Optional[Path] = path
    if found or len(rows) != len(cached):   # new rows, or rows of images no longer indexed to drop
        try:
            write_cache(path, rows)
        except (OutputError, OSError) as e:
            out_path = None
            if progress:
                print(f"dupes: cannot cache the tower features in {path.parent} ({e}); the next run computes them "
                      "again", file=sys.stderr)
    return TowerFeatures(feats, keep, left_out, computed=len(todo) - len(left_out), cached=n - len(todo),
                         seconds=seconds, cache=out_path, model_dir=str(model_dir))


def _compute(embedder, items: dict[str, list], todo: list[int], batch_size: int, progress: bool
             ) -> tuple[dict[str, np.ndarray], dict[int, str]]:
    """Tower rows for the images of rows ``todo`` (one per distinct content), and the rows left out, with why."""
    import torch
    from tqdm import tqdm

    from clip_mini.data import ImageError
    from clip_mini.data.images import load_image_bytes
    from clip_mini.runtime.precision import autocast

    hashes = items["sha256"]
    first: dict[str, int] = {}
    for r in todo:
        first.setdefault(hashes[r], r)   # identical files are read and embedded once
    transform = dupes_transform(embedder.model)
    visual = embedder.model.visual
    found: dict[str, np.ndarray] = {}
    bad: dict[str, str] = {}
    batch: list[tuple[str, object]] = []

    def flush():
        if not batch:
            return
        pixels = torch.stack([p for _, p in batch]).to(embedder.device)
        with torch.inference_mode(), autocast(embedder.device, embedder.precision):
            feats = centre_rows(visual.token_grid(pixels)).cpu().numpy()
        found.update((h, f.astype(np.float16)) for (h, _), f in zip(batch, feats))
        batch.clear()

    with tqdm(total=len(first), desc="dupes: tower features", unit="img", disable=not progress) as bar:
        for r, data in _image_bytes(items, list(first.values())):
            h = hashes[r]
            if not isinstance(data, (bytes, bytearray)):
                bad[h] = f"cannot read: {getattr(data, 'strerror', None) or data}"
            elif hashlib.sha256(data).hexdigest() != h:
                bad[h] = "changed since it was indexed (re-index it)"
            else:
                try:
                    batch.append((h, transform(load_image_bytes(data, items["path"][r],
                                                                min_size=transform.base[0]))))
                except ImageError as e:
                    bad[h] = getattr(e, "reason", str(e))
            if len(batch) >= batch_size:
                flush()
            bar.update()
        flush()
    return found, {r: bad[hashes[r]] for r in todo if hashes[r] in bad}


@dataclass
class Dupes:
    """What ``index_dupes`` found: ``groups`` as ``{"paths", "rows", "similarity", "lowest"}`` (index rows), the
    ``features`` grouped ("tower" or "embedding"), the ``threshold`` used, and the tower pass's report."""
    groups: list[dict]
    features: str
    threshold: float
    tower: Optional[TowerFeatures] = None
    note: str = ""


def index_dupes(index, threshold: Optional[float] = None, features: str = "auto", backend: str = "auto",
                progress: bool = False, linkage: Linkage = "single", max_pairs: int = DEFAULT_MAX_PAIRS,
                model_dir: Optional[str | Path] = None, device: str = "auto") -> Dupes:
    """Near-duplicate groups of an index (``dupes.find_duplicates`` on the chosen rows).

    ``features``: "tower" (the rows of this module, ``TOWER_THRESHOLD`` by default), "embedding" (the stored search
    rows, ``dupes.DEFAULT_THRESHOLD`` by default, nothing read but the index) or "auto": the tower when the model
    is at hand (the index's own, or ``model_dir``), else the stored rows, with a ``note`` saying why.

    Raises:
        EmbeddingIndexError: an unknown ``features``, "tower" without a model, or ``find_duplicates``' errors.
    """
    if features not in FEATURES:
        raise EmbeddingIndexError(f"unknown dupes features {features!r} (use {', '.join(FEATURES)})")
    if threshold is not None:
        threshold = check_threshold(threshold)
    note = ""
    if features == "auto":
        try:
            index._model_dir(model_dir)
            features = "tower"
        except EmbeddingIndexError as e:
            features = "embedding"
            note = (f"grouping the stored search embeddings, which miss more copies than the image tower's features "
                    f"(those need the model: {e})")
    if features == "embedding":
        th = DEFAULT_THRESHOLD if threshold is None else threshold
        groups = find_duplicates(index.embeddings, th, backend, progress, linkage, max_pairs)
        rows = np.arange(len(index))
        tower = None
    else:
        th = TOWER_THRESHOLD if threshold is None else threshold
        tower = tower_features(index, model_dir, device=device, progress=progress)
        groups = find_duplicates(tower.features, th, backend, progress, linkage, max_pairs)
        rows = tower.rows
    paths = index.items["path"]
    out = []
    for g in groups:
        ids = [int(rows[r]) for r in g.rows]
        out.append({"paths": [paths[r] for r in ids], "rows": ids, "similarity": g.similarity, "lowest": g.lowest})
    return Dupes(out, features, th, tower, note)
