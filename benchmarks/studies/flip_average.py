"""Flip averaging at index time: does a photo's embedding averaged with its mirror image's retrieve better?

    python benchmarks/studies/flip_average.py --model photos --model runs/quality/bf16_t3e2mp2/best \
        --out benchmarks/results/quality/flip_average.json

For each model, the val split of configs/flickr8k.yaml (the split every Flickr8k run selects on; the test split is
never read) is scored twice by the trainer's own metrics (``clip_mini.eval.metrics.retrieval_metrics``): the image
embeddings as indexing makes them, and the mean of the embeddings of each photo and of its left-right mirror,
renormalised. Both through the same gradient-free pass as indexing (``CLIPModel``'s ``ImageForward``) at the
precision the hardware rule picks; the mirror is taken on the preprocessed pixels. The JSON records the CPU, the
load average and the seconds each pass took (the mirror doubles the image side of indexing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.lib.machine import machine_info  # noqa: E402
from benchmarks.lib.repo_paths import ROOT, relative_to_repo  # noqa: E402


def score(model_name: str, config: str, captions: str, batch: int) -> dict:
    import torch
    import torch.nn.functional as F

    from clip_mini.config import load_config
    from clip_mini.data import ImageDataset, load_splits
    from clip_mini.embed import load
    from clip_mini.eval.metrics import retrieval_metrics
    from clip_mini.eval.validation import _text_features
    from clip_mini.model.clip import ImageForward
    from clip_mini.runtime.devices import resolve_precision

    cfg = load_config(config, [f"data.captions={captions}"])
    df = load_splits(cfg, progress=False)["val"]
    embedder = load(model_name, batch_size=batch)
    model, device = embedder.model, torch.device("cpu")
    precision = resolve_precision("auto", device)
    paths = df.drop_duplicates("image_id").sort_values("image_id")["path"].tolist()
    loader = torch.utils.data.DataLoader(ImageDataset(paths, embedder.transform, None), batch_size=batch)
    forward = ImageForward(model, precision, device)
    plain, mirrored, seconds = [], [], {"plain": 0.0, "mirror": 0.0}
    for pixels, _, ok in loader:
        if not bool(ok.all()):
            raise SystemExit(f"flip_average: unreadable val images in {config}'s split")
        t0 = time.perf_counter()
        plain.append(forward(pixels))
        t1 = time.perf_counter()
        mirrored.append(forward(torch.flip(pixels, dims=[-1])))
        seconds["plain"] += t1 - t0
        seconds["mirror"] += time.perf_counter() - t1
    plain, mirrored = torch.cat(plain), torch.cat(mirrored)
    averaged = F.normalize(plain + mirrored, dim=-1)
    ids = torch.as_tensor(df["image_id"].to_numpy())
    with torch.inference_mode():
        text = _text_features(model, df["caption"].astype(str).tolist(), batch, device, precision)
    rows = {"plain": retrieval_metrics(plain, text, ids), "flip_average": retrieval_metrics(averaged, text, ids),
            "mirror_only": retrieval_metrics(mirrored, text, ids)}
    rows = {k: {m: round(float(v), 4) for m, v in r.items()} for k, r in rows.items()}
    return {"model": relative_to_repo(model_name) if os.path.isdir(model_name) else model_name,
            "fingerprint": getattr(model, "fingerprint", None), "precision": precision,
            "images": len(paths), "captions": len(df), "image_pass_s": {k: round(v, 1) for k, v in seconds.items()},
            **rows, "gain": {m: round(rows["flip_average"][m] - rows["plain"][m], 4)
                             for m in ("t2i_r1", "t2i_r5", "t2i_r10", "i2t_r1", "i2t_r5", "i2t_r10", "rsum")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="a model directory or built-in name (repeat)")
    p.add_argument("--config", default=str(ROOT / "configs/flickr8k.yaml"), help="the split (val is scored)")
    p.add_argument("--captions", default=str(ROOT.parent / "shared/data/flickr8k/captions.csv"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/quality/flip_average.json"))
    args = p.parse_args()
    if not Path(args.captions).is_file():
        raise SystemExit(f"flip_average: {args.captions} not found (Flickr8k captions)")
    load_start = os.getloadavg()[0]
    result = {"benchmark": "flip_average", "split": "val", "config": relative_to_repo(args.config),
              "machine": {**machine_info(), "load_average_1min_at_start": load_start},
              "models": [score(m, args.config, args.captions, args.batch) for m in args.model]}
    result["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
    from clip_mini.fileio.atomic import atomic_write_json

    atomic_write_json(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
