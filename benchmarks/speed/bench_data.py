"""Image pipeline throughput on the Flickr8k dev set: header check, fresh decode, cache cold vs warm.

    python benchmarks/speed/bench_data.py [--data ../shared/data/flickr8k] [--size 64] [--mode squash] [--limit N]

Prints JSON and writes ``benchmarks/results/speed/data.json``. Single process, one thread, so the numbers are per
core (a DataLoader with k workers scales roughly k-fold until the disk or memory bus saturates). "cold" is the
first epoch with an empty cache (decode + resize + store), "warm" every later epoch (read + transform). The
JPEG files themselves are in the OS page cache after the first pass in both cases, so the comparison isolates
decoding, not disk reads. "decode" is what the passes run (``load_image(min_size=size)``: a JPEG at least twice
the size on both sides decodes at reduced scale); "decode_read_ahead" the same in batches of 64 through
``ImageDataset.__getitems__`` (each batch's files read ahead on one helper thread, as indexing reads them);
"decode_full" decodes every pixel, as before reduced-scale decoding.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo  # noqa: E402


def _rate(fn, items) -> tuple[float, float]:
    start = time.perf_counter()
    for x in items:
        fn(x)
    secs = time.perf_counter() - start
    return len(items) / secs, secs


def bench_folder(captions: Path, size: int, mode: str, limit: int | None, repeats: int) -> dict:
    from clip_mini.config import DataConfig, PreprocessConfig
    from clip_mini.data import (ImageCache, ImageDataset, build_eval_transform, check_images, load_image,
                                load_table)

    df = load_table(DataConfig(captions=str(captions)), progress=False)
    paths = list(df["path"].unique())[:limit]
    transform = build_eval_transform(PreprocessConfig(image_size=size, resize_mode=mode))
    out = {"images": len(paths), "captions_file": relative_to_repo(captions)}
    for p in paths:   # warm the OS page cache so every variant reads files from memory
        Path(p).read_bytes()
    # Best of `repeats`, variants interleaved: the machine may be shared, and the best run of each variant is
    # the least disturbed one.
    runs: dict[str, list[float]] = {k: [] for k in ("header_check", "decode", "decode_read_ahead", "decode_full",
                                                      "cache_cold", "cache_warm", "cache_warm_get_only")}
    dataset = ImageDataset(paths, transform)
    batches = [list(range(i, min(i + 64, len(paths)))) for i in range(0, len(paths), 64)]
    for _ in range(repeats):
        runs["header_check"].append(_rate(lambda p: check_images([p]), paths)[0])
        runs["decode"].append(_rate(lambda p: transform(load_image(p, min_size=size)), paths)[0])
        # what indexing runs: a batch of 64 files read ahead on one helper thread (ImageDataset.__getitems__)
        runs["decode_read_ahead"].append(len(paths) / _rate(dataset.__getitems__, batches)[1])
        runs["decode_full"].append(_rate(lambda p: transform(load_image(p)), paths)[0])
        tmp = Path(tempfile.mkdtemp(prefix="clip_mini_bench_"))
        try:
            cold = ImageCache(tmp, size, mode)
            runs["cache_cold"].append(_rate(lambda p: transform(cold.get(p)), paths)[0])
            warm = ImageCache(tmp, size, mode)   # new instance: reads the index from disk, like a new process
            runs["cache_warm"].append(_rate(lambda p: transform(warm.get(p)), paths)[0])
            runs["cache_warm_get_only"].append(_rate(warm.get, paths)[0])
            assert warm.misses == 0 and warm.hits == 2 * len(paths), (warm.hits, warm.misses)
            out["cache_bytes"] = (cold.dir / "data.bin").stat().st_size
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    out.update({f"{k}_img_s": max(v) for k, v in runs.items()})
    out["warm_speedup"] = out["cache_warm_img_s"] / out["decode_img_s"]
    out["reduced_decode_speedup"] = out["decode_img_s"] / out["decode_full_img_s"]
    out["read_ahead_speedup"] = out["decode_read_ahead_img_s"] / out["decode_img_s"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared/data/flickr8k"))
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--mode", default="squash", choices=["squash", "center_crop"])
    p.add_argument("--limit", type=int, default=None, help="benchmark only the first N images")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; the best is reported")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/data.json"))
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    import cv2

    cv2.setNumThreads(1)
    data = Path(args.data)
    if not (data / "captions.csv").is_file():
        sys.exit(f"no Flickr8k dev set at {data} (expected captions.csv and images/)")
    result = {
        "benchmark": "data_pipeline",
        "settings": {"size": args.size, "mode": args.mode, "threads": 1, "limit": args.limit,
                     "repeats": args.repeats},
        "machine": machine_info(),   # its load average: other jobs skew the rates
        "dev_160px": bench_folder(data / "captions.csv", args.size, args.mode, args.limit, args.repeats),
    }
    if (data / "fullres/captions.csv").is_file():
        result["fullres"] = bench_folder(data / "fullres/captions.csv", args.size, args.mode, args.limit,
                                         args.repeats)
    from clip_mini.fileio.atomic import atomic_write_json

    atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
