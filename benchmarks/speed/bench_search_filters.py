"""Search latency with and without filters (``--under``, ``--glob``, ``--after``, ``--before``) on a 1M-row index.

    python benchmarks/speed/bench_search_filters.py [--rows 1000000] [--dim 256] [--repeats 7]

A synthetic index of ``rows`` clustered unit vectors (float16, as ``bench_search.clustered``), written through the real
``commit``, with no faiss index: the default (``auto``) path is the exact search, which is also the only path a
filtered query takes. Paths ``g<NN>/s<N>/img_<i>.jpg`` (100 folders of 1% each, rows sorted by path as builds write
them) and capture dates (one every 5 minutes, in a shuffled order) let each filter keep an exact share of the rows:

* ``date_1pct`` / ``date_10pct``: ``after``/``before`` a window holding 1% / 10% of the rows, spread over the index;
* ``under_1pct``: one folder of the 100 (a run of consecutive rows: searched in place);
* ``glob_1pct`` / ``glob_10pct``: ``*00.jpg`` / ``*0.jpg`` (file names, spread over the index).

Timed (p50 / p95 of ``repeats`` after a warm-up, warm page cache), in a fresh process that never imports torch (as a
``clip-mini search`` text query runs), through ``EmbeddingIndex.search``: a plain 1-term text query, a 3-term query
(``"a dog" + "on a beach" - "grass"``, parsed by ``features.terms``), and each filter on the 1-term query: ``warm``
(the kept rows cached on the index, as a server's repeated filter finds them) and ``cold`` (the rows found again
from the items table each time, as a one-shot CLI query does); ``search_only``: the same with the query features
precomputed (no text tower); ``find_rows_ms``: finding the kept rows alone. Each filtered answer is checked against
brute force over the kept rows (``exact``). Writes ``benchmarks/results/speed/search_filters.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402

TEXT = "a dog running on grass"
TERMS = ["a dog", "+", "on a beach", "-", "grass"]
STEP_S = 300                        # one photo every 5 minutes
START = datetime(2015, 1, 1)
STRIDE = 7919                       # a prime: i -> i * STRIDE % rows shuffles the dates over the rows


def build(out: Path, rows: int, dim: int) -> tuple[Path, Path]:
    """A tiny untrained model with ``dim``-wide embeddings (its ONNX towers exported) and the synthetic index."""
    from benchmarks.speed.bench_search import clustered
    from clip_mini.config import load_config
    from clip_mini.model.clip import CLIPModel
    from clip_mini.model.onnx_export import ensure_onnx
    from clip_mini.retrieval.format import commit, writer_lock
    from clip_mini.fileio.manifest import read_manifest

    model_dir = out / "model"
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"model.embed_dim={dim}"])
    captions = [f"a {c} {s} on the {p}" for c in ("red", "dog", "man", "beach") for s in ("circle", "running", "grass")
                for p in ("left", "right")]
    CLIPModel.build(cfg.model, captions=captions).save_pretrained(model_dir)
    ensure_onnx(model_dir, "text")   # both towers exported now: the timed process must not import torch for it
    index = out / "index"
    emb = clustered(rows, dim)
    group, sub = max(1, rows // 100), max(1, rows // 1000)
    paths = [f"/photos/g{i // group:02d}/s{(i // sub) % 10}/img_{i:07d}.jpg" for i in range(rows)]
    assert paths == sorted(paths)
    base = int((START - datetime(1970, 1, 1)).total_seconds())
    taken = base + (np.arange(rows, dtype=np.int64) * STRIDE % rows) * STEP_S
    items = {"path": paths, "size": [100_000] * rows, "mtime_ns": [0] * rows,
             "sha256": [f"{i:064x}" for i in range(rows)], "caption": [""] * rows,
             "taken": taken, "taken_from": ["exif"] * rows}
    with writer_lock(index):
        np.save(index / "embeddings-1.npy", emb)
        commit(index, 1, items, {"model_fingerprint": read_manifest(model_dir)["fingerprint"],
                                 "model_dir": str(model_dir), "source": "synthetic", "shard": None}, progress=False)
    return model_dir, index


def _date(rank: int) -> str:
    return (START + timedelta(seconds=rank * STEP_S)).isoformat()


def filters(rows: int) -> dict[str, dict]:
    one, ten = rows // 100, rows // 10
    mid = rows // 3
    return {"date_1pct": {"after": _date(mid), "before": _date(mid + one)},
            "date_10pct": {"after": _date(mid), "before": _date(mid + ten)},
            "under_1pct": {"under": "g37"},
            "glob_1pct": {"glob": "*00.jpg"},
            "glob_10pct": {"glob": "*0.jpg"}}


def timed(fn, repeats: int, before=None) -> dict:
    fn()   # warm-up: page cache, onnxruntime sessions
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"p50_ms": round(1000 * float(np.percentile(times, 50)), 3),
            "p95_ms": round(1000 * float(np.percentile(times, 95)), 3)}


def measure(index_dir: str, repeats: int, k: int) -> dict:
    """The timed arm, in a process that never imports torch."""
    from clip_mini.features.terms import parse_args
    from clip_mini.features.unit import unit_rows
    from clip_mini.retrieval.filters import SearchFilter
    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.retrieval.search import auto_kernel

    index = EmbeddingIndex.load(index_dir)
    terms = parse_args(TERMS)
    features = index.engine().encode_text([TEXT])
    n = len(index)
    out = {"rows": n, "dim": index.dim, "k": k, "repeats": repeats, "faiss_index": "faiss" in index.manifest["files"],
           "auto_kernel_unfiltered": auto_kernel(n, 1, True),
           "one_term": timed(lambda: index.search(TEXT, k=k), repeats),
           "three_terms": timed(lambda: index.search(terms, k=k), repeats),
           "search_only": timed(lambda: index.search(features, k=k), repeats),
           "encode_one_term": timed(lambda: index.engine().encode_text([TEXT]), repeats),
           "filtered": {}}

    def forget():
        index.__dict__.pop("_filter_rows", None)

    q = unit_rows(np.asarray(features, np.float32))
    for name, spec in filters(n).items():
        flt = SearchFilter.of(**spec)
        forget()
        t = time.perf_counter()
        rows = flt.rows(index)
        first_ms = 1000 * (time.perf_counter() - t)
        scores, ids = index.search(features, k=k, filters=flt)
        e = np.asarray(index.embeddings[rows], np.float64)
        s = (e @ q[0].astype(np.float64)).astype(np.float32)
        order = np.lexsort((rows, -s))[:k]
        out["filtered"][name] = {
            "filter": spec, "kept": int(len(rows)), "kept_share": round(len(rows) / n, 4),
            "contiguous": bool(rows[-1] - rows[0] + 1 == len(rows)),
            "exact": ids[0].tolist() == rows[order].tolist() and bool(np.array_equal(scores[0], s[order])),
            "find_rows_first_ms": round(first_ms, 3),
            "find_rows": timed(lambda: flt.rows(index), repeats, before=forget),
            "warm": timed(lambda: index.search(TEXT, k=k, filters=flt), repeats),
            "cold": timed(lambda: index.search(TEXT, k=k, filters=flt), repeats, before=forget),
            "search_only_warm": timed(lambda: index.search(features, k=k, filters=flt), repeats),
        }
    out["torch_imported"] = "torch" in sys.modules
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/search_filters.json"))
    p.add_argument("--measure", metavar="INDEX", help=argparse.SUPPRESS)   # internal: the torch-free timed arm
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.repeats, args.k)))
        return {}
    result = {"machine": machine_info(), "rows": args.rows, "dim": args.dim, "dtype": "float16"}
    with tempfile.TemporaryDirectory(prefix="clip_mini_bench_") as tmp:
        t = time.perf_counter()
        _, index = build(Path(tmp), args.rows, args.dim)
        result["build_s"] = round(time.perf_counter() - t, 1)
        r = subprocess.run([sys.executable, __file__, "--measure", str(index), "--repeats", str(args.repeats),
                            "-k", str(args.k)], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        result.update(json.loads(r.stdout.strip().splitlines()[-1]))
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
