"""Match maps: where in an image a text query matches, as a map over the tower's patch (or feature) grid.

Methods (each returns a (grid_h, grid_w) float32 map, higher where the image matches the text; ``relevance`` and
``occlusion`` on a coarse grid return a finer one):

* ``relevance`` (ViT towers; Chefer, Gur & Wolf 2021, "Generic Attention-model Explainability for Interpreting
  Bi-Modal and Encoder-Decoder Transformers", as their CLIP notebook applies it): every block's attention
  probabilities A, weighted by the gradient of the image-text logit with respect to them and clipped at zero,
  averaged over heads (Abar), accumulated from R = I as R = R + Abar @ R block by block; the map is the class
  token's row of R over the patches. It follows what the class token read back through the tokens that read it.
  A grid coarser than 8 patches a side (the demo's 4 x 4) is refined: the image is read again moved by fractions
  of a patch (edge pixels repeated into the gap, k x k offsets of patch / k pixels, one batched pass; 16 offsets
  at the demo's 16 px patches) and each map moved back, so a cell of patch / k pixels gets the mean of the patches
  that covered it: a (k * grid_h, k * grid_w) map whose peak can fall inside an object smaller than a patch.
* ``gradcam``: the gradient of the image-text cosine similarity with respect to the token states entering the
  ViT's last block, times those states, summed over channels and clipped at zero (Grad-CAM's gradient-times-
  activation, taken per token as in transformer relevance methods). The last block is where the class token (or
  the pooled patches) reads the patches for the final time, so these states are what the embedding was made from.
  For a CNN tower (EfficientNet): classic Grad-CAM on the last feature map (channel weights = mean gradient).
* ``tokens``: each patch token after the final norm projected through the image head on its own and scored
  against the text embedding (for ``cls_mean`` pooling, the token takes the patch-mean's place beside the CLS
  state). Cheap, but only meaningful where the head was trained on patch states.
* ``occlusion`` (every tower): the drop in the image-text cosine when a window of the image is hidden, set to the
  image's per-channel median (its background, on a plain one), read off batched passes with no gradient
  (``torch.inference_mode``). The window slides by a cell, hanging over the edges so every cell is covered as
  often, and a cell gets the mean drop of the windows that covered it; negative where hiding it raises the match
  (the other object, in a two-object scene). A ViT's cells are its relevance map's (patch / k pixels on a coarse
  grid, a patch otherwise) and its window one patch: (16 + 3)^2 = 361 images of 64 px on the demo model; a CNN's
  ``OCCLUSION_CELLS`` cells a side, windows of ``OCCLUSION_WINDOW``.

``auto`` is ``occlusion`` for a ViT tower of a grid coarser than 8 patches a side (the demo's 4 x 4, whose maps
``relevance`` refines), ``relevance`` for a finer ViT grid and ``gradcam`` for a CNN tower. On the benchmark's three
demo models (``configs/tiny.yaml`` trained per seed, 0-2; ``cls`` pooling, 4 x 4 patches; mean over the seeds) with
two objects an image, the occlusion map's peak falls inside the queried object for 0.98 of the queries (lowest seed
0.9675), against 0.7425 for relevance, 0.2242 for Grad-CAM, 0.185 for the text-blind CLS attention (mean over heads
and layers) and a chance rate of 0.0944; with one object, 0.9767 (lowest 0.96) against relevance's 0.905, Grad-CAM's
0.3467 and the CLS attention's 0.5267 (chance 0.1006). On three other models of the same configuration, hiding the
windows otherwise did worse: set to the normalisation mean, 0.9442 (lowest 0.9325) with two objects and 0.9367 (0.91)
with one; patch tokens left out of the sequence (a pass this tower never trained on), 0.6675 (0.6025) and 0.6367
(0.60); cells of half a patch (81 images), 0.965 (0.95) and 0.9183 (0.855). On hand-boxed Flickr8k photos with the
built-in model (12 x 12 patches: not refined), mostly one subject each: relevance 0.8351 against occlusion's 0.7835,
Grad-CAM's 0.5773 and the CLS attention's 0.6495 (chance 0.3431), so ``auto`` keeps relevance for fine grids, where
occlusion also costs most (144 images of 168 px a map: seconds). On the demo model an occlusion map takes about 5
times a relevance map's time, a relevance map about 2 times a Grad-CAM map's (the JSON's ``ms_per_map``)
(``benchmarks/quality/explain_pointing.py``, ``benchmarks/results/quality/explain_pointing.json``).

The gradient is taken with respect to the captured states (or attention probabilities) only: the model's
parameters have ``requires_grad`` off for the call (restored after, whatever they were), so no parameter gradient is
computed or stored, and the model's own ``.grad`` fields are left as they were. Calls on one model from several
threads (``clip-mini serve``) take turns on a per-model lock, since the flags belong to the model; the capturing
hooks act only in the thread that registered them, so other threads' forward passes through the same model (search)
go by untouched; and the ViT attention kernel each pass picks holds for its own thread
(``ImageEncoder._pick_attention``), so a search under inference_mode beside it cannot switch the map's pass to the
fused kernel midway (nor the map's pass the search's; ``relevance`` sets its own pass's blocks to the plain kernel,
whose probabilities it reads, on any device); the text tower's choice is per thread too (``model.text``).
``occlusion`` takes no gradient, sets no flag and hooks nothing: it only embeds images, as a search does.
``unexplainable`` says, before any pass, whether a model's tower has maps at all.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, Literal

import numpy as np
import torch
import torch.nn.functional as F

Method = Literal["auto", "gradcam", "relevance", "tokens", "occlusion"]
METHODS = ("auto", "gradcam", "relevance", "tokens", "occlusion")


def match_map(model, pixels: torch.Tensor, text_features: torch.Tensor, method: Method = "auto") -> np.ndarray:
    """The match map of one preprocessed image against one text embedding.

    Args:
        model: a ``CLIPModel``.
        pixels: (3, S, S) or (1, 3, S, S) preprocessed image.
        text_features: (E,) or (1, E) text embedding (any norm) of the same model.
        method: "auto", "relevance", "gradcam", "tokens" or "occlusion" (see the module docstring).

    Returns:
        (grid_h, grid_w) float32, non-negative (``relevance``, ``gradcam``), cosine scores (``tokens``) or drops
        in cosine (``occlusion``, negative where hiding a region raises the match); a ``relevance`` or ``occlusion``
        map of a grid coarser than 8 a side is k times finer each way (``_shifts``); a CNN tower's ``occlusion``
        map has ``OCCLUSION_CELLS`` cells a side.
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
    if method == "occlusion" or (method == "auto" and visual.cfg.backbone == "vit"
                                 and min(_grid(visual, pixels)) < REFINE_BELOW):
        return _occlusion(model, pixels, text)
    if method in ("auto", "relevance") and visual.cfg.backbone == "vit":
        return _relevance_vit(model, pixels, text)
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


