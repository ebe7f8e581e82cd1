"""Near-duplicate finding (``clip-mini dupes``) on real photos with planted copies; the default threshold's source.

    python benchmarks/studies/dupes_planted.py [--model DIR] [--images ../shared/data/flickr8k/images]

Two disjoint planted sets are cut from the Flickr8k photos (seeded): each has 500 photos, 20 of which get 3 edited
copies (60 copies: ``benchmarks/lib/planted.py``: resized to half, JPEG quality 40, a 90% centre crop, a colour
jitter), so 80 true pairs of copy and original plus 60 between copies of one photo. Each set is indexed
(``EmbeddingIndex.build``) and ``retrieval.dupes.find_duplicates`` groups its stored rows at every threshold of a
grid. On the tuning set the threshold with the highest F1 over pairs (ties: the higher threshold) is chosen; on
the held-out set precision and recall are reported at that threshold and at ``DEFAULT_THRESHOLD``.

``--model``: a trained model directory. Without one, the model is ``configs/flickr8k-vit.yaml``'s pretrained
image tower, DINOv2 ViT-S/14 ([CLS ; patch mean], 768 wide), with an identity image head (``head: linear``,
``embed_dim`` 768, the projection set to the identity): an untrained CLIP's image side, which is all dupes
reads. Writes ``benchmarks/results/studies/dupes_planted.json``.
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
from benchmarks.lib.planted import pair_scores, plant_copies  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo  # noqa: E402

GRID = [round(t, 3) for t in np.arange(0.70, 0.996, 0.005)]


def tower_model(out: Path) -> Path:
    """The pretrained-tower stand-in described in the module docstring, saved as a model directory."""
    import torch

    from clip_mini.config import load_config
    from clip_mini.model.clip import CLIPModel

    cfg = load_config(ROOT / "configs/flickr8k-vit.yaml", ["model.head=linear", "model.embed_dim=768"]).model
    torch.manual_seed(0)
    model = CLIPModel.build(cfg)
    with torch.no_grad():
        model.image_head.proj.weight.copy_(torch.eye(768))
        model.image_head.proj.bias.zero_()
    model.save_pretrained(out)
    return out


def planted_set(photos: list[Path], out: Path, seed: int) -> dict[str, str]:
    import os

    out.mkdir(parents=True)
    for p in photos:
        os.symlink(p, out / p.name)
    return plant_copies(photos[:20], out / "copies", copies_each=3, seed=seed)


def sweep(model_dir: Path, folder: Path, planted: dict, work: Path) -> dict:
    from clip_mini.retrieval.dupes import find_duplicates
    from clip_mini.retrieval.index import EmbeddingIndex

    t = time.perf_counter()
    index = EmbeddingIndex.build(work, str(model_dir), folder, progress=False)
    embed_s = time.perf_counter() - t
    paths = index.items["path"]
    planted = {str(Path(k).resolve()): str(Path(v).resolve()) for k, v in planted.items()}
    resolved = [str(Path(p).resolve()) for p in paths]
    rows = np.asarray(index.embeddings, np.float32)
    out = {}
    for th in GRID:
        groups = find_duplicates(rows, th, "exact")
        out[th] = pair_scores([[resolved[r] for r in g.rows] for g in groups], planted)
        out[th]["groups"] = len(groups)
    return {"n_rows": len(index), "embed_seconds": round(embed_s, 1), "by_threshold": out}


def f1(s: dict) -> float:
    p, r = s["precision"], s["recall"]
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def main() -> None:
    from clip_mini.retrieval.dupes import DEFAULT_THRESHOLD

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="trained model directory (default: the pretrained-tower stand-in)")
    ap.add_argument("--images", type=Path, default=ROOT.parent / "shared/data/flickr8k/images")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/studies/dupes_planted.json")
    args = ap.parse_args()
    photos = sorted(args.images.glob("*.jpg"))
    if len(photos) < 1000:
        sys.exit(f"need at least 1000 photos under {args.images}, found {len(photos)}")
    pick = np.random.default_rng(args.seed).permutation(len(photos))
    tune_photos, test_photos = [photos[i] for i in pick[:500]], [photos[i] for i in pick[500:1000]]
    with tempfile.TemporaryDirectory(prefix="dupes-study-") as tmp:
        tmp = Path(tmp)
        model_dir = args.model or tower_model(tmp / "tower_model")
        tune = sweep(model_dir, tmp / "tune", planted_set(tune_photos, tmp / "tune", args.seed), tmp / "tune_index")
        test = sweep(model_dir, tmp / "test", planted_set(test_photos, tmp / "test", args.seed + 1),
                     tmp / "test_index")
    chosen = max(GRID, key=lambda th: (round(f1(tune["by_threshold"][th]), 6), th))
    default = min(GRID, key=lambda th: abs(th - DEFAULT_THRESHOLD))
    result = {
        "study": "dupes_planted",
        "model": (relative_to_repo(args.model) if args.model else
                  "configs/flickr8k-vit.yaml image tower (DINOv2 ViT-S/14, pretrained), identity head, untrained"),
        "images": relative_to_repo(args.images),
        "sets": "2 disjoint sets of 500 photos; 20 of each get 3 edited copies (half, jpeg40, crop90, jitter)",
        "chosen_threshold_on_tuning_set": chosen,
        "tuning_at_chosen": tune["by_threshold"][chosen],
        "held_out_at_chosen": test["by_threshold"][chosen],
        "default_threshold": DEFAULT_THRESHOLD,
        "held_out_at_default": test["by_threshold"][default],
        "tuning": {k: v for k, v in tune.items() if k != "by_threshold"},
        "held_out": {k: v for k, v in test.items() if k != "by_threshold"},
        "held_out_by_threshold": {str(k): {m: round(v, 4) if isinstance(v, float) else v for m, v in s.items()}
                                  for k, s in test["by_threshold"].items()},
        "machine": machine_info(),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
