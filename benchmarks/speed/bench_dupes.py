"""``clip-mini dupes`` at scale: the faiss range search over a 1M-row float16 index, time and memory.

    python benchmarks/speed/bench_dupes.py [--rows 1000000] [--dim 256] [--dir /tmp]

Rows: float16, L2-normalised, clustered as in ``bench_index_10m.py`` (2,000 random centres plus noise), written
to a memory-mapped ``.npy`` like an index's embeddings; 1,000 of them are planted near-copies of other rows
(the row plus noise, cosine about 0.98). ``retrieval.dupes.find_duplicates`` (backend faiss) runs over the memory
map; measured: seconds, peak anonymous memory (sampled: what the search allocates, not the map's page cache), and
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
from benchmarks.speed.bench_index_10m import _AnonPeak, write_rows  # noqa: E402

PLANTED = 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--threshold", type=float, default=0.965)
    ap.add_argument("--dir", default=None, help="folder for the temporary rows file (default: the system's)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/speed/dupes.json")
    args = ap.parse_args()
    from clip_mini.retrieval.dupes import find_duplicates

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-dupes-") as tmp:
        path = Path(tmp) / "embeddings.npy"
        write_rows(path, args.rows, args.dim)
        mm = np.load(path, mmap_mode="r+")
        rng = np.random.default_rng(1)
        src = rng.choice(args.rows, PLANTED, replace=False)
        dst = rng.choice(np.setdiff1d(np.arange(args.rows), src), PLANTED, replace=False)
        noisy = np.asarray(mm[np.sort(src)], np.float32)
        order = np.argsort(src)
        noisy = noisy + rng.standard_normal(noisy.shape).astype(np.float32) * (0.2 / np.sqrt(args.dim))
        noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
        pairs = {(min(a, b), max(a, b)) for a, b in zip(np.sort(src), dst[order])}
        for row, d in zip(noisy, dst[order]):
            mm[d] = row.astype(np.float16)
        mm.flush()
        del mm
        rows = np.load(path, mmap_mode="r")
        peak = _AnonPeak()
        t = time.perf_counter()
        groups = find_duplicates(rows, args.threshold, backend="faiss")
        seconds = time.perf_counter() - t
        peak_mb = peak.stop()
        found = {(a, b) for g in groups for i, a in enumerate(g.rows) for b in g.rows[i + 1:]}
    recall = len(found & pairs) / len(pairs)
    result = {"benchmark": "dupes", "rows": args.rows, "dim": args.dim, "threshold": args.threshold,
              "planted_pairs": len(pairs), "planted_recall": round(recall, 4), "groups": len(groups),
              "pairs_found": len(found), "seconds": round(seconds, 1), "peak_anon_mb": peak_mb,
              "rows_file_mb": round(args.rows * args.dim * 2 / 2**20, 1), "machine": machine_info()}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
