"""Which locked image features are worth a full run? A cheap linear-probe-style screen on the val split.

    python benchmarks/quality/bench_features.py [--arms effnet dino_cls dino_cls_mean effnet+dino_cls_mean ...]

Every arm is scored the same way: each image tower runs once, locked, over the train and val photos (eval
transform, no augmentation; test photos are never read), MiniLM-L6 runs once, locked, over their captions (mean
pooling, its sentence-embedding recipe), and only two MLP projection heads and the temperature train on those
stored features (symmetric contrastive loss, one caption per image per epoch, 30 epochs, seconds per arm). The
val split is the trainer's own (configs/flickr8k.yaml: 500 images, seed 0). This ranks *features*; the full
recipe (augmented views, a fine-tuned text tower) is then run by benchmarks/quality/quality_flickr8k.py on the chosen
ones. Features are kept in runs/bench_features/ so adding an arm costs only its own tower pass.

Writes benchmarks/results/quality/features.json (``--out`` another file: features_pool.json, features_loss.json,
features_dino_layers.json hold later screens). A ViT tower's cache also keeps the class tokens of its blocks L-3..L-1,
so ``dino224_cls4_mean`` (DINOv2's linear-evaluation read-out) costs no extra pass.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402

TOWERS = {   # name -> VisionConfig overrides (the ViTs return [CLS ; patch mean]; arms slice it)
    "effnet224": dict(backbone="efficientnet_lite0", pretrained="efficientnet-lite0-pypi", image_size=224),
    "effnet160": dict(backbone="efficientnet_lite0", pretrained="efficientnet-lite0-pypi", image_size=160),
    "effnet288": dict(backbone="efficientnet_lite0", pretrained="efficientnet-lite0-pypi", image_size=288),
    "effnet320": dict(backbone="efficientnet_lite0", pretrained="efficientnet-lite0-pypi", image_size=320),
    "dino224": dict(backbone="vit", pretrained="dinov2-small-imgfocus", image_size=224, patch_size=14, width=384,
                    depth=12, heads=6, init_values=1e-5, pooling="cls_mean"),
    "dino280": dict(backbone="vit", pretrained="dinov2-small-imgfocus", image_size=280, patch_size=14, width=384,
                    depth=12, heads=6, init_values=1e-5, pooling="cls_mean"),
    "dino168": dict(backbone="vit", pretrained="dinov2-small-imgfocus", image_size=168, patch_size=14, width=384,
                    depth=12, heads=6, init_values=1e-5, pooling="cls_mean"),
}


def feature(name: str, feats: dict[str, np.ndarray]) -> np.ndarray:
    """An arm's image features: towers joined by '+'; dino*_cls / _mean / _cls_mean slice the [CLS ; mean] output,
    _cls4 is the class token of the last 4 blocks and _cls4_mean adds the patch mean (DINOv2's linear probe).

    A ``raw:`` prefix concatenates the towers' features as they come (what ``model.vision.concat`` does); without
    it each tower's features are first scaled to unit mean norm."""
    raw = name.startswith("raw:")
    name = name.removeprefix("raw:")
    parts = []
    for part in name.split("+"):
        if part.startswith("dino"):
            tower, _, pool = part.partition("_")
            x = feats[tower]
            # stored: [CLS ; patch mean ; CLS of blocks L-3, L-2, L-1] (the last three only in newer caches)
            if pool.startswith("cls4") and x.shape[1] != 5 * 384:
                raise SystemExit(f"error: the cached {tower}.npy predates the cls4 read-out; delete it to recompute")
            cls4 = np.concatenate([x[:, 768:], x[:, :384]], axis=1)
            parts.append({"cls": x[:, :384], "mean": x[:, 384:768], "cls_mean": x[:, :768], "cls4": cls4,
                          "cls4_mean": np.concatenate([cls4, x[:, 384:768]], axis=1)}[pool or "cls"])
        else:
            parts.append(feats[part])
    # each tower's features scaled to unit mean norm, so no tower dominates the joint input by its scale alone
    if raw:
        return np.concatenate(parts, axis=1)
    return np.concatenate([p / np.linalg.norm(p, axis=1).mean() for p in parts], axis=1)


def tower_features(tower: str, paths: list[str], cache: Path, threads: int) -> np.ndarray:
    out = cache / f"{tower}.npy"
    if out.is_file():
        return np.load(out)
    from tqdm import tqdm

    from clip_mini.config import VisionConfig
    from clip_mini.data.images import load_image
    from clip_mini.data.transforms import build_eval_transform
    from clip_mini.model.vision import ImageEncoder, inference_tower, tower_input

    enc = ImageEncoder(VisionConfig(trainable=False, **TOWERS[tower]))
    enc.load_pretrained(enc.cfg.pretrained)
    fast = inference_tower(enc.eval(), "bf16")
    transform = build_eval_transform(enc.preprocess)
    # ViTs also keep the class token of blocks L-3..L-1, through the final norm: with the last block's [CLS ; mean]
    # that is DINOv2's linear-evaluation input (the last 4 class tokens and the patch mean)
    earlier: list[torch.Tensor] = []
    if enc.cfg.backbone == "vit":
        for block in fast.trunk.blocks[-4:-1]:
            block.register_forward_hook(lambda m, i, o: earlier.append(fast.trunk.norm(o[:, 0])))
    feats, t0 = [], time.perf_counter()
    with torch.inference_mode():
        for i in tqdm(range(0, len(paths), 64), desc=tower, unit="batch"):
            x = torch.stack([transform(load_image(p)) for p in paths[i:i + 64]])
            earlier.clear()
            feats.append(torch.cat([fast(tower_input(fast, x))] + earlier, dim=1).float().numpy())
    feats = np.concatenate(feats)
    print(f"{tower}: {len(paths) / (time.perf_counter() - t0):.1f} images/s (decode included)")
    np.save(out, feats)
    return feats


def text_features(captions: list[str], cache: Path) -> np.ndarray:
    out = cache / "minilm_mean.npy"
    if out.is_file():
        return np.load(out)
    from tqdm import tqdm

    from clip_mini.config import TextConfig
    from clip_mini.model.text import MINILM, TextEncoder, build_tokenizer

    cfg = TextConfig(pretrained=MINILM, pooling="mean", max_length=40, dropout=0.0)
    tok = build_tokenizer(cfg)
    enc = TextEncoder(cfg, len(tok), tok.pad_token_id)
    enc.load_pretrained(MINILM)
    enc.eval()
    feats = []
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in tqdm(range(0, len(captions), 256), desc="minilm", unit="batch"):
            t = tok(captions[i:i + 256], padding=True, truncation=True, max_length=40, return_tensors="pt")
            feats.append(enc(t["input_ids"], t["attention_mask"]).float().numpy())
    feats = np.concatenate(feats)
    np.save(out, feats)
    return feats


def probe(img: np.ndarray, txt: np.ndarray, txt_img: np.ndarray, train_imgs: np.ndarray, val_imgs: np.ndarray,
          epochs: int, seed: int, loss_name: str = "clip") -> dict:
    """Train two MLP heads on stored features; val retrieval after each epoch; the best epoch by rsum.

    ``loss_name``: "clip" (the trainer's), "ls<eps>" (clip with label smoothing eps) or "siglip" (sigmoid loss,
    temperature 10 and bias -10 at the start, as SigLIP initialises them).
    """
    from clip_mini.eval.metrics import retrieval_metrics
    from clip_mini.model.loss import clip_loss, siglip_loss
    from clip_mini.model.clip import ProjectionHead

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    img_t, txt_t = torch.from_numpy(img).float(), torch.from_numpy(txt).float()
    ih, th = ProjectionHead(img.shape[1], 256), ProjectionHead(txt.shape[1], 256)
    siglip = loss_name == "siglip"
    smoothing = float(loss_name[2:]) if loss_name.startswith("ls") else 0.0
    if not siglip and not smoothing and loss_name != "clip":
        raise SystemExit(f"error: unknown loss {loss_name!r} (clip, ls<eps>, siglip)")
    scale = torch.nn.Parameter(torch.tensor(float(np.log(10.0 if siglip else 1 / 0.07))))
    bias = torch.nn.Parameter(torch.tensor(-10.0))
    params = list(ih.parameters()) + list(th.parameters())
    opt = torch.optim.AdamW([{"params": params, "weight_decay": 0.1},
                             {"params": [scale] + ([bias] if siglip else []), "weight_decay": 0.0}], lr=1e-3)
    caps_of = {int(i): np.flatnonzero(txt_img == i) for i in np.concatenate([train_imgs, val_imgs])}
    val_caps = np.concatenate([caps_of[int(i)] for i in val_imgs])
    val_local = {int(i): j for j, i in enumerate(val_imgs)}
    val_ids = np.array([val_local[int(txt_img[c])] for c in val_caps])
    steps = epochs * (len(train_imgs) // 128)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    best, history = None, []
    for epoch in range(epochs):
        ih.train(), th.train()
        order = rng.permutation(train_imgs)
        for b in range(len(order) // 128):
            ims = order[b * 128:(b + 1) * 128]
            caps = np.array([rng.choice(caps_of[int(i)]) for i in ims])
            fi = torch.nn.functional.normalize(ih(img_t[ims]), dim=-1)
            ft = torch.nn.functional.normalize(th(txt_t[caps]), dim=-1)
            if siglip:
                loss = siglip_loss(fi, ft, scale.clamp(max=4.6052).exp(), bias)
            else:
                loss = clip_loss(fi, ft, scale.clamp(max=4.6052).exp(), label_smoothing=smoothing)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        ih.eval(), th.eval()
        with torch.no_grad():
            m = retrieval_metrics(torch.nn.functional.normalize(ih(img_t[val_imgs]), dim=-1),
                                  torch.nn.functional.normalize(th(txt_t[val_caps]), dim=-1), val_ids)
        history.append(round(m["rsum"], 4))
        if best is None or m["rsum"] > best["rsum"]:
            best = {**{k: round(v, 4) for k, v in m.items()}, "epoch": epoch + 1}
    return {"best": best, "val_rsum_by_epoch": history}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/flickr8k.yaml"))
    ap.add_argument("--captions", default=None, help="default: the config's data.captions")
    ap.add_argument("--arms", nargs="+", default=[
        "effnet160", "effnet224", "effnet288", "effnet320", "dino224_cls", "dino224_mean", "dino224_cls_mean", "dino168_cls_mean",
        "effnet224+dino224_cls", "effnet224+dino224_cls_mean", "effnet288+dino224_cls"])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=str(ROOT / "runs/bench_features"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/quality/features.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from clip_mini.config import load_config
    from clip_mini.data import load_splits
    from clip_mini.fileio.atomic import atomic_write_text

    cfg = load_config(args.config, [f"data.captions={args.captions}"] if args.captions else [])
    splits = load_splits(cfg, progress=False)
    df = pd.concat([splits["train"], splits["val"]], ignore_index=True)    # the test split is never read
    paths = list(dict.fromkeys(df["path"]))
    index = {p: i for i, p in enumerate(paths)}
    txt_img = df["path"].map(index).to_numpy()
    train_imgs = np.array(sorted({index[p] for p in splits["train"]["path"]}))
    val_imgs = np.array(sorted({index[p] for p in splits["val"]["path"]}))
    cache = Path(args.cache) / f"{len(paths)}-{cfg.data.seed}-{cfg.data.val}-{cfg.data.test}"
    cache.mkdir(parents=True, exist_ok=True)

    # an arm is features[@loss]: e.g. effnet288+dino224_cls@siglip (see probe for the losses)
    towers = sorted({part.partition("_")[0] for arm in args.arms
                     for part in arm.partition("@")[0].removeprefix("raw:").split("+")})
    feats = {t: tower_features(t, paths, cache, args.threads) for t in towers}
    txt = text_features(df["caption"].tolist(), cache)
    results = {}
    for arm in args.arms:
        x = feature(arm.partition("@")[0], feats)
        runs = [probe(x, txt, txt_img, train_imgs, val_imgs, args.epochs, seed, arm.partition("@")[2] or "clip")
                for seed in range(args.seeds)]
        best = {k: round(float(np.mean([r["best"][k] for r in runs])), 4)
                for k in ("t2i_r1", "t2i_r5", "t2i_r10", "i2t_r1", "i2t_r5", "i2t_r10", "rsum")}
        results[arm] = {"input_dim": x.shape[1], "val_mean_over_seeds": best, "runs": runs}
        print(f"{arm:32s} dim {x.shape[1]:5d}  val t2i R@5 {best['t2i_r5']:.3f}  i2t R@5 {best['i2t_r5']:.3f}  "
              f"rsum {best['rsum']:.3f}", flush=True)
    out = {
        "machine": machine_info(), "benchmark": "bench_features", "split": "val", "val_images": len(val_imgs),
        "train_images": len(train_imgs),
        "protocol": "locked image tower (eval transform) and locked MiniLM-L6 mean-pooled text, features stored "
                    "once; MLP heads + temperature trained on them; best epoch by val rsum; mean over seeds",
        "epochs": args.epochs, "seeds": args.seeds, "config": os.path.relpath(args.config, ROOT), "arms": results,
        "load_average_1min_at_end": os.getloadavg()[0],
    }
    atomic_write_text(args.out, json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v["val_mean_over_seeds"] for k, v in results.items()}, indent=1))
    return out


if __name__ == "__main__":
    main()
