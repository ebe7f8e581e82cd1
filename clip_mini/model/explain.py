"""Match maps: where in an image a text query matches, as a map over the tower's patch (or feature) grid.

Methods (each returns a (grid_h, grid_w) float32 map, higher where the image matches the text):

* ``gradcam``: the gradient of the image-text cosine similarity with respect to the token states entering the
  ViT's last block, times those states, summed over channels and clipped at zero (Grad-CAM's gradient-times-
  activation, taken per token as in transformer relevance methods). The last block is where the class token (or
  the pooled patches) reads the patches for the final time, so these states are what the embedding was made from.
  For a CNN tower (EfficientNet): classic Grad-CAM on the last feature map (channel weights = mean gradient).
* ``tokens``: each patch token after the final norm projected through the image head on its own and scored
  against the text embedding (for ``cls_mean`` pooling, the token takes the patch-mean's place beside the CLS
  state). Cheap, but only meaningful where the head was trained on patch states.

``auto`` is ``gradcam``: on the demo shapes model (``cls`` pooling) it puts the peak inside the queried object
more often than ``tokens`` or the text-blind CLS attention (``benchmarks/quality/explain_pointing.py``).
"""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

Method = Literal["auto", "gradcam", "tokens"]
METHODS = ("auto", "gradcam", "tokens")


def match_map(model, pixels: torch.Tensor, text_features: torch.Tensor, method: Method = "auto") -> np.ndarray:
    """The match map of one preprocessed image against one text embedding.

    Args:
        model: a ``CLIPModel``.
        pixels: (3, S, S) or (1, 3, S, S) preprocessed image.
        text_features: (E,) or (1, E) text embedding (any norm) of the same model.
        method: "auto", "gradcam" or "tokens" (see the module docstring).

    Returns:
        (grid_h, grid_w) float32, non-negative (``gradcam``) or cosine scores (``tokens``).
    """
    if method not in METHODS:
        raise ValueError(f"unknown match-map method {method!r} (use {', '.join(METHODS)})")
    if pixels.ndim == 3:
        pixels = pixels[None]
    device = next(model.parameters()).device
    pixels = pixels.to(device).float()
    # a copy: an embedding made under inference_mode cannot enter the graph the gradient runs through
    text = F.normalize(torch.as_tensor(text_features, dtype=torch.float32, device=device).reshape(1, -1).clone(),
                       dim=-1)
    visual = model.visual
    if method == "tokens":
        if visual.cfg.backbone != "vit":
            raise ValueError(f"token match maps need a ViT image tower, this model uses {visual.cfg.backbone}")
        return _tokens(model, pixels, text)
    if visual.cfg.backbone == "vit":
        return _gradcam_vit(model, pixels, text)
    return _gradcam_cnn(model, pixels, text)


def _grid(visual, pixels: torch.Tensor) -> tuple[int, int]:
    ph, pw = visual.trunk.patch_embed.patch_size
    return pixels.shape[-2] // ph, pixels.shape[-1] // pw


@torch.no_grad()
def _tokens(model, pixels: torch.Tensor, text: torch.Tensor) -> np.ndarray:
    visual = model.visual
    t = visual.trunk
    if visual.concat is not None:
        raise ValueError("token match maps read one tower's patches: this model concatenates a second tower")
    states = t.forward_features(pixels)          # (1, prefix + N, D), final-normed
    patches = states[0, t.num_prefix_tokens:]    # (N, D)
    pooling = visual.cfg.pooling
    if pooling == "cls":
        inputs = patches
    elif pooling == "cls_mean":
        inputs = torch.cat([states[0, :1].expand_as(patches), patches], dim=-1)
    else:
        raise ValueError(f"token match maps support cls and cls_mean pooling, this tower uses {pooling}")
    scores = F.normalize(model.image_head(inputs).float(), dim=-1) @ text[0]
    return scores.reshape(_grid(visual, pixels)).cpu().numpy().astype(np.float32)


def _gradcam_vit(model, pixels: torch.Tensor, text: torch.Tensor) -> np.ndarray:
    visual = model.visual
    t = visual.trunk
    last = t.blocks[-1]
    saved = {}

    def keep(_module, args):
        args[0].retain_grad()
        saved["x"] = args[0]

    handle = last.register_forward_pre_hook(keep)
    try:
        with torch.enable_grad():
            pixels = pixels.clone().requires_grad_(True)   # so the tokens carry a graph even with a frozen tower
            image = model.encode_image(pixels, normalize=True)
            (image[0] @ text[0]).backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    x = saved["x"]
    heat = (x.grad * x).sum(-1)[0, t.num_prefix_tokens:].clamp_min(0)   # (N,)
    return heat.detach().reshape(_grid(visual, pixels)).cpu().numpy().astype(np.float32)


def _gradcam_cnn(model, pixels: torch.Tensor, text: torch.Tensor) -> np.ndarray:
    trunk = model.visual.trunk
    saved = {}

    def keep(_module, _args, out):
        out.retain_grad()
        saved["a"] = out

    # timm EfficientNets end in a 1x1 head conv, its BatchNorm and activation (bn2): the last feature map
    layer = next((getattr(trunk, n) for n in ("bn2", "conv_head") if getattr(trunk, n, None) is not None), None)
    if layer is None:
        raise ValueError(f"Grad-CAM needs a CNN tower ending in a head conv (conv_head / bn2): {type(trunk).__name__}")
    handle = layer.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            pixels = pixels.clone().requires_grad_(True)
            image = model.encode_image(pixels, normalize=True)
            (image[0] @ text[0]).backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    a = saved["a"]                                          # (1, C, h, w)
    weights = a.grad.mean(dim=(2, 3), keepdim=True)         # Grad-CAM: channel importance
    heat = (weights * a).sum(1)[0].clamp_min(0)
    return heat.detach().cpu().numpy().astype(np.float32)


def upsample(heat: np.ndarray, height: int, width: int) -> np.ndarray:
    """A (gh, gw) map bilinearly resized to (height, width), scaled to [0, 1] (all zeros stays zeros)."""
    h = torch.as_tensor(np.asarray(heat, np.float32))[None, None]
    up = F.interpolate(h, size=(height, width), mode="bilinear", align_corners=False)[0, 0].numpy()
    lo, hi = float(up.min()), float(up.max())
    return ((up - lo) / (hi - lo) if hi > lo else np.zeros_like(up)).astype(np.float32)
