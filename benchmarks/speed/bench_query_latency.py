"""Cold query wall time through onnxruntime: `clip-mini search` on a 10k-row index, a fresh process each time.

    python benchmarks/speed/bench_query_latency.py [--model runs/quality/d/best] [--rows 10000] [--repeats 7]

The model is the trained flickr8k model (MiniLM-L6 text tower, EfficientNet-Lite0 image tower at the config's
size: what a user of this project searches with); the index is ``rows`` random unit vectors recorded as built by that model
(``bench_startup.make_index``: search time does not depend on the rows' values). The ONNX export the first query
of a model triggers is timed once (``first_use_export_s``); then text and image queries (a Flickr8k photo when the
data is present) are each run ``repeats`` times in new processes (warm page cache), and whether torch, timm,
albumentations or OpenCV were imported is recorded. Targets: text <= 0.3 s, image <= 1.5 s.
Writes ``benchmarks/results/speed/query_latency.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402

from benchmarks.speed.bench_startup import make_index, make_model, wall  # noqa: E402
from benchmarks.lib.repo_paths import scrub_paths  # noqa: E402

PHOTOS = ROOT.parent / "shared/data/flickr8k/fullres/images"
HEAVY = ("torch", "timm", "albumentations", "cv2")


def imported_modules(index: Path, query: list[str]) -> list[str]:
    code = ("import sys; from clip_mini.cli.main import main; rc = main(sys.argv[1:]); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "search", "--index", str(index), *query], capture_output=True,
                       text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stderr.strip().splitlines()[-1].replace("'", '"'))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "runs/quality/d/best"))
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/query_latency.json"))
    args = p.parse_args(argv)
    cli = str(Path(sys.executable).parent / "clip-mini")
    with tempfile.TemporaryDirectory(prefix="clip_mini_bench_") as tmp:
        tmp = Path(tmp)
        if Path(args.model).is_dir():   # a copy: the ONNX export lands in it, not in the original
            model_dir, model_name = Path(shutil.copytree(args.model, tmp / "model", ignore=shutil.ignore_patterns(
                "onnx"))), args.model
        else:
            model_dir, model_name = make_model(tmp / "model"), "configs/tiny.yaml (untrained)"
        photos = sorted(PHOTOS.glob("*.jpg"))[:1] if PHOTOS.is_dir() else []
        image = photos[0] if photos else tmp / "query.jpg"
        if not photos:
            from PIL import Image

            Image.fromarray(np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8)).save(image)
        index = make_index(tmp / "index", model_dir, args.rows, image)
        text = ["a dog running on grass"]
        t = time.perf_counter()
        subprocess.run([cli, "search", "--index", str(index), *text], check=True, capture_output=True, cwd=ROOT)
        export_s = time.perf_counter() - t
        onnx_bytes = {f.name: f.stat().st_size for f in sorted((model_dir / "onnx").glob("*.onnx*"))}
        from PIL import Image

        with Image.open(image) as im:
            size = im.size
        result = {
            "machine": machine_info(), "model": model_name, "rows": args.rows, "loadavg_start": os.getloadavg()[0],
            "first_use_export_s": round(export_s, 2), "onnx_bytes": onnx_bytes,
            "query_image_size": list(size),
            "text_query": wall([cli, "search", "--index", str(index), *text], args.repeats),
            "image_query": wall([cli, "search", "--index", str(index), "--image", str(image)], args.repeats),
            "heavy_imports_text": imported_modules(index, text),
            "heavy_imports_image": imported_modules(index, ["--image", str(image)]),
            "python_import_numpy": wall([sys.executable, "-c", "import numpy"], args.repeats),
            "loadavg_end": os.getloadavg()[0],
        }
    result["targets_s"] = {"text_query": 0.3, "image_query": 1.5}
    result["meets_targets"] = {k: result[k]["p50_s"] <= v for k, v in result["targets_s"].items()}
    print(json.dumps(result, indent=2))
    from clip_mini.fileio.atomic import atomic_write_json

    atomic_write_json(args.out, scrub_paths(result))
    return result


if __name__ == "__main__":
    main()
