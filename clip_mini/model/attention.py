"""Where the image tower looks: the CLS token's attention over the patch grid.

Two summaries of a ViT's attention (both (grid_h, grid_w) maps summing to 1):

* ``mean``: the CLS row of every layer's attention, averaged over heads and layers (``ImageEncoder.cls_attention``).
* ``rollout`` (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers"): per layer the head-averaged
  attention plus the identity for the residual path, rows renormalised, multiplied through the layers; the CLS row
  of the product says how much each patch's input reaches the CLS output.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch

Mode = Literal["mean", "rollout"]


def image_backbone(model_dir: str | Path) -> str:
    """The image tower a model directory declares ("vit", "efficientnet", ...), read from its ``config.json``
    without loading any weights: ``clip-mini attention`` refuses a non-ViT model before paying for it."""
    from clip_mini.fileio.manifest import ModelDirError, read_json

    config = read_json(Path(model_dir) / "config.json")
    try:
        return str(config["model"]["vision"].get("backbone", "vit"))
    except (KeyError, TypeError, AttributeError):
        raise ModelDirError(f"{Path(model_dir) / 'config.json'}: no model.vision section") from None


def rollout(maps: list[torch.Tensor], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Attention rollout from per-layer maps (B, heads, N, N): the CLS row over patches, (B, N - prefix)."""
    result = None
    for a in maps:
        a = a.mean(1)  # (B, N, N) head average
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)  # residual connection
        a = a / a.sum(-1, keepdim=True)
        result = a if result is None else a @ result
    return result[:, 0, num_prefix_tokens:]


def attention_map(model, pixels: torch.Tensor, mode: Mode = "mean") -> np.ndarray:
    """CLS attention over the patch grid for one preprocessed image.

    Args:
        model: ``CLIPModel`` with a ViT image tower.
        pixels: (3, S, S) or (1, 3, S, S) preprocessed image.
        mode: "mean" (over heads and layers) or "rollout".

    Returns:
        (grid_h, grid_w) float32 map, non-negative, summing to 1.
    """
    if pixels.ndim == 3:
        pixels = pixels[None]
    visual = model.visual
    pixels = pixels.to(next(visual.parameters()).device)
    if mode == "mean":
        maps = visual.cls_attention(pixels)  # (1, depth, heads, gh, gw)
        heat = maps.mean(dim=(1, 2))[0]
    elif mode == "rollout":
        if visual.cfg.backbone != "vit":
            raise ValueError(f"attention rollout needs a ViT image tower, this model uses {visual.cfg.backbone}")
        maps, grid = visual.attention_maps(pixels)
        heat = rollout(maps, visual.trunk.num_prefix_tokens)[0].reshape(grid)
    else:
        raise ValueError(f"unknown attention mode {mode!r} (use 'mean' or 'rollout')")
    heat = heat.float().clamp_min(0).cpu().numpy()
    return (heat / max(float(heat.sum()), 1e-12)).astype(np.float32)
