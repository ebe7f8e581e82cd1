"""Indexing WebDataset shards: single process vs a local Ray Data pipeline with 1 and 2 embedding actors.

    python benchmarks/speed/bench_ray_index.py [--images ../shared/data/flickr8k/captions.csv] [--limit 2000]

Model: the ``configs/tiny.yaml`` architecture, untrained (speed does not depend on the weights). The same shards
(``--limit`` Flickr8k JPEGs, 100 per shard; generated shapes when Flickr8k is absent) are indexed by
``index_shards`` in this process, then by the Ray pipeline with 1 and 2 actors on a local Ray instance started
with one CPU per actor plus one for the read tasks. ``images_per_s`` times the index build (embedding pass,
merge, commit); for Ray it includes the actor start-up but not ``ray.init`` (reported apart as ``ray_init_s``).
Every Ray index is checked against the single-process one (same rows, max embedding difference reported).
Writes ``benchmarks/results/speed/ray_index.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo  # noqa: E402

FLICKR = ROOT.parent / "shared/data/flickr8k/captions.csv"


def make_shards(tmp: Path, captions: Path, limit: int) -> tuple[list[str], str]:
    from clip_mini.data.convert import convert_to_webdataset
    from clip_mini.data.readers import read_captions
    from clip_mini.data.webdataset import expand_shards

    if captions.is_file():
        df, _ = read_captions(captions)
        source = relative_to_repo(captions)
    else:
        from clip_mini.data.synthetic import generate

        df, _ = read_captions(generate(tmp / "shapes", n=limit, size=128) / "captions.csv")
        source = "generated shapes (128 px PNG)"
    df = df[df["path"].isin(df["path"].drop_duplicates().iloc[:limit])]
    stats = convert_to_webdataset(df, tmp / "wds", shard_size=100, progress=False)
    return expand_shards(stats["pattern"]), source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Path, default=FLICKR, help="captions file of the images to shard")
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    import ray

    import clip_mini
    from clip_mini.config import load_config
    from clip_mini.model.clip import CLIPModel
    from clip_mini.retrieval.ray_index import ray_embedder
    from clip_mini.retrieval.reader import IndexReader
    from clip_mini.retrieval.wds_source import index_shards

    out = {"machine": machine_info(), "loadavg_start": os.getloadavg()[0], "cpus": os.cpu_count(),
           "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards, out["source"] = make_shards(tmp, args.images, args.limit)
        model = tmp / "model"
        CLIPModel.build(load_config(ROOT / "configs/tiny.yaml").model, captions=["a photo"] * 8).save_pretrained(model)
        embedder = clip_mini.load(model)
        t0 = time.perf_counter()
        ref = index_shards(tmp / "single", embedder, shards, batch_size=args.batch_size, progress=False)
        sec = time.perf_counter() - t0
        n = len(ref)
        out.update(count=n, shards=len(shards),
                   single_process={"seconds": round(sec, 2), "images_per_s": round(n / sec, 1)})
        for workers in (1, 2):
            t0 = time.perf_counter()
            ray.init(num_cpus=workers + 1, object_store_memory=512 << 20, include_dashboard=False,
                     log_to_driver=False)
            init_s = time.perf_counter() - t0
            embed = ray_embedder(str(model), None, workers, args.batch_size, "fp32", progress=False)
            t0 = time.perf_counter()
            got = index_shards(tmp / f"ray{workers}", embedder, shards, batch_size=args.batch_size,
                               progress=False, embed=embed)
            sec = time.perf_counter() - t0
            ray.shutdown()
            a, b = IndexReader.load(got.path), IndexReader.load(ref.path)
            assert a.items == b.items, "the Ray index holds other rows than the single-process one"
            diff = float(np.abs(a.embeddings[:].astype(np.float32) - b.embeddings[:].astype(np.float32)).max())
            out[f"ray_{workers}_workers"] = {"seconds": round(sec, 2), "images_per_s": round(n / sec, 1),
                                             "ray_init_s": round(init_s, 1), "max_abs_diff_vs_single": diff}
    out["loadavg_end"] = os.getloadavg()[0]
    path = ROOT / "benchmarks/results/speed/ray_index.json"
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps(out, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
