"""Wall time of `clip-mini search` on a 10k-image index, as a user runs it (a fresh process each time).

    python benchmarks/speed/bench_startup.py [--rows 10000] [--repeats 7]

Builds a model directory with the ``configs/tiny.yaml`` architecture (untrained: speed does not depend on the
weights) and a synthetic index of ``rows`` random unit vectors with made-up paths, written through the real
``clip_mini.retrieval.index.commit``. Then times, each in a new process: a text query (numpy text tower, no torch), an
image query (torch image tower), and for reference bare ``python -c 'import numpy'`` and ``import torch``.
Writes ``benchmarks/results/speed/startup.json``; the target is a text query under 2 s.
"""
from __future__ import annotations

import argparse
import hashlib
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


def make_model(out: Path) -> Path:
    from clip_mini.config import load_config
    from clip_mini.model.clip import CLIPModel

    cfg = load_config(ROOT / "configs/tiny.yaml")
    captions = [f"a {c} {s} on the {p}" for c in ("red", "green", "blue", "dog", "man") for s in
                ("circle", "square", "running", "grass") for p in ("left", "right", "top")]
    CLIPModel.build(cfg.model, captions=captions).save_pretrained(out)
    return out


def make_index(out: Path, model_dir: Path, rows: int, image: Path, generation: int = 1, seed: int = 0) -> Path:
    """Publish generation ``generation`` of a synthetic index at ``out``: ``rows`` random unit rows (from ``seed``)
    and made-up paths, written as a writer does (rows atomically, then ``commit`` under the writer lock)."""
    from clip_mini.fileio.atomic import atomic_path
    from clip_mini.retrieval.format import commit, writer_lock
    from clip_mini.fileio.manifest import read_manifest

    manifest = read_manifest(model_dir)
    dim = json.loads((model_dir / "config.json").read_text())["model"]["embed_dim"]
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((rows, dim)).astype(np.float32)
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float16)
    paths = [str(image)] + [f"/photos/{i // 1000:03d}/img_{i:07d}.jpg" for i in range(1, rows)]
    items = {"path": paths, "size": [100_000] * rows, "mtime_ns": [0] * rows,
             "sha256": [hashlib.sha256(p.encode()).hexdigest() for p in paths], "caption": [""] * rows}
    with writer_lock(out):
        with atomic_path(out / f"embeddings-{generation}.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, emb)
        commit(out, generation, items, {"model_fingerprint": manifest["fingerprint"], "model_dir": str(model_dir),
                                        "source": "synthetic", "shard": None}, progress=False)
    return out


def wall(cmd: list[str], repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        times.append(time.perf_counter() - t)
        if r.returncode != 0:
            raise RuntimeError(f"{cmd} failed: {r.stderr[-2000:]}")
    return {"p50_s": round(float(np.percentile(times, 50)), 3), "p95_s": round(float(np.percentile(times, 95)), 3),
            "min_s": round(min(times), 3)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/startup.json"))
    args = p.parse_args(argv)
    cli = str(Path(sys.executable).parent / "clip-mini")
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="clip_mini_bench_") as tmp:
        tmp = Path(tmp)
        from PIL import Image

        image = tmp / "query.jpg"
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (160, 160, 3), dtype=np.uint8)).save(image)
        model_dir = make_model(tmp / "model")
        index = make_index(tmp / "index", model_dir, args.rows, image)
        result = {
            "machine": machine_info(), "rows": args.rows, "loadavg_start": os.getloadavg()[0],
            "text_query": wall([cli, "search", "--index", str(index), "a dog running on grass"], args.repeats),
            "text_query_json_k100": wall([cli, "search", "--index", str(index), "a dog running on grass", "-k",
                                          "100", "--json"], args.repeats),
            "image_query": wall([cli, "search", "--index", str(index), "--image", str(image)],
                                max(3, args.repeats // 2)),
            "python_import_numpy": wall([py, "-c", "import numpy"], args.repeats),
            "python_import_torch": wall([py, "-c", "import torch"], max(3, args.repeats // 2)),
            "loadavg_end": os.getloadavg()[0],
        }
    result["target_text_query_s"] = 2.0
    result["meets_target"] = result["text_query"]["p50_s"] < 2.0
    print(json.dumps(result, indent=2))
    from clip_mini.fileio.atomic import atomic_write_json

    atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
