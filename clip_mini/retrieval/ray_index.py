"""``clip-mini index --shards PATTERN --ray [ADDRESS]``: the embedding pass of ``wds_source`` as a Ray Data pipeline.

    shards -> read (tasks: one shard each, samples with their offsets) -> decode + embed (an actor pool, one model
    per actor) -> the driver writes index parts -> ``wds_source.index_shards`` merges them into one generation

Without an address a local Ray instance is started (and stopped after); with one, the driver joins that cluster
and the workers must see the shard paths and the model directory at the same paths. Faults: Ray Data re-runs the
blocks of a task or actor that died (actors are restarted), and the driver keeps the first row of each (shard, key),
so a re-run block can neither duplicate nor lose a row. The driver's own death loses this pass (shards finished by
an earlier, non-Ray pass are kept). Needs ``pip install 'clip-mini[ray]'``.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import numpy as np

from clip_mini.retrieval.format import EmbeddingIndexError
from clip_mini.retrieval.wds_source import ROW_FIELDS, Parts, embed_images, empty_rows

_PART_ROWS = 4096   # rows per index part written by the driver


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise EmbeddingIndexError("--ray needs Ray: pip install 'clip-mini[ray]' (Ray Data and pyarrow, ~410 MB)") \
            from None
    return ray


def read_shard_rows(item: dict) -> list[dict]:
    """Ray read stage: one shard -> one row per sample (image bytes, offset, caption) or per skipped sample."""
    from clip_mini.data.webdataset import SkipLog, iter_shard, shard_identity_of

    url = item["shard"]
    size, mtime = shard_identity_of(url)
    log = SkipLog(show=0)
    rows = [{"shard": url, "size": size, "mtime_ns": mtime, "key": s.key, "caption": s.caption,
             "offset": s.offset, "length": len(s.image), "sha256": hashlib.sha256(s.image).hexdigest(),
             "image": s.image, "reason": ""} for s in iter_shard(url, log)]
    rows += [{"shard": sh, "size": size, "mtime_ns": mtime, "key": key, "caption": "", "offset": -1, "length": 0,
              "sha256": "", "image": b"", "reason": why} for sh, key, why in log.rows]
    return rows


class EmbedActor:
    """Ray actor: loads the model once, then decodes and embeds batches (rows with a reason pass through)."""

    def __init__(self, model_dir: str, precision: str, device: str = "auto"):
        import torch

        from clip_mini.embed import load
        from clip_mini.model.clip import ImageForward
        from clip_mini.runtime.devices import resolve_precision

        torch.set_num_threads(1)   # one core per actor: the pool, not threads, spreads the work
        self.embedder = load(model_dir, device=actor_device(device))
        # "auto" resolved here, for this actor's device: the driver may have no GPU, or another kind
        self.precision = resolve_precision(precision, self.embedder.device)
        self.forward = ImageForward(self.embedder.model, self.precision, self.embedder.device)

    def __call__(self, batch: dict) -> dict:
        n = len(batch["key"])
        todo = [i for i in range(n) if not batch["reason"][i]]
        feats, bad = embed_images(self.embedder, [batch["image"][i] for i in todo],
                                  [f"{batch['shard'][i]}:{batch['key'][i]}" for i in todo], self.forward)
        out = np.zeros((n, self.embedder.dim), np.float32)
        reason = [str(r) for r in batch["reason"]]
        ok = [i for j, i in enumerate(todo) if j not in bad]
        out[ok] = feats
        for j, why in bad.items():
            reason[todo[j]] = why
        keep = {f: batch[f] for f in ROW_FIELDS}
        return {**keep, "reason": np.array(reason, dtype=object), "embedding": out}


def actor_device(device: str) -> str:
    """An actor's device for the user's ``--device``: Ray gives a GPU actor its own GPU as ``cuda:0`` of its visible
    devices (``CUDA_VISIBLE_DEVICES``), so ``cuda:N`` names the kind, not the index."""
    return "cuda" if str(device).startswith("cuda") else str(device)


def actor_gpus(ray, device: str) -> int:
    """GPUs each embedding actor asks Ray for: 1 for ``--device cuda[:N]``, and for ``auto`` when the cluster has
    GPUs; else 0. Without a request Ray hides every GPU from the actor (or, with the variable unset, every actor
    lands on GPU 0)."""
    device = str(device)
    if device.startswith("cuda"):
        if not ray.cluster_resources().get("GPU", 0):
            raise EmbeddingIndexError(f"--device {device}: the Ray cluster has no GPU")
        return 1
    if device == "auto":
        return 1 if ray.cluster_resources().get("GPU", 0) else 0
    return 0


def embed_with_ray(pending: Sequence[str], parts: Parts, model_dir: str, workers: int, batch_size: int,
                   precision: str, progress: bool, part_rows: int = _PART_ROWS, device: str = "auto") -> int:
    """Run the pipeline over ``pending`` shards, writing a part per ``part_rows`` rows; returns the rows received.

    ``precision`` may be "auto" and ``device`` any ``--device``: each actor resolves both where it runs."""
    ray = _ray()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    ds = ray.data.from_items([{"shard": u} for u in pending], override_num_blocks=len(pending))
    ds = ds.flat_map(read_shard_rows)
    # Ray Data's actor pools restart a dead actor and retry its tasks by default (max_restarts=-1)
    ds = ds.map_batches(EmbedActor, fn_constructor_kwargs={"model_dir": str(model_dir), "precision": precision,
                                                           "device": str(device)},
                        compute=ray.data.ActorPoolStrategy(size=workers), batch_size=batch_size, num_cpus=1,
                        num_gpus=actor_gpus(ray, device), batch_format="numpy")
    rows, feats, skipped, seen, received = empty_rows(), [], {}, set(), 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for i in range(len(batch["key"])):
            received += 1
            name = f"{batch['shard'][i]}#{batch['key'][i]}"
            if name in seen:
                continue   # a re-run block's copy
            seen.add(name)
            if batch["reason"][i]:
                skipped[name] = str(batch["reason"][i])
                continue
            for f in ROW_FIELDS:
                v = batch[f][i]
                rows[f].append(v.item() if hasattr(v, "item") else str(v))
            feats.append(batch["embedding"][i])
        if len(rows["key"]) >= part_rows:
            parts.write(rows, np.stack(feats), [], skipped)
            rows, feats, skipped = empty_rows(), [], {}
    dim = parts.arrays[0].shape[1] if parts.arrays else 0
    emb = np.stack(feats) if feats else np.zeros((0, dim), np.float32)
    from clip_mini.data.webdataset import shard_identity_of

    parts.write(rows, emb, [(u, *shard_identity_of(u)) for u in pending], skipped)   # last: marks them done
    return received


def ray_embedder(model_dir: str, address: Optional[str], workers: int, batch_size: int, precision: str,
                 progress: bool, device: str = "auto") -> Callable[[Sequence[str], Parts], None]:
    """The ``embed`` argument of ``index_shards``: start (or join) Ray, run the pipeline, stop what it started."""
    ray = _ray()

    def run(pending: Sequence[str], parts: Parts) -> None:
        started = not ray.is_initialized()
        if started:
            if address is None:   # local: one CPU per actor plus one for the read tasks, a modest object store
                ray.init(num_cpus=workers + 1, object_store_memory=512 << 20, include_dashboard=False,
                         log_to_driver=progress)
            else:
                ray.init(address=address, log_to_driver=progress)
        try:
            embed_with_ray(pending, parts, model_dir, workers, batch_size, precision, progress, device=device)
        finally:
            if started:
                ray.shutdown()

    return run
