"""The README's "search my own photos" recipe, timed as a user runs it: `clip-mini index` a folder of real photos with
the recommended real-photo model (configs/flickr8k.yaml's EfficientNet-Lite0 + MiniLM-L6), re-run it unchanged, then
`clip-mini search` a few text queries and one image query, each as its own process (what a shell user waits for).

    python benchmarks/speed/bench_recipe.py --model runs/quality/d/best --images ../shared/data/flickr8k/images \
        --limit 2000 --out benchmarks/results/speed/recipe.json

The photos are the first ``--limit`` files of the folder (sorted), copied into a temporary folder so the index is
built from scratch. Writes the JSON (paths relative to the repository) and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.lib.machine import machine_info  # noqa: E402
from benchmarks.lib.repo_paths import ROOT, relative_to_repo, scrub_paths  # noqa: E402

QUERIES = ["a dog running on the grass", "two children playing on the beach", "a man riding a bike down a hill"]


def _timed(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return time.perf_counter() - start, done.stdout


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/quality/d/best", help="model directory (configs/flickr8k.yaml's run)")
    p.add_argument("--images", default="../shared/data/flickr8k/images")
    p.add_argument("--limit", type=int, default=2000, help="photos indexed")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="index --precision (auto, the CLI's default: bf16 on a CPU with native bf16)")
    p.add_argument("--out", default="benchmarks/results/speed/recipe.json")
    args = p.parse_args()
    exe = [sys.executable, "-m", "clip_mini"]
    photos = sorted(f for f in os.listdir(args.images) if f.lower().endswith((".jpg", ".jpeg", ".png")))[:args.limit]
    result = {"machine": machine_info(), "benchmark": "recipe", "model": relative_to_repo(args.model),
              "images_folder": relative_to_repo(args.images), "photos": len(photos), "cpus": os.cpu_count(),
              "loadavg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="clip_mini_recipe_") as tmp:
        folder, index = Path(tmp) / "photos", Path(tmp) / "photos-index"
        folder.mkdir()
        for f in photos:
            shutil.copy2(Path(args.images) / f, folder / f)
        cmd = exe + ["index", "--model", args.model, "--images", str(folder), "--out", str(index), "--quiet"]
        cmd += ["--precision", args.precision]
        seconds, _ = _timed(cmd)
        import torch

        from clip_mini.runtime.devices import resolve_precision

        resolved = resolve_precision(args.precision, torch.device("cpu"))
        result["index"] = {"precision": f"{args.precision} ({resolved} here)", "seconds": round(seconds, 1),
                           "photos_per_s": round(len(photos) / seconds, 1)}
        result["index"]["unchanged_rerun_s"] = round(_timed(cmd)[0], 2)
        text = []
        for q in QUERIES:
            s, out = _timed(exe + ["search", "--index", str(index), q, "-k", "5", "--json"])
            text.append(s)
            assert len(json.loads(out)["results"]) == 5
        image_s, out = _timed(exe + ["search", "--index", str(index), "--image", str(folder / photos[0]), "-k", "5",
                                     "--json"])
        result["search"] = {"text_query_process_s": [round(s, 2) for s in text],
                            "text_query_median_s": round(statistics.median(text), 2),
                            "image_query_process_s": round(image_s, 2),
                            "image_query_top_hit_is_itself": Path(json.loads(out)["results"][0]["path"]).name
                            == photos[0]}
    result["loadavg_end"] = os.getloadavg()[0]
    result = scrub_paths(result)
    from clip_mini.fileio.atomic import atomic_write_json

    atomic_write_json(ROOT / args.out, result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
