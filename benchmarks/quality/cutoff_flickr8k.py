"""How well a score cut-off tells "the photo is here" from "nothing here matches", on Flickr8k val.

    python benchmarks/quality/cutoff_flickr8k.py --model photos
    python benchmarks/quality/cutoff_flickr8k.py --model runs/photos/best --result /tmp/cutoff.json

Every val caption is searched twice: against the whole val index (its own photo present), and against the index
without its photo. A cut-off keeps a caption's hit when its photo ranks in the top ``--k`` and scores above the
cut-off, and it says "nothing matches" when no photo of the reduced index scores above it. For each score (the raw
cosine, which search uses, and for comparison the z-score of the cosine against the index's own score distribution
for that query) the curve of kept hits against empty answers is swept over thresholds. The default, the model's
own calibrated cosine (``clip_mini.eval.cutoff``, stored in its config.json by the trainer), is scored where it
stands. Val only: no test labels are read.
Writes benchmarks/results/quality/cutoff_flickr8k.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402


def sweep(true_score: np.ndarray, true_rank: np.ndarray, removed_scores: np.ndarray, k: int,
          thresholds: np.ndarray) -> list[dict]:
    """For each threshold: the share of top-k true hits kept, the share of removed-photo searches answered with
    nothing, and the mean number of (false) hits those searches return within the top k."""
    topk = true_rank < k
    best_removed = removed_scores.max(axis=1)
    kth = np.sort(removed_scores, axis=1)[:, ::-1][:, :k]
    rows = []
    for t in thresholds:
        rows.append({"threshold": round(float(t), 4),
                     "kept": round(float((true_score[topk] >= t).mean()), 4),
                     "empty_when_removed": round(float((best_removed < t).mean()), 4),
                     "false_hits_when_removed": round(float((kth >= t).sum(axis=1).mean()), 3)})
    return rows


def best_empty_at(rows: list[dict], kept: float) -> dict:
    ok = [r for r in rows if r["kept"] >= kept]
    return max(ok, key=lambda r: r["empty_when_removed"]) if ok else {}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="photos", help="model directory or built-in name")
    p.add_argument("--config", default=str(ROOT / "configs/flickr8k-vit.yaml"), help="the split comes from here")
    p.add_argument("--captions", default=str(ROOT.parent / "shared/data/flickr8k/captions.csv"))
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--result", default=str(ROOT / "benchmarks/results/quality/cutoff_flickr8k.json"))
    args = p.parse_args(argv)

    from clip_mini.config import load_config
    from clip_mini.data import load_splits
    from clip_mini.embed import load
    from clip_mini.builtin.registry import resolve_model
    from clip_mini.eval.cutoff import calibrate, true_and_removed
    from clip_mini.retrieval.cutoff import model_cutoff

    t0 = time.time()
    cfg = load_config(args.config, [f"data.captions={args.captions}"])
    val = load_splits(cfg, progress=False)["val"]
    embedder = load(args.model)
    paths = sorted(val["path"].unique())
    col = {p_: i for i, p_ in enumerate(paths)}
    img = embedder.encode_image(paths, show_progress=True)
    txt = embedder.encode_text(val["caption"].tolist(), show_progress=True)
    truth = val["path"].map(col).to_numpy()
    raw = txt @ img.T                                          # (captions, images)
    n_cap, n_img = raw.shape
    true_raw, true_rank, _ = true_and_removed(raw, truth)
    mask = np.ones_like(raw, dtype=bool)
    mask[np.arange(n_cap), truth] = False
    removed_raw = raw[mask].reshape(n_cap, n_img - 1)

    # for comparison: z-scores, each caption against the score distribution of the index it searches
    def z_of(queries, scores, rows):
        mean, cov = rows.mean(0), np.cov(rows, rowvar=False, bias=True)
        sd = np.sqrt(np.einsum("qd,de,qe->q", queries, cov, queries))
        return (scores - (queries @ mean)[:, None]) / sd[:, None]

    true_z = z_of(txt, true_raw[:, None], img)[:, 0]
    removed_z = np.empty_like(removed_raw)
    for c in range(n_cap):   # the reduced index's own statistics (one photo fewer)
        removed_z[c] = z_of(txt[c:c + 1], removed_raw[c:c + 1], img[np.arange(n_img) != truth[c]])[0]

    methods = {}
    for name, ts, rs in (("raw_cosine", true_raw, removed_raw), ("z_index", true_z, removed_z)):
        lo, hi = np.quantile(np.concatenate([ts, rs.max(1)]), [0.001, 0.999])
        rows = sweep(ts, true_rank, rs, args.k, np.linspace(lo, hi, 200))
        methods[name] = {"curve": rows, "best_empty_at_kept_0.90": best_empty_at(rows, 0.90)}
    stored = model_cutoff(resolve_model(args.model))
    own = calibrate(img, txt, truth, k=args.k)   # what the trainer stores, recomputed here
    default = sweep(true_raw, true_rank, removed_raw, args.k, np.array([stored if stored is not None
                                                                          else own["cutoff_cosine"]]))[0]
    result = {"benchmark": "cutoff_flickr8k", "machine": machine_info(), "model": str(args.model),
              "split": "val", "captions": n_cap, "images": n_img, "k": args.k,
              "recall_at_k": round(float((true_rank < args.k).mean()), 4),
              "targets": {"kept": 0.90, "empty_when_removed": 0.50},
              "default": {"method": "the model's calibrated cosine", "stored_in_model": stored, **default},
              "calibration_recomputed": own, "methods": methods, "wall_s": round(time.time() - t0, 1)}
    write_result(args.result, result)


if __name__ == "__main__":
    main()
