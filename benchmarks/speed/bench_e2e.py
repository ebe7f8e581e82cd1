"""Where a real training run's minutes go: ``train.py`` end to end, one process, broken down by stage.

    python benchmarks/speed/bench_e2e.py [--runs tiny flickr8k]

* ``demo``: ``make demo``'s script (``scripts/demo.sh``: generate the shapes data if absent, train
  ``configs/tiny.yaml``, evaluate, index the 10,000 images, search, draw), timed whole; its training breakdown is
  the trainer's ``runs/tiny/summary.json``.
* ``flickr8k``: ``configs/flickr8k.yaml`` on ``../shared/data/flickr8k``, shortened to 1 augmented view and 1
  epoch so it fits a benchmark run (the full recipe's views and epochs scale the feature pass and the step time
  linearly; ``benchmarks/quality/quality_flickr8k.py`` runs it whole). Skipped when the data is absent.

The flickr8k run is a fresh ``train.py`` process in a temporary run directory; the trainer's own ``summary.json``
(``time_breakdown``: feature pass, steps, data wait, evaluation, checkpoints, other) is copied into the result, with
the process's wall time and the share of the step loop spent waiting for data (the target: under 5%).
Writes ``benchmarks/results/speed/e2e.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
FLICKR = ROOT.parent / "shared/data/flickr8k/captions.csv"


def breakdown(summary: dict) -> dict:
    times = summary["time_breakdown"]
    loop = times.get("steps_s", 0.0) + times.get("data_wait_s", 0.0)
    return {"steps": summary["step"], "epochs": summary["epoch"],
            "time_breakdown_s": {k.removesuffix("_s"): round(v, 1) for k, v in times.items()},
            "data_wait_share_of_step_loop": round(times.get("data_wait_s", 0.0) / loop, 4) if loop else None,
            "val": {k: round(v, 4) for k, v in (summary.get("val") or {}).items() if isinstance(v, float)}}


def timed(cmd: list[str], name: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return round(time.perf_counter() - start, 1)


def run_demo() -> dict:
    import shutil

    shutil.rmtree(ROOT / "runs/tiny", ignore_errors=True)   # the demo's own run: trained afresh, as a first demo
    summary = ROOT / "runs/tiny/summary.json"
    wall = timed(["bash", "scripts/demo.sh", str(Path(sys.executable).parent)], "demo")
    return {"command": "bash scripts/demo.sh (make demo)", "process_wall_s": wall,
            "training": breakdown(json.loads(summary.read_text()))}


def run_flickr8k(tmp: Path) -> dict:
    out = tmp / "flickr8k"
    overrides = [f"data.captions={FLICKR}", "train.frozen_features=1", "train.epochs=1", "train.budget=null"]
    cmd = [sys.executable, "train.py", "--config", "configs/flickr8k.yaml",
           *sum((["--set", o] for o in overrides), []), "--set", f"train.out_dir={out}"]
    wall = timed(cmd, "flickr8k")
    return {"config": "configs/flickr8k.yaml", "overrides": ["train.frozen_features=1", "train.epochs=1", "train.budget=null"],
            "process_wall_s": wall, **breakdown(json.loads((out / "summary.json").read_text()))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["demo", "flickr8k"], choices=["demo", "flickr8k"])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/e2e.json"))
    args = p.parse_args(argv)
    from clip_mini.fileio.atomic import atomic_write_json

    result = {"machine": machine_info(), "benchmark": "bench_e2e", "cpus": os.cpu_count(),
              "loadavg_start": os.getloadavg()[0], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="clip_mini_e2e_") as tmp:
        for name in args.runs:
            if name == "demo":
                result["runs"][name] = run_demo()
            elif FLICKR.is_file():
                result["runs"][name] = run_flickr8k(Path(tmp))
            else:
                result["runs"][name] = {"skipped": f"{FLICKR} not found"}
            print(json.dumps({name: result["runs"][name]}), flush=True)
    result["loadavg_end"] = os.getloadavg()[0]
    atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
