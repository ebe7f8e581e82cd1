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

``auto`` is ``gradcam``, for images with more than one thing in them: on the demo shapes model (``cls`` pooling,
4 x 4 patches; mean of 3 seeds) with two objects an image, its peak falls inside the queried object for 0.2517 of
the queries, against 0.1358 for the text-blind CLS attention (mean over heads and layers) and a chance rate of
0.0944. With one object, the CLS attention finds it more often (0.4867 against Grad-CAM's 0.3617): there the text
has nothing to choose between. On hand-boxed Flickr8k photos with the built-in model, mostly one subject each, the
CLS attention leads too (0.6495 against 0.567; chance 0.3431) (``benchmarks/quality/explain_pointing.py``,
``benchmarks/results/quality/explain_pointing.json``).

The gradient is taken with respect to the captured states only: the model's parameters have ``requires_grad`` off
for the call (restored after, whatever they were), so no parameter gradient is computed or stored, and the
model's own ``.grad`` fields are left as they were. Calls on one model from several threads (``clip-mini serve``)
take turns on a per-model lock, since the flags belong to the model; the capturing hook acts only in the thread
that registered it, so other threads' forward passes through the same model (search) go by untouched; and the ViT
attention kernel each pass picks holds for its own thread (``ImageEncoder._pick_attention``), so a search under
inference_mode beside it cannot switch the map's pass to the fused kernel midway (nor the map's pass the search's);
the text tower's choice is per thread too (``model.text``). ``unexplainable`` says, before any pass, whether a model's
tower has maps at all.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, Literal

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
    reason = unexplainable(model, method)
    if reason is not None:
        raise ValueError(reason)
    visual = model.visual
    if method == "tokens":
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
    visual._pick_attention(pixels)               # this call's kernel, not the last pass's (timm's own forward)
    states = t.forward_features(pixels)          # (1, prefix + N, D), final-normed
    patches = states[0, t.num_prefix_tokens:]    # (N, D)
    if visual.cfg.pooling == "cls":   # else cls_mean (``unexplainable`` refused the others)
        inputs = patches
    else:
        inputs = torch.cat([states[0, :1].expand_as(patches), patches], dim=-1)
    scores = F.normalize(model.image_head(inputs).float(), dim=-1) @ text[0]
    return scores.reshape(_grid(visual, pixels)).cpu().numpy().astype(np.float32)


_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _model_lock(model) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.Lock()
        return lock


@contextmanager
def _parameters_frozen(model) -> Iterator[None]:
    """``requires_grad`` off on every parameter for the block, restored after, one block per model at a time."""
    with _model_lock(model):
        params = list(model.parameters())
        flags = [p.requires_grad for p in params]
        try:
            for p in params:
                p.requires_grad_(False)
            yield
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)


def _leaf(captured: dict, thread: int, x: torch.Tensor) -> torch.Tensor | None:
    """In the explaining thread, ``x`` as a fresh leaf that records the gradient (kept in ``captured``)."""
    if threading.get_ident() != thread or "x" in captured:
        return None   # another thread's forward through the shared model, or a second pass: left alone
    captured["x"] = x.detach().requires_grad_(True)
    return captured["x"]


def _similarity_gradient(model, pixels: torch.Tensor, text: torch.Tensor, layer, pre: bool):
    """``(states, d similarity / d states)`` at ``layer``'s input (``pre``) or output, for this call only."""
    captured: dict = {}
    thread = threading.get_ident()
    if pre:
        def hook(_module, args):
            x = _leaf(captured, thread, args[0])
            return None if x is None else (x, *args[1:])

        handle = layer.register_forward_pre_hook(hook)
    else:
        handle = layer.register_forward_hook(lambda _module, _args, out: _leaf(captured, thread, out))
    try:
        with _parameters_frozen(model), torch.inference_mode(False), torch.enable_grad():
            image = model.encode_image(pixels.clone(), normalize=True)
            x = captured["x"]
            (grad,) = torch.autograd.grad(image[0] @ text[0], x)
    finally:
        handle.remove()
    return x.detach(), grad


def _gradcam_vit(model, pixels: torch.Tensor, text: torch.Tensor) -> np.ndarray:
    visual = model.visual
    t = visual.trunk
    x, grad = _similarity_gradient(model, pixels, text, t.blocks[-1], pre=True)   # (1, prefix + N, D) each
    heat = (grad * x).sum(-1)[0, t.num_prefix_tokens:].clamp_min(0)   # (N,)
    return heat.reshape(_grid(visual, pixels)).cpu().numpy().astype(np.float32)


def _cnn_head(trunk):
    """A CNN trunk's last feature map's layer: timm EfficientNets end in a 1x1 head conv, its BatchNorm and
    activation (bn2); None for a trunk without one."""
    return next((getattr(trunk, n) for n in ("bn2", "conv_head") if getattr(trunk, n, None) is not None), None)


def unexplainable(model, method: Method = "auto") -> str | None:
    """Why ``match_map(model, ..., method)`` cannot draw this model's maps, or None when it can: the rules
    ``match_map`` applies, asked before any image is read (``clip-mini serve`` answers such a model's requests
    501 instead of running a pass to find out)."""
    visual = model.visual
    backbone = visual.cfg.backbone
    if method == "tokens":
        if backbone != "vit":
            return f"token match maps need a ViT image tower, this model uses {backbone}"
        if visual.concat is not None:
            return "token match maps read one tower's patches: this model concatenates a second tower"
        if visual.cfg.pooling not in ("cls", "cls_mean"):
            return f"token match maps support cls and cls_mean pooling, this tower uses {visual.cfg.pooling}"
        return None
    if backbone != "vit" and _cnn_head(visual.trunk) is None:
        return (f"Grad-CAM needs a ViT image tower or a CNN tower ending in a head conv (conv_head / bn2); this "
                f"model's {backbone} tower ({type(visual.trunk).__name__}) has neither")
    return None


def _gradcam_cnn(model, pixels: torch.Tensor, text: torch.Tensor) -> np.ndarray:
    trunk = model.visual.trunk
    layer = _cnn_head(trunk)   # there is one: ``unexplainable`` checked
    a, grad = _similarity_gradient(model, pixels, text, layer, pre=False)   # (1, C, h, w) each
    weights = grad.mean(dim=(2, 3), keepdim=True)         # Grad-CAM: channel importance
    heat = (weights * a).sum(1)[0].clamp_min(0)
    return heat.cpu().numpy().astype(np.float32)


def upsample(heat: np.ndarray, height: int, width: int) -> np.ndarray:
    """A (gh, gw) map bilinearly resized to (height, width), scaled to [0, 1] (all zeros stays zeros)."""
    h = torch.as_tensor(np.asarray(heat, np.float32))[None, None]
    up = F.interpolate(h, size=(height, width), mode="bilinear", align_corners=False)[0, 0].numpy()
    lo, hi = float(up.min()), float(up.max())
    return ((up - lo) / (hi - lo) if hi > lo else np.zeros_like(up)).astype(np.float32)
