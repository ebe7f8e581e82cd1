"""``clip-mini attention``: overlay the ViT class token's attention on an image."""
from __future__ import annotations

import argparse

from clip_mini.cli.common import (MODEL_HELP, add_device, add_quiet, check_output_folder, command_parser, count,
                                  resolve_model_arg)


def add_arguments(sub) -> argparse.ArgumentParser:
    at = command_parser(
        sub, "attention", "overlay the CLS token's attention on an image",
        "Draw where the ViT image tower's class token attends, over the image (ViT towers only).",
        "clip-mini attention --model runs/tiny/best photo.jpg --out attn.png --mode rollout")
    at.add_argument("--model", required=True, help=MODEL_HELP[:-1] + "; with a ViT image tower)")
    at.add_argument("image", help="image file")
    at.add_argument("--out", required=True, help="output PNG")
    at.add_argument("--mode", default="mean", choices=["mean", "rollout"],
                    help="mean over heads and layers, or attention rollout")
    at.add_argument("--alpha", type=float, default=0.5, help="heat map opacity")
    at.add_argument("--size", type=count, default=448, help="longer side of the output in pixels (0: image size)")
    add_device(at)
    add_quiet(at)
    return at


def cmd_attention(args: argparse.Namespace) -> int:
    from clip_mini.embed import load
    from clip_mini.model.attention import attention_map, image_backbone
    from clip_mini.data import load_image
    from clip_mini.embed import InputError
    from clip_mini.pictures.draw import attention_overlay

    if not 0.0 <= args.alpha <= 1.0:
        raise InputError(f"--alpha must be in [0, 1], got {args.alpha}")
    check_output_folder(args.out, "--out")
    from clip_mini.runtime.devices import resolve_device

    device = resolve_device(args.device)
    resolve_model_arg(args)
    backbone = image_backbone(args.model)   # from config.json: refuse before loading weights or reading the image
    if backbone != "vit":
        raise InputError(f"attention maps need a ViT image tower; {args.model} uses {backbone}")
    image = load_image(args.image)
    embedder = load(args.model, device=device)
    if embedder.model.preprocess.resize_mode == "center_crop":   # the patch grid covers the centre square only
        h, w = image.shape[:2]
        s = min(h, w)
        image = image[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
    heat = attention_map(embedder.model, embedder.transform(image), args.mode)
    size = attention_overlay(image, heat, args.out, alpha=args.alpha, size=args.size or None)
    print(f"attention ({args.mode}, {heat.shape[0]}x{heat.shape[1]} patches) -> {args.out} ({size[0]}x{size[1]})")
    return 0
