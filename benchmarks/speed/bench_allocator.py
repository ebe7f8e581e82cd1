"""What keeping freed memory in the process gives (``clip_mini/runtime/allocator.py``, set by ``train.py`` and ``clip-mini``).

    python benchmarks/speed/bench_allocator.py [--rounds 3]

Each workload runs in fresh processes, alternately with glibc's default malloc (``plain``) and with
``keep_freed_memory()`` (``kept``), ``--rounds`` times each (a process-wide setting cannot be switched back within
one process, and other arms' freed memory would blur it). Per process: warm-up steps, then timed steps with the
page faults and kernel CPU seconds of each (``getrusage``), and the peak resident memory.

Workloads:
  clip_step    clip_mini's training step at open_clip's tiny-CLIP size, batch 128, bf16 autocast, eager
               (``bench_train.py``'s peer arm: forward, backward, clipping, AdamW)
  dinov2_pass  a gradient-free bf16 pass of a ViT-S/14 at 224 px, batch 64 (the DINOv2 tower's shape; timm's
               ``vit_small_patch14_dinov2`` with random weights, cast to bf16 as ``vision.inference_tower`` casts
               it): what indexing, evaluation and the frozen-feature pass run
  dinov2_step  a training step (forward, backward) of the same ViT, batch 32, bf16 autocast

Prints JSON and writes ``benchmarks/results/speed/allocator.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
WORKLOADS = ("clip_step", "dinov2_pass", "dinov2_step")
SHAPES = {"clip_step": {"batch": 128, "image_px": 64, "patch": 8},   # recorded with the results
          "dinov2_pass": {"batch": 64, "image_px": 224, "patch": 14},
          "dinov2_step": {"batch": 32, "image_px": 224, "patch": 14}}


def _workload(name: str):
    import torch

    if name == "clip_step":
        from benchmarks.speed.bench_train import _clip_mini_step

        return _clip_mini_step(SHAPES[name]["batch"])[0], 3, 8
    import timm

    batch, px = SHAPES[name]["batch"], SHAPES[name]["image_px"]
    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=px)
    if name == "dinov2_pass":
        model = model.eval().to(torch.bfloat16)
        x = torch.randn(batch, 3, px, px, dtype=torch.bfloat16)

        def step() -> None:
            with torch.inference_mode():
                model(x)
        return step, 2, 5
    x = torch.randn(batch, 3, px, px)

    def train_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
    return train_step, 2, 4


def worker(name: str, mode: str) -> dict:
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    if mode == "kept":
        from clip_mini.runtime.allocator import keep_freed_memory

        assert keep_freed_memory()
    step, warmup, steps = _workload(name)
    for _ in range(warmup):
        step()
    times, faults, kernel = [], [], []
    for _ in range(steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(r1.ru_minflt - r0.ru_minflt)
        kernel.append(r1.ru_stime - r0.ru_stime)
    return {"step_s": statistics.median(times), "page_faults_per_step": statistics.median(faults),
            "kernel_cpu_s_per_step": statistics.median(kernel),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/allocator.json"))
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return {}
    from benchmarks.lib.machine import machine_info, write_result

    result = {"machine": machine_info(), "rounds": args.rounds, "workloads": {}}
    runs: dict = {w: {"plain": [], "kept": []} for w in args.workloads}
    for _ in range(args.rounds):
        for w in args.workloads:
            for mode in ("plain", "kept"):
                out = subprocess.run([sys.executable, __file__, "--worker", w, mode], capture_output=True, text=True,
                                     check=True)
                runs[w][mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for w, modes in runs.items():
        r = {mode: {k: statistics.median(run[k] for run in rs) for k in rs[0]} | {"runs": rs}
             for mode, rs in modes.items()}
        r["speedup"] = r["plain"]["step_s"] / r["kept"]["step_s"]
        r.update(SHAPES[w])
        result["workloads"][w] = r
        print(f"{w}: {r['plain']['step_s']:.3f} s plain vs {r['kept']['step_s']:.3f} s kept ({r['speedup']:.2f}x); "
              f"page faults {r['plain']['page_faults_per_step']:.0f} vs {r['kept']['page_faults_per_step']:.0f} "
              f"a step", file=sys.stderr)
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
