"""The demo's text pooling: the card's [CLS] state against masked-mean pooling, same data, same steps.

    python benchmarks/studies/demo_pooling.py [--variants mean cls-random cls-zero] [--epochs 8]

Trains ``configs/tiny.yaml`` on the generated shapes data (``data/shapes``, 10,000 images, generated if absent)
once per variant, each with the same seed, steps and schedule, then for each trained ``best/`` model reports:

* validation recall (``clip_mini.eval.scoring.evaluate_retrieval`` on the config's 300-image val split);
* the demo's first query, "a large red circle on the left", over an index of all 10,000 images: of the top 16,
  how many show a red circle (any size) on the left, and how many a large red circle anywhere, read from the
  generator's ``labels.csv`` (ground truth, not captions).

Variants: ``mean`` (masked mean over the caption's tokens), ``cls-embedding`` ([CLS] entering the blocks as
BERT's learned [CLS] embedding), ``cls-zero`` (``model.text.cls_input=zero``: [CLS] enters as a zero vector, so
its first attention is a learned-query pooling of the words), ``cls-zero-lr2`` (the same with twice the text
tower's learning rate), ``cls-zero-l3`` (the same with a third text block: [CLS] reads contextualised words in
two blocks, as masked-mean pooling averages states that went through all of them), ``cls-zero-lrhalf`` (half the
text tower's learning rate) and ``cls-zero-warm400`` (4x the warm-up). Prints JSON and writes
``benchmarks/results/studies/demo_pooling.json`` after each variant.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
QUERY = "a large red circle on the left"
VARIANTS = {
    "mean": ["model.text.pooling=mean"],
    "cls-embedding": ["model.text.pooling=cls", "model.text.cls_input=embedding"],
    "cls-zero": ["model.text.pooling=cls", "model.text.cls_input=zero"],
    "cls-zero-lr2": ["model.text.pooling=cls", "model.text.cls_input=zero", "train.lr_text=4.0e-3"],
    "cls-zero-l3": ["model.text.pooling=cls", "model.text.cls_input=zero", "model.text.n_layers=3"],
    "cls-zero-lrhalf": ["model.text.pooling=cls", "model.text.cls_input=zero", "train.lr_text=1.0e-3"],
    "cls-zero-warm400": ["model.text.pooling=cls", "model.text.cls_input=zero", "train.warmup_steps=400"],
}


def ensure_shapes(data: Path) -> None:
    if not (data / "images" / "train_09999.png").is_file():
        subprocess.run([sys.executable, "-m", "clip_mini.data.synthetic", "--out", str(data), "--n", "10000",
                        "--seed", "0"], check=True, cwd=ROOT)


def query_hits(model_dir: Path, data: Path, index_dir: Path) -> dict:
    from clip_mini import EmbeddingIndex

    labels = {}
    with open(data / "labels.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            labels[row["image"]] = row
    index = EmbeddingIndex.build(index_dir, str(model_dir), str(data / "images"), progress=False)
    hits = index.search_text(QUERY, k=16)

    def objects(r):
        objs = [(r["colour"], r["shape"], r["size"], r["position"])]
        if r["colour2"]:
            objs.append((r["colour2"], r["shape2"], r["size2"], r["position2"]))
        return objs

    rows = [labels[Path(p).name] for p, _ in hits]
    return {"query": QUERY, "k": 16,
            "red_circle_on_left": sum(any(o[:2] == ("red", "circle") and o[3] == "left" for o in objects(r))
                                      for r in rows),
            "large_red_circle_on_left": sum(any(o == ("red", "circle", "large", "left") for o in objects(r))
                                            for r in rows),
            "large_red_circle_anywhere": sum(any(o[:3] == ("red", "circle", "large") for o in objects(r))
                                             for r in rows),
            "top": [Path(p).name for p, _ in hits]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--epochs", type=int, default=None, help="default: the config's")
    ap.add_argument("--out", default=str(ROOT / "runs" / "demo_pooling"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "studies" / "demo_pooling.json"))
    args = ap.parse_args(argv)
    from clip_mini.eval.scoring import evaluate_retrieval

    data = ROOT / "data" / "shapes"
    ensure_shapes(data)
    out = Path(args.out)
    results = []
    for name in args.variants:
        run = out / name
        sets = VARIANTS[name] + [f"train.out_dir={run}"] + ([f"train.epochs={args.epochs}"] if args.epochs else [])
        cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--resume", "auto"]
        for s in sets:
            cmd += ["--set", s]
        with open(run.parent / f"{name}.log", "a") as log:   # --resume auto: a finished run is not retrained
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        val = evaluate_retrieval(run / "best", ROOT / "configs/tiny.yaml", split="val", overrides=VARIANTS[name],
                                 progress=False)
        hits = query_hits(run / "best", data, out / f"index-{name}")
        res = {"variant": name, "overrides": VARIANTS[name], "command": " ".join(cmd),
               "val": {k: v for k, v in val.items() if k.startswith(("t2i", "i2t", "rsum"))}, "search": hits}
        print(json.dumps({k: res[k] for k in ("variant", "val")}), flush=True)
        results.append(res)
        _write(args.results, results)
    print(json.dumps(_write(args.results, results), indent=2))


def _write(path: str, results: list) -> dict:
    """Write this run's variants, keeping other variants an earlier run of this script recorded."""
    from benchmarks.lib.repo_paths import scrub_paths

    mine = {r["variant"] for r in results}
    if Path(path).is_file():
        earlier = [r for r in json.loads(Path(path).read_text()).get("results", []) if r["variant"] not in mine]
        results = earlier + results
    report = {"benchmark": "demo_pooling", "config": "configs/tiny.yaml", "data": "data/shapes (10,000 images)",
              "machine": {**machine_info(), "load_avg_1m_end": os.getloadavg()[0]},
              "results": results}
    report = scrub_paths(report)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
