"""``train.compile_tower``: a whole gradient-free tower pass, eager against ``torch.compile``, each in its own process.

    python benchmarks/speed/bench_compile.py [--towers vit effnet] [--pairs 3] [--batches 6] [--batch 64]

A frozen-feature pass runs one tower for thousands of batches and nothing else, so this times exactly that: a
fresh process builds the tower's bf16 inference copy (``vision.inference_tower``, random weights at 224 px as in
``bench_towers.py``), runs one untimed batch (for the compiled arm that is the compilation, timed apart as
``compile_s``), then ``--batches`` timed batches. Arms alternate process by process (eager, compiled, eager, ...),
``--pairs`` times, so a drift in the machine's speed hits both; medians of the per-process images/s are reported,
with the number of images after which the compilation has paid for itself. (``bench_towers.py`` times the same
compiled arm interleaved batch by batch with the others in one process, which is not how a pass runs.)

Writes ``benchmarks/results/speed/compile_noamx.json`` by default (measured on a CPU without AMX; pass ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402


def _one_pass(tower_name: str, compiled: bool, batches: int, batch: int) -> dict:
    import torch

    from benchmarks.speed.bench_towers import _encoder
    from clip_mini.model.vision import inference_tower, tower_input

    encoder, label = _encoder(tower_name)
    tower = inference_tower(encoder, "bf16")
    run = tower
    if compiled:
        from clip_mini.model.layers.compile_pass import CompiledPass

        run = CompiledPass(tower, "bench_compile")
    x = tower_input(tower, torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0)))
    with torch.inference_mode():
        t0 = time.perf_counter()
        run(x)
        first_s = time.perf_counter() - t0
        if compiled and run.state != "compiled":
            raise RuntimeError("torch.compile failed here (see the warning above)")
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - t0)
    return {"tower": label, "first_batch_s": first_s, "batch_s_all": times,
            "images_per_s": batch / statistics.median(times)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--towers", nargs="+", default=["vit", "effnet"], choices=["vit", "effnet"])
    p.add_argument("--pairs", type=int, default=3, help="eager/compiled process pairs per tower")
    p.add_argument("--batches", type=int, default=6, help="timed batches per process")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/compile_noamx.json"))
    p.add_argument("--child", nargs=2, metavar=("TOWER", "ARM"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_one_pass(args.child[0], args.child[1] == "compiled", args.batches, args.batch)))
        return {}
    from clip_mini.fileio.atomic import atomic_write_json

    result: dict = {"machine": machine_info(), "batch": args.batch, "batches": args.batches, "pairs": args.pairs,
                    "towers": {}}
    for name in args.towers:
        runs: dict[str, list] = {"eager": [], "compiled": []}
        for _ in range(args.pairs):
            for arm in runs:
                out = subprocess.run([sys.executable, __file__, "--child", name, arm, "--batches", str(args.batches),
                                      "--batch", str(args.batch)], capture_output=True, text=True, check=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"})
                runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
        eager = statistics.median(r["images_per_s"] for r in runs["eager"])
        compiled = statistics.median(r["images_per_s"] for r in runs["compiled"])
        # the compilation, beyond what an eager first batch costs, repaid at the per-image time saved
        compile_s = statistics.median(r["first_batch_s"] for r in runs["compiled"])
        extra_s = compile_s - statistics.median(r["first_batch_s"] for r in runs["eager"])
        saved = 1 / eager - 1 / compiled
        result["towers"][name] = {
            "tower": runs["eager"][0]["tower"], "eager_images_per_s": eager, "compiled_images_per_s": compiled,
            "speedup": compiled / eager, "compile_s": compile_s,
            "break_even_images": extra_s / saved if saved > 0 else None, "runs": runs}
        print(f"{name}: eager {eager:.1f} images/s, compiled {compiled:.1f} ({compiled / eager:.2f}x) after "
              f"{compile_s:.0f} s of compilation", file=sys.stderr)
    result["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
    atomic_write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "towers"} |
                     {"towers": {k: {m: v[m] for m in v if m != "runs"} for k, v in result["towers"].items()}},
                     indent=2))
    return result


if __name__ == "__main__":
    main()
