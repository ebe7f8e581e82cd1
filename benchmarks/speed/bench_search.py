"""Search latency over stored float16 embeddings: exact kernels against the memory floor, and faiss.

Arms for the torch-free kernels: ``exact_faiss`` (faiss's scalar-quantizer scan over the stored
rows, torch loaded), ``exact_auto_torch_loaded`` (what ``auto`` picks per query count, and its time),
``torch_free`` (a fresh process that never imports torch: its own read floor, the faiss, onnxruntime and numpy
kernels and ``auto``), each with ``x_read_floor`` and ``recall_at_10_by_score`` (the returned scores against
float32 brute force, rank by rank: tied rows are interchangeable); ``cold_cli``: a cold ``clip-mini search``
on a generated ``--cold-rows`` index, everything included (target 0.5 s at 1M rows). With torch arms on the
no-AMX path: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ... --out benchmarks/results/speed/search_avx512bf16.json``.

    python benchmarks/speed/bench_search.py [--sizes 10000 100000 1000000] [--dim 256] [--repeats 7]

For each size N: clustered unit vectors (1000 centres plus noise) are written as a float16 ``.npy`` and
memory-mapped, as ``EmbeddingIndex`` does. Queries are random unit vectors. Reported (warm page cache; p50 of
``repeats`` runs): the memory-bandwidth floor (the time to read the matrix once: any exact method must touch every
byte); ``exact_search`` with its numpy kernel (what a one-shot CLI query uses) and its torch kernel (approximate
pass + exact re-scoring), for 1 and 64 queries, with recall@10 of the torch kernel against the numpy float32
brute force; and the fused options the torch kernel was chosen from (``options``): torch's fp16 matrix-vector
product, the same over a bfloat16 copy (bf16 storage), and a bf16 matrix product for 64 queries: of float16 chunks
converted by torch (float16 -> float32 -> bfloat16), or of float32 chunks that oneDNN rounds to bf16 inside the
product (``torch_kernel_rounds_in_onednn``: what the torch kernel does on this CPU);
``exact_torch_bf16_rows``: ``exact_search`` over the same rows stored as bfloat16 (``index --dtype bfloat16``),
against its own read floor, with recall@10 against float32 brute force over the rows as stored and against the
float16 rows' top 10 (what rounding to bf16 moves). faiss here uses
near-copies of stored rows as queries, which flatters it: ``bench_ann_real.py`` measures approximate search on
text-like queries. HNSW is skipped above 200k rows (its build alone takes minutes on 2 cores).
Writes ``benchmarks/results/speed/search.json`` (``--out`` elsewhere: the README's rows for a CPU without AMX come from
``--out benchmarks/results/speed/search_noamx.json``). On a shared machine run it with ``OPENBLAS_NUM_THREADS=1``:
spin-waiting BLAS threads fighting other jobs for the cores distort small products.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402

from clip_mini.retrieval import search as S  # noqa: E402
from clip_mini.retrieval.rows import BF16Rows, encode  # noqa: E402
from clip_mini.retrieval.search import build_faiss, exact_search, faiss_available, faiss_search  # noqa: E402
from clip_mini.retrieval.search import exact_torch  # noqa: E402

HNSW_MAX = 200_000
NO_ANN = False


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


def _words(emb) -> np.ndarray:
    # Summed as uint64 words: vectorised integer adds, so the time is the memory read, not arithmetic.
    words = np.asarray(emb).reshape(-1).view(np.uint8)
    return words[: len(words) // 8 * 8].view(np.uint64)


def read_floor(emb: np.ndarray, repeats: int) -> dict:
    words = _words(emb)
    lat = latencies(lambda: words.sum(), repeats)
    return {**lat, "gb_per_s": round(emb.nbytes / 1e9 / (lat["p50_ms"] / 1000), 2)}


def vs_floor(fn, emb, repeats: int) -> dict:
    """fn's latency and its ratio to the read floor, the two timed alternately round by round: on a shared machine
    the load moves between rounds, and a ratio of medians taken minutes apart would move with it. ``x_read_floor``
    is the median of the per-round ratios."""
    words = _words(emb)
    fn(), words.sum()   # warm-up (page cache, thread pools)
    t_fn, t_floor = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        words.sum()
        t_floor.append(time.perf_counter() - t)
        t = time.perf_counter()
        fn()
        t_fn.append(time.perf_counter() - t)
    return {"p50_ms": round(1000 * float(np.percentile(t_fn, 50)), 3),
            "p95_ms": round(1000 * float(np.percentile(t_fn, 95)), 3),
            "floor_p50_ms": round(1000 * float(np.percentile(t_floor, 50)), 3),
            "x_read_floor": round(float(np.median(np.array(t_fn) / np.array(t_floor))), 3)}


def recall_at_10(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / exact.shape[1] for a, b in zip(approx, exact)]))


def recall_by_scores(rows, q: np.ndarray, scores: np.ndarray, k: int = 10) -> float:
    """recall@k against float32 brute force, by score rather than id (rows with equal scores are interchangeable):
    the share of the true k best scores that the returned list reaches, rank by rank, within float32 rounding."""
    ref = np.empty((len(q), k), np.float32)
    for s0 in range(0, len(q), 16):
        sims = np.asarray(rows, np.float32) @ q[s0:s0 + 16].T   # (N, 16) float32 brute force
        ref[s0:s0 + 16] = -np.sort(-np.partition(sims, len(sims) - k, axis=0)[-k:], axis=0).T
    return float(np.mean(scores[:, :k] >= ref - 2e-6))


def torch_free_arm(path: str, repeats: int) -> dict:
    """The kernels a process without torch has (a cold ``clip-mini search``, a script): run in a fresh process
    (``--torch-free-arm``) so that nothing here has imported torch."""
    emb = np.load(path, mmap_mode="r")
    n, dim = emb.shape
    rng = np.random.default_rng(1)
    qr = rng.standard_normal((64, dim)).astype(np.float32)
    qr /= np.linalg.norm(qr, axis=1, keepdims=True)
    out: dict = {"read_floor": read_floor(emb, repeats)}
    for kernel, counts in (("faiss", (1, 2, 4, 16)), ("onnxruntime", (1, 4, 16, 64)), ("numpy", (1, 64)),
                           ("auto", (1, 4, 16, 64))):
        if kernel == "faiss" and not S.faiss_scan_available():
            continue
        arm = out[f"exact_{kernel}"] = {}
        for m in counts:
            r = arm[f"q{m}"] = vs_floor(lambda: exact_search(emb, qr[:m], 10, kernel=kernel), emb, repeats)
            if kernel == "auto":
                r["kernel"] = S.auto_kernel(n, m, True)
            if kernel in ("auto", "onnxruntime", "faiss"):
                r["recall_at_10_by_score"] = recall_by_scores(
                    emb, qr[:m], exact_search(emb, qr[:m], 10, kernel=kernel)[0])
    out["torch_imported"] = "torch" in sys.modules
    return out


def fused_options(emb: np.ndarray, q: np.ndarray, repeats: int) -> dict:
    """The kernels the torch exact path was chosen from, each over the whole matrix (no re-scoring)."""
    import torch

    E = torch.from_numpy(np.asarray(emb).view(np.int16)).view(torch.float16)
    qh, qb = torch.from_numpy(q).half(), torch.from_numpy(q).bfloat16()
    Eb = E.bfloat16()   # bf16 storage: what a bfloat16 embeddings file would hold
    chunk = 4096

    def bf16_via_fp32():
        for s in range(0, len(E), chunk):
            E[s:s + chunk].float().bfloat16() @ qb.T

    f32, qT = torch.empty(16384, E.shape[1]), torch.from_numpy(q).T.contiguous()

    def fp32_rounded_by_onednn():   # float16 -> float32 chunks; oneDNN rounds them to bf16 inside the product
        for s in range(0, len(E), len(f32)):
            c = min(len(f32), len(E) - s)
            f32[:c].copy_(E[s:s + c]) @ qT

    with torch.inference_mode():
        out = {"fp16_mv_q1": latencies(lambda: torch.mv(E, qh[0]), repeats),
               "bf16_storage_mv_q1": latencies(lambda: torch.mv(Eb, qb[0]), repeats),
               "bf16_storage_mm_q64": latencies(lambda: Eb @ qb.T, repeats),
               "fp16_to_bf16_chunks_mm_q64": latencies(bf16_via_fp32, repeats)}
        if exact_torch._implicit_bf16(torch):
            with exact_torch._matmul_precision(torch, "bf16"):
                out["fp16_to_fp32_chunks_onednn_bf16_mm_q64"] = latencies(fp32_rounded_by_onednn, repeats)
    out["torch_kernel_rounds_in_onednn"] = exact_torch._implicit_bf16(torch)
    return out


def bench_size(n: int, dim: int, repeats: int, tmp: Path) -> dict:
    path = tmp / f"emb-{n}.npy"
    np.save(path, clustered(n, dim))
    emb = np.load(path, mmap_mode="r")
    rng = np.random.default_rng(1)
    qr = rng.standard_normal((64, dim)).astype(np.float32)
    qr /= np.linalg.norm(qr, axis=1, keepdims=True)
    reps = max(3, repeats)   # every size: a median of 3 at 1M moved by 50% between runs
    out: dict = {"n": n, "dim": dim, "bytes": int(emb.nbytes), "read_floor": read_floor(emb, reps)}
    ref = {m: exact_search(emb, qr[:m], 10, kernel="numpy")[1] for m in (1, 64)}
    out["exact_numpy"] = {f"q{m}": latencies(lambda: exact_search(emb, qr[:m], 10, kernel="numpy"), reps)
                          for m in (1, 64)}
    out["exact_torch"] = {f"q{m}": {**latencies(lambda: exact_search(emb, qr[:m], 10, kernel="torch"), reps),
                                    "recall_at_10": recall_at_10(exact_search(emb, qr[:m], 10, kernel="torch")[1],
                                                                 ref[m])} for m in (1, 64)}
    floor = out["read_floor"]["p50_ms"]
    out["exact_torch"]["q1"].update(vs_floor(lambda: exact_search(emb, qr[:1], 10, kernel="torch"), emb, reps))
    if S.faiss_scan_available():   # the faiss scan in this process, torch loaded
        out["exact_faiss"] = {}
        for m in (1, 2, 4, 16):
            r = out["exact_faiss"][f"q{m}"] = vs_floor(lambda: exact_search(emb, qr[:m], 10, kernel="faiss"), emb,
                                                       reps)
            r["recall_at_10_by_score"] = recall_by_scores(emb, qr[:m], exact_search(emb, qr[:m], 10,
                                                                                     kernel="faiss")[0])
    out["exact_auto_torch_loaded"] = {}
    for m in (1, 4, 16, 64):
        r = out["exact_auto_torch_loaded"][f"q{m}"] = vs_floor(lambda: exact_search(emb, qr[:m], 10), emb, reps)
        r.update(kernel=S.auto_kernel(n, m, True),
                 recall_at_10_by_score=recall_by_scores(emb, qr[:m], exact_search(emb, qr[:m], 10)[0]))
    # a fresh process that never imports torch
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, __file__, "--torch-free-arm", str(path), "--repeats", str(reps)],
                       capture_output=True, text=True, env=env, check=True)
    out["torch_free"] = json.loads(r.stdout.strip().splitlines()[-1])
    out["exact_numpy"]["q1"]["x_read_floor"] = round(out["exact_numpy"]["q1"]["p50_ms"] / floor, 2)   # slow: once
    # the same rows stored as bfloat16 (clip-mini index --dtype bfloat16): exact_search over a BF16Rows memory map
    bpath = tmp / f"emb-{n}-bf16.npy"
    np.save(bpath, encode(emb, "bfloat16"))
    bemb = BF16Rows(np.load(bpath, mmap_mode="r"))
    floor_b = read_floor(bemb.bits, reps)
    stored_ref = {m: exact_search(bemb, qr[:m], 10, kernel="numpy")[1] for m in (1, 64)}
    out["exact_torch_bf16_rows"] = {
        f"q{m}": {**latencies(lambda: exact_search(bemb, qr[:m], 10, kernel="torch"), reps),
                  # against float32 brute force over the rows as stored (bf16), and over the float16 rows
                  "recall_at_10": recall_at_10(exact_search(bemb, qr[:m], 10, kernel="torch")[1], stored_ref[m]),
                  "recall_at_10_vs_float16_rows": recall_at_10(stored_ref[m], ref[m])} for m in (1, 64)}
    out["exact_torch_bf16_rows"]["read_floor"] = floor_b
    out["exact_torch_bf16_rows"]["q1"]["x_read_floor"] = round(
        out["exact_torch_bf16_rows"]["q1"]["p50_ms"] / floor_b["p50_ms"], 2)
    bpath.unlink()
    del bemb
    out["options"] = fused_options(emb, qr, reps)
    # faiss with near-copies of stored rows as queries (noise 0.05)
    q = np.asarray(emb[rng.integers(0, n, 64)], np.float32) + 0.05 * rng.standard_normal((64, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    _, exact_ids = exact_search(emb, q, 10)
    if not faiss_available() or NO_ANN:
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


def cold_cli(rows: int, repeats: int, tmp: Path) -> dict:
    """Wall time of a cold ``clip-mini search`` (a fresh process: imports, opening the index, the torch-free text
    tower, the search, printing) on a generated ``rows``-row index of the tiny model's width (bench_startup)."""
    from benchmarks.speed.bench_startup import make_index, make_model, wall
    from PIL import Image

    image = tmp / "query.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(image)
    model_dir = make_model(tmp / "model")
    t = time.perf_counter()
    index = make_index(tmp / "cold-index", model_dir, rows, image)
    build_s = time.perf_counter() - t
    cmd = [sys.executable, "-m", "clip_mini", "search", "--index", str(index), "a dog running on grass", "--json"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)   # exports the ONNX towers once
    probe = ("import sys, runpy; sys.argv = ['clip-mini'] + sys.argv[1:]\n"
             "from clip_mini.retrieval.search import dispatch\n"
             "picked = []\nreal = dispatch.auto_kernel\n"
             "dispatch.auto_kernel = lambda *a: picked.append(real(*a)) or picked[-1]\n"
             "try:\n    runpy.run_module('clip_mini', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('KERNEL', picked, 'torch' in sys.modules, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", probe, *cmd[3:]], capture_output=True, text=True, cwd=ROOT,
                       check=True)
    kernel_line = [ln for ln in r.stderr.splitlines() if ln.startswith("KERNEL")][-1].split(maxsplit=1)[1]
    n_dim = np.load(index / "embeddings-1.npy", mmap_mode="r").shape
    return {"rows": rows, "dim": int(n_dim[1]), "index_files_mb": round(sum(
                f.stat().st_size for f in index.iterdir() if f.is_file()) / 1e6, 1),
            "make_index_s": round(build_s, 1), "kernel_and_torch_imported": kernel_line,
            "text_query": wall(cmd, repeats), "python_import_numpy": wall([sys.executable, "-c", "import numpy"],
                                                                           repeats),
            "target_s": 0.5}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000],
                   help="matrix sizes (none: only the cold CLI arm)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice; 1 on a "
                   "busy shared machine, where threads waiting for a descheduled sibling cost tens of ms per op)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/search.json"))
    p.add_argument("--no-ann", action="store_true", help="leave out the faiss HNSW / IVF arms")
    p.add_argument("--cold-rows", type=int, default=1_000_000, help="rows of the generated index a cold "
                   "`clip-mini search` runs on (0: leave that arm out)")
    p.add_argument("--torch-free-arm", metavar="NPY", help=argparse.SUPPRESS)   # internal: see torch_free_arm
    args = p.parse_args(argv)
    if args.torch_free_arm:
        print(json.dumps(torch_free_arm(args.torch_free_arm, args.repeats)))
        return {}
    global NO_ANN
    NO_ANN = args.no_ann
    # The load average is recorded because a shared machine's other work distorts small timings badly (OpenBLAS
    # threads spin-waiting for a busy core can turn a 0.2 ms product into 15 ms).
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"machine": {**machine_info(), "numpy": np.__version__,
                          "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
                          "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")}, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="clip_mini_bench_") as tmp:
        for n in args.sizes:
            t = time.perf_counter()
            r = bench_size(n, args.dim, args.repeats, Path(tmp))
            r["bench_s"] = round(time.perf_counter() - t, 1)
            result["sizes"].append(r)
            print(json.dumps(r), flush=True)
        if args.cold_rows:
            result["cold_cli"] = cold_cli(args.cold_rows, args.repeats, Path(tmp))
            print(json.dumps(result["cold_cli"]), flush=True)
    from clip_mini.fileio.atomic import atomic_write_json

    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
