"""Search latency over stored float16 embeddings: exact vs faiss, with faiss recall@10 and a bandwidth floor.

    python benchmarks/bench_search.py [--sizes 10000 100000 1000000] [--dim 128] [--repeats 7]

For each size N: clustered unit vectors (1000 centres plus noise, like real embeddings) are written as a float16
``.npy`` and memory-mapped, as ``EmbeddingIndex`` does. Queries are noisy copies of random rows. Reported per
back end: p50/p95 latency for 1 and 64 queries (warm page cache; p50 of ``repeats`` runs), build time for faiss,
faiss recall@10 against exact search, and the memory-bandwidth floor: the time to read the embedding matrix once
(any exact method must touch every byte). HNSW is skipped above 200k rows (its build alone would take minutes
on 2 cores); IVF covers the 1M case. Writes ``benchmarks/results/search.json``. On a shared machine run it with
``OPENBLAS_NUM_THREADS=1``: spin-waiting BLAS threads fighting other jobs for the cores distort small products.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clip_mini.search import build_faiss, exact_search, faiss_available, faiss_search  # noqa: E402

HNSW_MAX = 200_000


def clustered(n: int, dim: int, seed: int = 0, block: int = 100_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    out = np.empty((n, dim), np.float16)
    for s in range(0, n, block):
        m = min(block, n - s)
        x = centres[rng.integers(0, 1000, m)] + 0.8 * rng.standard_normal((m, dim)).astype(np.float32)
        out[s:s + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def latencies(fn, repeats: int) -> dict:
    fn()   # warm-up (page cache, BLAS threads)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"p50_ms": round(1000 * float(np.percentile(times, 50)), 3),
            "p95_ms": round(1000 * float(np.percentile(times, 95)), 3)}


def read_floor(emb: np.ndarray, repeats: int) -> dict:
    # Sum as uint64 words: vectorised integer adds, so the time is the memory read, not arithmetic.
    words = np.asarray(emb).reshape(-1).view(np.uint8)
    words = words[: len(words) // 8 * 8].view(np.uint64)
    lat = latencies(lambda: words.sum(), repeats)
    return {**lat, "gb_per_s": round(emb.nbytes / 1e9 / (lat["p50_ms"] / 1000), 2)}


def recall_at_10(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / exact.shape[1] for a, b in zip(approx, exact)]))


def bench_size(n: int, dim: int, repeats: int, tmp: Path) -> dict:
    path = tmp / f"emb-{n}.npy"
    np.save(path, clustered(n, dim))
    emb = np.load(path, mmap_mode="r")
    rng = np.random.default_rng(1)
    q = np.asarray(emb[rng.integers(0, n, 64)], np.float32) + 0.05 * rng.standard_normal((64, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    reps = max(3, repeats if n <= 100_000 else repeats // 2)
    out: dict = {"n": n, "dim": dim, "bytes": int(emb.nbytes), "read_floor": read_floor(emb, reps)}
    _, exact_ids = exact_search(emb, q, 10)
    out["exact"] = {"q1": latencies(lambda: exact_search(emb, q[:1], 10), reps),
                    "q64": latencies(lambda: exact_search(emb, q, 10), reps)}
    if not faiss_available():
        return out
    for kind in ("hnsw", "ivf"):
        if kind == "hnsw" and n > HNSW_MAX:
            out[kind] = {"skipped": f"build too slow above {HNSW_MAX} rows on this machine"}
            continue
        t = time.perf_counter()
        index = build_faiss(emb, kind)
        build_s = time.perf_counter() - t
        _, ids = faiss_search(index, q, 10)
        out[kind] = {"build_s": round(build_s, 2), "recall_at_10": round(recall_at_10(ids, exact_ids), 4),
                     "q1": latencies(lambda: faiss_search(index, q[:1], 10), reps),
                     "q64": latencies(lambda: faiss_search(index, q, 10), reps)}
        if kind == "ivf":
            out[kind].update(nlist=int(index.nlist), nprobe=int(index.nprobe))
        del index
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/search.json"))
    args = p.parse_args(argv)
    # The load average is recorded because a shared machine's other work distorts small timings badly (OpenBLAS
    # threads spin-waiting for a busy core can turn a 0.2 ms product into 15 ms).
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "numpy": np.__version__,
                          "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
                          "loadavg_start": os.getloadavg()[0]}, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="clip_mini_bench_") as tmp:
        for n in args.sizes:
            t = time.perf_counter()
            r = bench_size(n, args.dim, args.repeats, Path(tmp))
            r["bench_s"] = round(time.perf_counter() - t, 1)
            result["sizes"].append(r)
            print(json.dumps(r), flush=True)
    from clip_mini.io import atomic_write_json

    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
