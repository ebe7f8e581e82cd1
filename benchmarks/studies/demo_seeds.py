"""The demo's position claim over training seeds and CPU paths: ``configs/tiny.yaml`` unchanged, one run per pair.

    python benchmarks/studies/demo_seeds.py [--seeds 0 1 2] [--isa native no-amx]

For each seed S (``train.seed=S``) and CPU path, trains ``configs/tiny.yaml`` on the generated shapes data
(``data/shapes``, 10,000 images, generated if absent) and, for the run's ``best/`` model, records what
``demo_pooling.py`` records: validation recall on the config's 300-image val split, and for the demo's first query,
"a large red circle on the left", over an index of all 10,000 images, how many of the top 16 show a large red
circle on the left (and a red circle of any size on the left, and a large red circle anywhere), read from the
generator's ``labels.csv``.

CPU paths: ``native`` (whatever oneDNN picks on this CPU) and ``no-amx`` (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``
in the environment of the training and measuring subprocesses, which keeps oneDNN off AMX tiles on a CPU that has
them and approximates a CPU with AVX512-BF16 but no AMX). oneDNN reads the variable once, at its first use, so each
path runs in its own processes; the ISA oneDNN reports for a bf16 matmul under that environment is recorded too.
Runs go seed by seed, both paths per seed, so a partial result is balanced; the JSON
(``benchmarks/results/studies/demo_seeds.json``) is written after each run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
from benchmarks.studies.demo_pooling import QUERY, ensure_shapes, query_hits  # noqa: E402

CONFIG = "configs/tiny.yaml"
ISA_ENV = {"native": {}, "no-amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}
# threads sleep at OpenMP barriers instead of spinning: on cores shared with other jobs a spinning thread burns the
# slice its sibling needs; the thread count and so the work split (and the numbers) are unchanged
SCHED_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
TARGET = 14   # issue 39: at least 14 of the top 16 in every seed, on both paths

# a bf16 matmul with oneDNN's verbose log on: its "cpu,isa:" line names the most capable ISA oneDNN will use
_ISA_PROBE = "import torch; x = torch.ones(64, 64, dtype=torch.bfloat16); torch.mm(x, x)"


def env_for(isa: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    return {**env, **SCHED_ENV, **ISA_ENV[isa], "PYTHONPATH": str(ROOT)}


def onednn_isa(isa: str) -> str | None:
    """The ISA oneDNN says it will use in a process with ``isa``'s environment (None if it logs none)."""
    env = {**env_for(isa), "ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", _ISA_PROBE], env=env, cwd=ROOT, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if ",cpu,isa:" in line:
            return line.split(",cpu,isa:", 1)[1].strip()
    return None


def measure(run: Path, seed: int, index_dir: Path) -> dict:
    """Val recall and the demo query's counts for ``run/best`` (called in a subprocess with the path's env)."""
    from clip_mini.eval.scoring import evaluate_retrieval

    val = evaluate_retrieval(run / "best", ROOT / CONFIG, split="val", overrides=[f"train.seed={seed}"],
                             progress=False)
    hits = query_hits(run / "best", ROOT / "data" / "shapes", index_dir)
    return {"val": {k: v for k, v in val.items() if k.startswith(("t2i", "i2t", "rsum"))}, "search": hits}


def one_run(seed: int, isa: str, out: Path) -> dict:
    name = f"seed{seed}-{isa}"
    run = out / name
    run.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "train.py", "--config", CONFIG, "--resume", "auto", "--set", f"train.seed={seed}",
           "--set", f"train.out_dir={run}"]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "a") as log:   # --resume auto: a finished run is not retrained
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env_for(isa))
    train_s = time.perf_counter() - t0
    probe = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", str(run), "--seed", str(seed),
                            "--index", str(out / f"index-{name}")],
                           check=True, cwd=ROOT, env=env_for(isa), capture_output=True, text=True)
    res = json.loads(probe.stdout.strip().splitlines()[-1])
    return {"seed": seed, "isa_path": isa, "env": {**SCHED_ENV, **ISA_ENV[isa]}, "onednn_isa_bf16": onednn_isa(isa),
            "command": " ".join([f"{k}={v}" for k, v in {**SCHED_ENV, **ISA_ENV[isa]}.items()] + ["python"] + cmd[1:]),
            "train_wall_s": round(train_s, 1), "load_avg_1m_after_train": round(os.getloadavg()[0], 2), **res}


def summarise(results: list) -> dict:
    def stats(values):
        v = sorted(values)
        n = len(v)
        med = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
        return {"median": med, "min": v[0], "max": v[-1], "n": n}

    return {"runs": len(results), "seeds": sorted({r["seed"] for r in results}),
            "isa_paths": sorted({r["isa_path"] for r in results}),
            "large_red_circle_on_left": stats([r["search"]["large_red_circle_on_left"] for r in results]),
            "red_circle_on_left": stats([r["search"]["red_circle_on_left"] for r in results]),
            "t2i_r1": stats([r["val"]["t2i_r1"] for r in results]),
            "target": TARGET,
            "runs_meeting_target": sum(r["search"]["large_red_circle_on_left"] >= TARGET for r in results)}


def _write(path: str, results: list) -> dict:
    """Write this invocation's runs, keeping runs of other (seed, path) pairs an earlier invocation recorded."""
    from benchmarks.lib.repo_paths import scrub_paths
    from clip_mini.fileio.atomic import atomic_write_json

    mine = {(r["seed"], r["isa_path"]) for r in results}
    if Path(path).is_file():
        earlier = [r for r in json.loads(Path(path).read_text()).get("results", [])
                   if (r["seed"], r["isa_path"]) not in mine]
        results = earlier + results
    results = sorted(results, key=lambda r: (r["seed"], list(ISA_ENV).index(r["isa_path"])))
    report = {"benchmark": "demo_seeds", "config": CONFIG, "data": "data/shapes (10,000 images, generator seed 0)",
              "query": QUERY, "k": 16, "machine": {**machine_info(), "load_average_1min_at_end": os.getloadavg()[0]},
              "summary": summarise(results), "results": results}
    report = scrub_paths(report)
    atomic_write_json(path, report)
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--isa", nargs="+", default=list(ISA_ENV), choices=list(ISA_ENV))
    ap.add_argument("--out", default=str(ROOT / "runs" / "demo_seeds"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "studies" / "demo_seeds.json"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)   # internal: measure one run in this process's env
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--index", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.seed, Path(args.index))), flush=True)
        return
    ensure_shapes(ROOT / "data" / "shapes")
    results = []
    for seed in args.seeds:
        for isa in args.isa:
            res = one_run(seed, isa, Path(args.out))
            print(json.dumps({k: res[k] for k in ("seed", "isa_path", "onednn_isa_bf16", "train_wall_s")}
                             | {"t2i_r1": res["val"]["t2i_r1"],
                                "large_red_circle_on_left": res["search"]["large_red_circle_on_left"],
                                "red_circle_on_left": res["search"]["red_circle_on_left"]}), flush=True)
            results.append(res)
            _write(args.results, results)
    print(json.dumps(_write(args.results, results)["summary"], indent=2))


if __name__ == "__main__":
    main()
