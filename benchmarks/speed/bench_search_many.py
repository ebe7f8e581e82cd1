"""Many queries at once: exact top-10 over 1M float16 rows against the fp32 compute floor, torch-free and with
torch loaded, every kernel forced and ``auto``, with the rows' int8 codes at hand (their sidecar, as ``clip-mini
index`` writes it: made once before the timed rounds, ``int8_codes_s``).

    python benchmarks/speed/bench_search_many.py [--rows 1000000] [--dim 256] [--queries 1 8 64] [--repeats 7]

The rows (clustered unit vectors, ``bench_search.clustered``) are written as a float16 ``.npy`` and memory-mapped,
as ``EmbeddingIndex`` stores them; queries are random unit vectors. For each query count ``m``:

* ``floor_ms``: the compute floor, ``m x rows x dim x 2`` FLOP at the fastest float32 matrix product measured in
  this run (``fp32_peak_gflops``: a warm 2048^3 product, best of several, numpy's BLAS in both processes and
  torch.mm in the torch one; measured again between the timed rounds, so a busy moment lowers no figure).
* ``torch_free`` (a fresh process that never imports torch, as a ``clip-mini search`` runs) and ``torch_loaded``
  (a server, a notebook): ``auto`` and each kernel forced (numpy, onnxruntime, faiss's scan, int8, torch where loaded),
  timed round-robin (one call of each per round, in an order rotated each round, so a change of load hits every
  arm alike): p50 / p95 of
  ``repeats`` rounds after a warm-up, ``x_floor`` (p50 over the floor), whether the ids equal the numpy kernel's
  (every kernel's rule: the float32 top-K of the rows as stored, ties by row id) and ``recall_at_10_by_score``
  against float32 brute force. ``kernel``: what ``auto`` chose; ``fastest_forced``; ``picked_vs_fastest`` (the
  p50 of the kernel auto chose, forced, over the fastest forced kernel's: 1 when auto chose the fastest; the default
  must be no slower than any kernel a user could name) and ``auto_vs_fastest`` (auto's own p50 over the same: the
  timing noise where auto chose the fastest).

Run it alone on the cores (``../shared/tools/cpu --timed``): other work in the same seconds moves every figure.
Writes ``benchmarks/results/speed/search_many_<cpu kind>.json`` (``clip_mini.runtime.isa.cpu_kind``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402

K = 10
TARGET_X_FLOOR = 1.5


def sgemm_peak(library: str, n: int = 2048, seconds: float = 0.6) -> float:
    """GFLOP/s of a warm n^3 float32 product (numpy's BLAS or torch.mm), the fastest within ``seconds``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    if library == "torch":
        import torch

        a, b = torch.from_numpy(a), torch.from_numpy(b)
        mm = torch.mm
    else:
        mm = np.matmul
    mm(a, b)
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def best_scores(rows, q: np.ndarray) -> np.ndarray:
    """(Q, 10) float32 brute force: each query's 10 best float32 scores, best first."""
    ref = np.full((len(q), K), -np.inf, np.float32)
    for s0 in range(0, len(rows), 65536):
        sims = np.asarray(rows[s0:s0 + 65536], np.float32) @ q.T   # (c, Q)
        top = np.partition(sims, max(len(sims) - K, 0), axis=0)[-K:].T
        ref = -np.sort(-np.concatenate([ref, top], 1), 1)[:, :K]
    return ref


def recall_by_scores(scores: np.ndarray, ref: np.ndarray) -> float:
    """The share of the true 10 best float32 scores the returned list reaches, rank by rank (tied rows are
    interchangeable)."""
    return float(np.mean(scores[:, :K] >= ref - 2e-6))


def arms(path: str, queries: list[int], repeats: int, torch_loaded: bool) -> dict:
    """Every kernel this process has, and ``auto``, per query count (see the module docstring)."""
    from clip_mini.retrieval import search as S
    from clip_mini.retrieval.search import codes, exact_int8, exact_ort, exact_search

    emb = np.load(path, mmap_mode="r")
    n, dim = emb.shape
    int8 = codes.ready(emb) and exact_int8.works(dim)   # the sidecar the parent process made
    signed = bool(exact_int8.signed(dim))   # its product: u8 x s8 (VNNI) or u8 x u8
    rng = np.random.default_rng(1)
    qr = rng.standard_normal((max(queries), dim)).astype(np.float32)
    qr /= np.linalg.norm(qr, axis=1, keepdims=True)
    kernels = ["numpy"] + (["onnxruntime"] if exact_ort.ort_available() else []) \
        + (["faiss"] if S.faiss_scan_available() else []) + (["int8"] if int8 else []) \
        + (["torch"] if torch_loaded else [])
    libraries = ["numpy"] + (["torch"] if torch_loaded else [])
    peaks = {lib: sgemm_peak(lib) for lib in libraries}
    out: dict = {}
    for m in queries:
        q = qr[:m]
        ref_ids = exact_search(emb, q, K, kernel="numpy")[1]
        ref = best_scores(emb, q)
        names = ["auto"] + kernels
        times: dict[str, list[float]] = {name: [] for name in names}
        checks = {}
        for name in names:   # warm-up, and each arm's answer checked once
            s, i = exact_search(emb, q, K, kernel=name)
            checks[name] = {"same_ids_as_numpy": bool((i == ref_ids).all()),
                            "recall_at_10_by_score": recall_by_scores(s, ref)}
        for r in range(repeats):
            # the arms in a rotated order each round: the first after the peak's product shares the cores with the
            # BLAS threads still spinning from it, and no arm is that one every round
            for name in names[r % len(names):] + names[:r % len(names)]:
                t = time.perf_counter()
                exact_search(emb, q, K, kernel=name)
                times[name].append(time.perf_counter() - t)
            for lib in libraries:   # a quiet moment between rounds raises the peak: the floor only gets stricter
                peaks[lib] = max(peaks[lib], sgemm_peak(lib, seconds=0.15))
        row = {"kernel": S.auto_kernel(n, m, True, int8=int8, int8_signed=signed)}
        for name in names:
            row[name] = {"p50_ms": round(1000 * float(np.percentile(times[name], 50)), 2),
                         "p95_ms": round(1000 * float(np.percentile(times[name], 95)), 2), **checks[name]}
        forced = min(kernels, key=lambda name: row[name]["p50_ms"])
        row["fastest_forced"] = forced
        row["auto_vs_fastest"] = round(row["auto"]["p50_ms"] / row[forced]["p50_ms"], 3)
        # the kernel auto picked, forced, against the fastest: 1 when auto picked it (auto_vs_fastest then times
        # the same kernel twice, and differs from 1 by the noise alone)
        row["picked_vs_fastest"] = round(row[row["kernel"]]["p50_ms"] / row[forced]["p50_ms"], 3)
        out[f"q{m}"] = row
    return {"arms": out, "fp32_peak_gflops": {lib: round(v, 1) for lib, v in peaks.items()},
            "torch_imported": "torch" in sys.modules, "int8_codes": int8, "int8_signed": signed}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--queries", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="default: benchmarks/results/speed/search_many_<cpu kind>.json")
    p.add_argument("--arm", metavar="NPY", help=argparse.SUPPRESS)   # internal: the torch-free process
    args = p.parse_args(argv)
    if args.arm:
        print(json.dumps(arms(args.arm, args.queries, args.repeats, torch_loaded=False)))
        return {}
    from benchmarks.speed.bench_search import clustered

    info = machine_info()
    out = args.out or str(ROOT / f"benchmarks/results/speed/search_many_{info['cpu_kind']}.json")
    result: dict = {"machine": {**info, "numpy": np.__version__}, "rows": args.rows, "dim": args.dim, "k": K,
                    "repeats": args.repeats, "target_x_floor": TARGET_X_FLOOR}
    with tempfile.TemporaryDirectory(prefix="clip_mini_bench_") as tmp:
        path = Path(tmp) / "emb.npy"
        np.save(path, clustered(args.rows, args.dim))
        from clip_mini.retrieval.search import codes

        t = time.perf_counter()
        made = codes.write_beside(path)   # the int8 sidecar, as ``clip-mini index`` writes it with the rows
        result["int8_codes_s"] = round(time.perf_counter() - t, 2)
        result["int8_row_error"], result["int8_code_norm"] = round(made.row_error, 5), round(made.code_norm, 5)
        del made
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, __file__, "--arm", str(path), "--repeats", str(args.repeats),
                            "--queries", *map(str, args.queries)], capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"the torch-free process failed:\n{r.stderr[-3000:]}")
        free = json.loads(r.stdout.strip().splitlines()[-1])
        assert not free["torch_imported"], "the torch-free process imported torch"
        import torch  # noqa: F401  (the torch-loaded arms: auto sees torch in sys.modules)

        result["machine"]["torch"] = torch.__version__
        result["machine"]["threads"] = torch.get_num_threads()
        loaded = arms(str(path), args.queries, args.repeats, torch_loaded=True)
    peaks = {"numpy_torch_free": free["fp32_peak_gflops"]["numpy"], **loaded["fp32_peak_gflops"]}
    best = max(peaks.values())
    result["fp32_peak_gflops"] = {**peaks, "best": best}
    result["floor_ms"] = {f"q{m}": round(1000 * 2 * m * args.rows * args.dim / (best * 1e9), 2) for m in args.queries}
    for name, part in (("torch_free", free), ("torch_loaded", loaded)):
        for key, row in part["arms"].items():
            for arm in row.values():
                if isinstance(arm, dict):
                    arm["x_floor"] = round(arm["p50_ms"] / result["floor_ms"][key], 3)
        result[name] = part["arms"]
    result["int8_codes"] = free["int8_codes"] and loaded["int8_codes"]
    result["int8_signed"] = free["int8_signed"]
    q = f"q{max(args.queries)}"
    result["meets_target"] = {name: result[name][q]["auto"]["x_floor"] <= TARGET_X_FLOOR
                              for name in ("torch_free", "torch_loaded")}
    return write_result(out, result)


if __name__ == "__main__":
    main()
