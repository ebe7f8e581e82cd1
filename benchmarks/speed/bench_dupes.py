"""``clip-mini dupes`` at scale: the faiss range search over a 1M-row float16 index, time and memory.

    python benchmarks/speed/bench_dupes.py [--rows 1000000] [--dim 256] [--dir /tmp]

Rows: float16, L2-normalised, clustered as in ``bench_index_10m.py`` (2,000 random centres plus noise), written
to a memory-mapped ``.npy`` like an index's embeddings; 1,000 of them (a tenth of the rows when fewer) are planted
near-copies of other rows (the row plus noise, cosine about 0.98). ``retrieval.dupes.find_duplicates`` (backend
faiss, ``DEFAULT_THRESHOLD``) runs over the memory map. Measured: seconds; peak anonymous memory (sampled every
20 ms: what the search allocates, not the map's page cache), with the anonymous memory held before the search and
the growth over it; the kernel's peak resident set (``VmHWM``, which counts the map's cached pages too); and the
recall of the planted pairs. The items table is not simulated. Writes ``benchmarks/results/speed/dupes.json``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402
from benchmarks.speed.bench_index_10m import _AnonPeak, _status, write_rows  # noqa: E402

PLANTED = 1000


def main(argv=None) -> dict:
    from clip_mini.retrieval.dupes import DEFAULT_THRESHOLD

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    ap.add_argument("--dir", default=None, help="folder for the temporary rows file (default: the system's)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/speed/dupes.json")
    args = ap.parse_args(argv)
    if args.rows < 20:
        ap.error(f"--rows must be at least 20, got {args.rows}")
    from clip_mini.retrieval.dupes import find_duplicates
    from clip_mini.retrieval.search import _faiss

    faiss = _faiss()   # imported before the baseline, so the search's own allocations are what grows
    machine = machine_info()   # the load before the work
    planted = min(PLANTED, args.rows // 10)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-dupes-") as tmp:
        path = Path(tmp) / "embeddings.npy"
        t = time.perf_counter()
        write_rows(path, args.rows, args.dim)
        mm = np.load(path, mmap_mode="r+")
        rng = np.random.default_rng(1)
        src = rng.choice(args.rows, planted, replace=False)
        dst = rng.choice(np.setdiff1d(np.arange(args.rows), src), planted, replace=False)
        noisy = np.asarray(mm[np.sort(src)], np.float32)
        order = np.argsort(src)
        noisy = noisy + rng.standard_normal(noisy.shape).astype(np.float32) * (0.2 / np.sqrt(args.dim))
        noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
        pairs = {(min(a, b), max(a, b)) for a, b in zip(np.sort(src), dst[order])}
        for row, d in zip(noisy, dst[order]):
            mm[d] = row.astype(np.float16)
        mm.flush()
        del mm, noisy
        setup_s = time.perf_counter() - t
        rows = np.load(path, mmap_mode="r")
        anon_before = round(_status()["RssAnon"] / 1024, 1)
        peak = _AnonPeak()
        t = time.perf_counter()
        groups = find_duplicates(rows, args.threshold, backend="faiss")
        seconds = time.perf_counter() - t
        peak_mb = peak.stop()
        hwm_mb = round(_status()["VmHWM"] / 1024, 1)
        found = {(a, b) for g in groups for i, a in enumerate(g.rows) for b in g.rows[i + 1:]}
    recall = len(found & pairs) / len(pairs)
    result = {"benchmark": "dupes", "rows": args.rows, "dim": args.dim, "threshold": args.threshold,
              "backend": "faiss", "planted_pairs": len(pairs), "planted_recall": round(recall, 4),
              "groups": len(groups), "pairs_found": len(found), "seconds": round(seconds, 1),
              "rows_per_second": round(args.rows / seconds), "setup_seconds": round(setup_s, 1),
              "peak_anon_mb": peak_mb, "anon_before_search_mb": anon_before,
              "search_anon_growth_mb": round(peak_mb - anon_before, 1), "peak_rss_mb": hwm_mb,
              "rows_file_mb": round(args.rows * args.dim * 2 / 2**20, 1),
              "faiss_threads": faiss.omp_get_max_threads(), "machine": machine}
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