def _relevance_rows(model, pixels: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Chefer et al.'s relevance of each patch to the class token, per image of ``pixels``: (B, N).

    For every block, its attention probabilities A (B, heads, T, T) and the gradient of the image-text logit (the
    cosine times the model's temperature, as their CLIP notebook takes it) with respect to them; per block
    Abar = mean over heads of clamp_min(grad * A, 0), and R = I, then R = R + Abar @ R block by block, in order.
    The images' logits are summed: each image's gradient is its own (no operation mixes the images of a batch).
    """
    t = model.visual.trunk
    blocks = list(t.blocks)
    captured: dict = {}
    probs: list = []
    thread = threading.get_ident()

    def leaf(_module, args):   # the graph starts at the first block's input (the parameters are frozen)
        x = _leaf(captured, thread, args[0])
        return None if x is None else (x, *args[1:])

    def plain(module, _args):
        # the probabilities exist only on timm's plain path (a GPU pass picks the fused kernel): this thread's
        # flag, set just before this block's attention reads it
        if threading.get_ident() == thread and "x" in captured:
            module.fused_attn = False

    def keep(_module, _args, out):   # the softmax output (attn_drop is the identity in eval)
        if threading.get_ident() == thread and "x" in captured and len(probs) < len(blocks):
            probs.append(out)

    handles = [blocks[0].register_forward_pre_hook(leaf)]
    for block in blocks:
        handles += [block.attn.register_forward_pre_hook(plain), block.attn.attn_drop.register_forward_hook(keep)]
    try:
        with _parameters_frozen(model), torch.inference_mode(False), torch.enable_grad():
            image = model.encode_image(pixels.clone(), normalize=True)   # (B, E)
            if len(probs) != len(blocks):
                raise RuntimeError(f"relevance maps read {len(blocks)} blocks' attention, {len(probs)} were seen: "
                                   f"does {type(blocks[0].attn).__name__} call attn_drop on its probabilities?")
            logits = (image @ text[0]).sum() * model.scale().detach().float()
            grads = torch.autograd.grad(logits, probs)
    finally:
        for h in handles:
            h.remove()
    relevance = torch.eye(probs[0].shape[-1], device=pixels.device).expand(pixels.shape[0], -1, -1)   # (B, T, T)
    for attn, grad in zip(probs, grads):
        abar = (grad * attn.detach()).clamp_min(0).mean(1).float()   # (B, T, T)
        relevance = relevance + abar @ relevance
    return relevance[:, 0, t.num_prefix_tokens:]   # the class token's row, over the patches


# Grids coarser than this a side are refined by shifted passes: at 4 x 4 patches a patch is a quarter of the image,
# and an object smaller than a patch rarely holds the centre of the patch it lies in.
REFINE_BELOW = 8
REFINED_CELLS = 16   # a refined map has at least this many cells a side


def _shifts(visual, grid: tuple[int, int]) -> int:
    """``k``: the image is read at k x k offsets of patch / k pixels (1: once). The least divisor of the patch size
    that gives ``REFINED_CELLS`` cells a side, for grids coarser than ``REFINE_BELOW``."""
    if min(grid) >= REFINE_BELOW:
        return 1
    patch = visual.trunk.patch_embed.patch_size[0]
    want = -(-REFINED_CELLS // min(grid))
    return next((k for k in range(want, patch + 1) if patch % k == 0), patch)


def _offsets(k: int) -> list[int]:
    """The k offsets, in steps of patch / k pixels, the image is read at along each axis: as many back as forward
    (-k/2 .. k/2 - 1), so both edges of the image lose the same."""
    return [a - k // 2 for a in range(k)]


def _shifted(pixels: torch.Tensor, patch: int, k: int) -> torch.Tensor:
    """(k*k, 3, H, W): the image moved down by a and right by b steps of patch / k pixels for every (a, b) of
    ``_offsets`` (row-major), the edge pixels repeated into the gap, what moves past the far edge cropped."""
    step, (h, w) = patch // k, pixels.shape[-2:]
    m = (k // 2) * step
    padded = F.pad(pixels, (m, m, m, m), mode="replicate")   # (1, 3, H + 2m, W + 2m)
    return torch.cat([padded[..., m - a * step:m - a * step + h, m - b * step:m - b * step + w]
                      for a in _offsets(k) for b in _offsets(k)])


def _finer(maps: torch.Tensor, k: int) -> torch.Tensor:
    """(k*k, gh, gw) patch maps of ``_shifted``'s images -> (gh*k, gw*k) cells of patch / k pixels: each cell the mean
    of the patches that covered it (patch i of an image moved by a steps covers cells i*k - a .. i*k - a + k - 1; a
    cell near an edge, moved out of some images, takes the mean over those that kept it)."""
    _, gh, gw = maps.shape
    cy, cx = torch.arange(gh * k, device=maps.device), torch.arange(gw * k, device=maps.device)
    total = maps.new_zeros(gh * k, gw * k)
    count = maps.new_zeros(gh * k, gw * k)
    offsets = _offsets(k)
    for n in range(k * k):
        a, b = offsets[n // k], offsets[n % k]
        iy, ix = torch.div(cy + a, k, rounding_mode="floor"), torch.div(cx + b, k, rounding_mode="floor")
        seen = (((iy >= 0) & (iy < gh))[:, None] & ((ix >= 0) & (ix < gw))[None, :]).to(maps.dtype)
        total += maps[n][iy.clamp(0, gh - 1)][:, ix.clamp(0, gw - 1)] * seen
        count += seen
    return total / count


def _relevance_vit(model, pixels: torch.Tensor, text: torch.Tensor) -> np.ndarray:
    visual = model.visual
    grid = _grid(visual, pixels)
    k = _shifts(visual, grid)
    batch = _shifted(pixels, visual.trunk.patch_embed.patch_size[0], k) if k > 1 else pixels
    maps = _relevance_rows(model, batch, text).reshape(-1, *grid)   # (k*k, gh, gw)
    heat = _finer(maps, k) if k > 1 else maps[0]
    return heat.cpu().numpy().astype(np.float32)


OCCLUSION_CELLS = 16   # a CNN tower's occlusion map: cells a side
OCCLUSION_WINDOW = 4   # a CNN tower's occluding window: cells a side
OCCLUSION_BATCH = 64   # occluded images per forward pass


def _occlusion(model, pixels: torch.Tensor, text: torch.Tensor, span: int = 1, fill: str = "median") -> np.ndarray:
    """The occlusion map's geometry: a ViT's cells are its relevance map's (a patch, or patch / k on a coarse grid)
    and its window ``span`` patches a side; a CNN's cells are ``OCCLUSION_CELLS`` a side and its window
    ``OCCLUSION_WINDOW`` cells."""
    visual = model.visual
    if visual.cfg.backbone == "vit":
        grid = _grid(visual, pixels)
        k = _shifts(visual, grid)
        cells, window = (grid[0] * k, grid[1] * k), span * k
    else:
        cells, window = (OCCLUSION_CELLS, OCCLUSION_CELLS), OCCLUSION_WINDOW
    return _occlusion_pixels(model, pixels, text, cells, window, fill)


def _cosines(model, pixels: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    return model.encode_image(pixels, normalize=True).float() @ text[0]


@torch.inference_mode()
def _occlusion_pixels(model, pixels: torch.Tensor, text: torch.Tensor, cells: tuple[int, int], window: int,
                      fill: str = "median") -> np.ndarray:
    """The drop in image-text cosine when a window of ``window`` x ``window`` cells (cell edges at ``i * H // cells``)
    is set to ``fill`` ("median": the image's per-channel median, its background on a plain one; "mean": the
    normalisation mean, 0 here), at every cell offset including those that hang over an edge, so every cell is
    covered by ``window`` squared windows; a cell's score is their mean drop. One pass for the image and one per
    ``OCCLUSION_BATCH`` occluded images."""
    if fill not in ("median", "mean"):
        raise ValueError(f"occlusion fill must be median or mean, got {fill!r}")
    h, w = pixels.shape[-2:]
    ch, cw = cells
    ey = [i * h // ch for i in range(ch + 1)]
    ex = [j * w // cw for j in range(cw + 1)]
    value = (pixels[0].flatten(1).median(1).values if fill == "median"
             else pixels.new_zeros(pixels.shape[1]))[:, None, None]                        # (3, 1, 1)
    spots = [(a, b) for a in range(1 - window, ch) for b in range(1 - window, cw)]
    base = _cosines(model, pixels, text)[0]
    drops = []
    for start in range(0, len(spots), OCCLUSION_BATCH):
        chunk = spots[start:start + OCCLUSION_BATCH]
        images = pixels.repeat(len(chunk), 1, 1, 1)
        for n, (a, b) in enumerate(chunk):
            y0, y1 = ey[max(a, 0)], ey[min(a + window, ch)]
            x0, x1 = ex[max(b, 0)], ex[min(b + window, cw)]
            images[n, :, y0:y1, x0:x1] = value
        drops.append(base - _cosines(model, images, text))
    drop = torch.cat(drops).reshape(ch + window - 1, cw + window - 1)
    # cell (y, x) is covered by the windows at offsets y - window + 1 .. y: a window-sized box sum of ``drop``
    heat = F.avg_pool2d(drop[None, None], window, stride=1)[0, 0]                          # (ch, cw)
    return heat.cpu().numpy().astype(np.float32)


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
    if method == "occlusion":
        return None   # every tower: only its forward pass is read
    if method == "relevance" and backbone != "vit":
        return f"relevance maps need a ViT image tower, this model uses {backbone}"
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
