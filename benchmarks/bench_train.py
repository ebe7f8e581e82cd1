"""Speed of a full training step (both towers, loss, backward, AdamW) at the tiny and flickr8k configs.

    python benchmarks/bench_train.py [--steps 8] [--warmup 2] [--configs tiny flickr8k flickr8k-pixels]

``flickr8k`` trains on precomputed features of its locked image tower (``train.frozen_features``): its step is the
image head, the text tower and the loss, and the one-time pass over the images is timed separately;
``flickr8k-pixels`` is the same model running the tower at every step, for comparison.

For each config: real batches from the real loader (cache on, as in training), ``forward_backward`` + gradient
clipping + ``optimizer.step`` timed step by step. Reports pairs/s, the FLOPs of one step as counted by
``torch.utils.flop_counter`` (matrix products, convolutions and attention, forward and backward; AdamW's
element-wise work is not counted), the achieved GFLOP/s, and the fraction of the step time spent waiting for
the next batch. This machine's fp32 (and bf16) matmul peak is measured in the same run, so the achieved rate
can be read against it. Prints JSON and writes ``benchmarks/results/train.json``.

The tiny config reads ``data/shapes`` (generated into a temporary folder if absent); flickr8k reads
``../shared/data/flickr8k`` and is skipped when that is absent.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FLICKR8K = ROOT.parent / "shared/data/flickr8k/captions.csv"


def matmul_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 2.0) -> float:
    """GFLOP/s of a square matmul on this machine (best of repeated runs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def _config(name: str, tmp: Path):
    from clip_mini.config import load_config

    overrides = [f"train.out_dir={tmp / name}"]
    if name == "tiny":
        captions = ROOT / "data/shapes/captions.csv"
        if not captions.is_file():
            from clip_mini.data import generate

            captions = generate(tmp / "shapes", n=1500) / "captions.csv"
        overrides.append(f"data.captions={captions}")
    elif name.startswith("flickr8k"):
        if not FLICKR8K.is_file():
            return None
        overrides.append(f"data.captions={FLICKR8K}")
        if name == "flickr8k-pixels":   # the same model with the locked tower run at every step
            overrides.append("train.frozen_features=0")
    return load_config(ROOT / f"configs/{name.split('-')[0]}.yaml", overrides)


def bench_config(cfg, tmp: Path, steps: int, warmup: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from clip_mini.loss import ClipLoss
    from clip_mini.train.accum import FeatureModel, forward_backward
    from clip_mini.train.build import build_model, save_tokenizer
    from clip_mini.train.inputs import build_train_inputs, load_splits, make_image_cache
    from clip_mini.train.optim import build_optimizer, freeze_towers, set_train_mode

    t = cfg.train
    splits = load_splits(cfg, progress=False)
    save_tokenizer(cfg, splits["train"]["caption"].tolist(), tmp / "tokenizer")
    torch.manual_seed(0)
    model = build_model(cfg, tmp / "tokenizer")
    freeze_towers(model)
    optimizer = build_optimizer(model, t)
    features, loss_fn, device = FeatureModel(model), ClipLoss(), torch.device("cpu")
    cache = make_image_cache(cfg, model.preprocess, splits)
    feature_pass = None
    if t.frozen_features:
        inputs, feature_pass = _frozen_inputs(cfg, model, splits["train"], cache, device)
    else:
        inputs = build_train_inputs(cfg, splits["train"], model.preprocess, model.tokenizer,
                                    model.cfg.text.max_length, cache=cache)
    params = [p for p in model.parameters() if p.requires_grad]
    set_train_mode(model, True)

    def step(micro) -> None:
        forward_backward(features, micro, loss_fn, device, t.precision)
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    waits, totals, epoch = [], [], 0
    batches = iter(inputs.loader(epoch))
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        try:
            micro = next(batches)
        except StopIteration:
            epoch += 1
            batches = iter(inputs.loader(epoch))
            micro = next(batches)
        t1 = time.perf_counter()
        step(micro)
        if i >= warmup:
            waits.append(t1 - t0)
            totals.append(time.perf_counter() - t0)
    with FlopCounterMode(display=False) as counter:
        forward_backward(features, micro, loss_fn, device, t.precision)
    optimizer.zero_grad(set_to_none=True)
    flops = counter.get_total_flops()
    pairs = t.batch_size * t.accum_freq
    step_s = sum(totals) / len(totals)
    return {
        "image_tower": f"{cfg.model.vision.backbone} {cfg.model.vision.image_size}px"
                       + ("" if cfg.model.vision.trainable else " (frozen)"),
        "text_tower": cfg.model.text.pretrained or f"distilbert dim {cfg.model.text.dim}",
        "batch_pairs": pairs, "precision": t.precision, "threads": torch.get_num_threads(),
        "trainable_params": sum(p.numel() for p in params), "step_s": step_s, "pairs_per_s": pairs / step_s,
        "gflop_per_step": flops / 1e9, "achieved_gflops": flops / 1e9 / step_s,
        "data_wait_fraction": sum(waits) / sum(totals), "image_cache": cache is not None,
        "data_workers": cfg.data.workers, "frozen_features": t.frozen_features,
        "frozen_feature_pass": feature_pass, "steps_timed": len(totals),
    }


def _frozen_inputs(cfg, model, df, cache, device, images: int = 256):
    """Batches of precomputed tower features, and the images/s of the one-time pass that computes them.

    The step reads random rows of the right shape (what they hold does not change the step's cost); the one-time
    pass is timed on ``images`` real images through the tower, as ``train.frozen_features`` runs it.
    """
    from clip_mini.data import build_eval_transform
    from clip_mini.train import frozen as frozen_io

    n = df["image_id"].nunique()
    feats = torch.randn(cfg.train.frozen_features, n, model.visual.width)
    inputs = frozen_io.build_frozen_train_inputs(cfg, df, feats, torch.ones(n, dtype=torch.bool), model.tokenizer,
                                                 model.cfg.text.max_length)
    paths = frozen_io.split_paths(df)[:images]
    ds = frozen_io._ViewDataset(paths, build_eval_transform(model.preprocess), None, cache, cfg.train.seed)
    frozen_io.compute_view(model, ds, 0, 64, device, cfg.train.precision, cfg.data.workers, "warm-up")
    t0 = time.perf_counter()
    frozen_io.compute_view(model, ds, 0, cfg.train.eval_batch_size, device, cfg.train.precision, cfg.data.workers,
                           "feature pass")
    per_s = len(paths) / (time.perf_counter() - t0)
    return inputs, {"images_per_s": per_s, "images_timed": len(paths),
                    "train_split_pass_s": n * cfg.train.frozen_features / per_s}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=["tiny", "flickr8k", "flickr8k-pixels"],
                   help="flickr8k-pixels: configs/flickr8k.yaml with train.frozen_features=0")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    fp32, bf16 = matmul_peak(torch.float32), matmul_peak(torch.bfloat16)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "fp32_matmul_peak_gflops": fp32, "bf16_matmul_peak_gflops": bf16,
                          # other processes competing for the cores make every number here smaller
                          "load_average_1min_at_start": os.getloadavg()[0]},
              "configs": {}}
    for name in args.configs:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(name, Path(tmp))
            if cfg is None:
                result["configs"][name] = {"skipped": f"{FLICKR8K} not found"}
                continue
            r = bench_config(cfg, Path(tmp), args.steps, args.warmup)
            r["fraction_of_fp32_peak"] = r["achieved_gflops"] / fp32
            r["fraction_of_bf16_peak"] = r["achieved_gflops"] / bf16 if r["precision"] == "bf16" else None
            result["configs"][name] = r
        print(f"{name}: {r['pairs_per_s']:.0f} pairs/s, {r['achieved_gflops']:.0f} GFLOP/s "
              f"({r['fraction_of_fp32_peak']:.0%} of fp32 peak {fp32:.0f}), data wait {r['data_wait_fraction']:.0%}",
              file=sys.stderr)
    from clip_mini.io import atomic_write_json

    atomic_write_json(ROOT / "benchmarks/results/train.json", result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
