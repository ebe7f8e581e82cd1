"""Match maps (``Embedder.explain``) scored by the pointing game on the generated shapes, with the demo model.

    python benchmarks/quality/explain_pointing.py --model runs/tiny/best [--data data/shapes] [--n 200]

A query points correctly when the peak of its map (over the image's pixels) falls inside the queried object's
box, which the generator records in ``labels.csv``. Images come from ``compositional_test.csv``'s part of the
data (never trained on): ``--n`` two-object images, each object queried by its own phrase ("a red circle"), and
``--n`` single-object images queried the same way. Scored for each method of ``clip_mini.model.explain`` and, as
a baseline that ignores the text, the CLS attention (``clip_mini.model.attention``: mean over heads and layers,
and rollout). Writes ``benchmarks/results/quality/explain_pointing.json``.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo  # noqa: E402


def cases(data: Path, n: int) -> dict[str, list[tuple[str, str, tuple]]]:
    """``{"two_object": [(image path, query, box)], "single_object": [...]}`` from the compositional split."""
    two, one = [], []
    with open(data / "labels.csv", newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if r["split"] != "comp":
                continue
            path = str(data / "images" / r["image"])
            first = (path, f"a {r['colour']} {r['shape']}", tuple(float(r[k]) for k in ("x0", "y0", "x1", "y1")))
            if r["n_objects"] == "2" and len(two) < 2 * n:
                second = (path, f"a {r['colour2']} {r['shape2']}",
                          tuple(float(r[k]) for k in ("x0_2", "y0_2", "x1_2", "y1_2")))
                two += [first, second]
            elif r["n_objects"] == "1" and len(one) < n:
                one.append(first)
    return {"two_object": two, "single_object": one}


def inside(heat: np.ndarray, box: tuple) -> bool:
    """The peak pixel's centre inside the box (ties: the first peak in reading order)."""
    y, x = np.unravel_index(int(np.argmax(heat)), heat.shape)
    x0, y0, x1, y1 = box
    return x0 <= x + 0.5 <= x1 and y0 <= y + 0.5 <= y1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "runs/tiny/best")
    ap.add_argument("--data", type=Path, default=ROOT / "data/shapes")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. which training run the model is)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality/explain_pointing.json")
    args = ap.parse_args()
    import torch

    from clip_mini.data import load_image
    from clip_mini.embed import load
    from clip_mini.model.attention import attention_map
    from clip_mini.model.explain import upsample

    torch.set_num_threads(min(2, torch.get_num_threads()))
    emb = load(args.model, device="cpu")
    sets = cases(args.data, args.n)
    scores, seconds = {}, {}
    for name, items in sets.items():
        hits = {m: 0 for m in ("gradcam", "tokens", "cls_attention_mean", "cls_attention_rollout")}
        attn_cache = {}
        for path, query, box in items:
            for method in ("gradcam", "tokens"):
                t = time.perf_counter()
                hits[method] += inside(emb.explain(path, query, method=method), box)
                seconds.setdefault(method, []).append(time.perf_counter() - t)
            if path not in attn_cache:
                image = load_image(path)
                pixels = emb.transform(image)
                attn_cache[path] = {mode: upsample(attention_map(emb.model, pixels, mode), *image.shape[:2])
                                    for mode in ("mean", "rollout")}
            hits["cls_attention_mean"] += inside(attn_cache[path]["mean"], box)
            hits["cls_attention_rollout"] += inside(attn_cache[path]["rollout"], box)
        scores[name] = {"queries": len(items), **{m: round(h / len(items), 4) for m, h in hits.items()}}
        print(name, scores[name], flush=True)
    result = {
        "benchmark": "explain_pointing",
        "model": relative_to_repo(args.model), "model_note": args.note, "data": relative_to_repo(args.data),
        "images": "compositional_test.csv part of the shapes data (never trained on); queries 'a {colour} {shape}'",
        "pointing_accuracy": scores,
        "ms_per_map": {m: round(1000 * float(np.median(s)), 2) for m, s in seconds.items()},
        "machine": machine_info(),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
