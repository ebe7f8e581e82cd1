"""Forward and backward for one optimiser step, with contrastive-aware gradient accumulation.

Averaging the gradients of k micro-batches would train on k small contrastive problems (each caption meets only
B - 1 negatives). Instead, as open_clip's ``accum_freq`` does, the features of all k micro-batches are first
computed without gradient; then each micro-batch is re-forwarded with gradient and the loss over the whole
accumulated batch is built from its fresh features and the cached ones of the others. The k backward passes
add up to exactly the gradient of the loss of one batch of k * B pairs.

Two details make the sum exact where open_clip's is not:

* ``logit_scale`` enters every one of the k losses, so its gradient would be counted k times; it is detached in
  all but the last re-forward.
* dropout draws new masks on the second forward; the RNG state of each micro-batch's first forward is restored
  for its re-forward, so the fresh features equal the cached ones.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from clip_mini.runtime.precision import autocast  # noqa: F401  (re-exported: the trainer's modules import it here)

Batch = dict[str, torch.Tensor]


class FeatureModel(nn.Module):
    """Thin wrapper that DDP wraps: ``forward`` returns ``(image_features, text_features, logit_params)``, the last
    being ``CLIPModel.logit_params()`` (the temperature, and with ``train.loss: siglip`` the bias too).

    DDP only tracks parameters used through its own ``forward``, so the two encoders are reached from here
    rather than by calling ``model.encode_image`` on the unwrapped model.
    """

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip

    def forward(self, pixels: Optional[torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                tower_features: Optional[torch.Tensor] = None, text_tower: Optional[torch.Tensor] = None):
        # tower_features: a locked image tower's precomputed outputs (train.frozen_features) replace the pixels;
        # (B, T, D) token states of its locked first blocks go through the trainable last ones first
        if tower_features is not None and tower_features.ndim == 3:
            tower_features = self.clip.visual.forward_suffix(tower_features)   # (B, width)
        image_features = (self.clip.encode_image(pixels) if tower_features is None
                          else self.clip.project_image(tower_features))          # (B, E)
        # text_tower: a locked text tower's precomputed [CLS] rows (clip_mini.train.text_cache)
        text_features = (self.clip.encode_text(input_ids, attention_mask) if text_tower is None
                         else self.clip.project_text(text_tower))              # (B, E)
        return image_features, text_features, self.clip.logit_params()


def _rng_get(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _rng_set(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _text_ids(batches: Sequence[Batch]) -> dict:
    """``{"text_ids": ...}`` when the batches carry several captions per image (train.captions_per_image), else {}:
    a plain ``f(image_features, text_features, logit_params, ids)`` loss keeps working."""
    if "text_ids" not in batches[0]:
        return {}
    return {"text_ids": torch.cat([b["text_ids"] for b in batches])}


def _features(model: nn.Module, batch: Batch, device: torch.device, precision: str):
    with autocast(device, precision):
        image_features, text_features, scale = model(batch.get("pixels"), batch["input_ids"], batch["attention_mask"],
                                                     batch.get("tower_features"), batch.get("text_tower"))
    # The loss (softmax over up to a few thousand logits) is computed in fp32 whatever the tower precision.
    return image_features.float(), text_features.float(), scale.float()


def forward_backward(model: nn.Module, batches: Sequence[Batch], loss_fn: Callable, device: torch.device,
                     precision: str = "fp32", scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor:
    """Run forward and backward for one optimiser step; gradients are accumulated into ``.grad``.

    Args:
        model: ``FeatureModel`` (optionally wrapped in DDP).
        batches: the step's micro-batches (dicts from ``CaptionCollate``, already on ``device``).
        loss_fn: ``ClipLoss`` or ``SigLipLoss`` (both gather across ranks), or any
            ``f(image_features, text_features, logit_params, ids)``.
        device: where the batches live (selects the autocast and RNG flavour).
        precision: "fp32", "bf16" or "fp16" (autocast for the towers).
        scaler: fp16's GradScaler: gradients are accumulated scaled (the caller unscales before clipping).

    Returns:
        The loss of the whole (accumulated, and under DDP global) batch, detached (unscaled).
    """
    def backward(loss: torch.Tensor) -> None:
        (scaler.scale(loss) if scaler is not None else loss).backward()

    if len(batches) == 1:
        b = batches[0]
        image_features, text_features, scale = _features(model, b, device, precision)
        loss = loss_fn(image_features, text_features, scale, b["image_ids"], **_text_ids(batches))
        backward(loss)
        return loss.detach()

    # 1) Features of every micro-batch without gradient: the negatives each re-forward is contrasted with.
    rng_states, cached_image, cached_text = [], [], []
    with torch.no_grad():
        for b in batches:
            rng_states.append(_rng_get(device))
            image_features, text_features, _ = _features(model, b, device, precision)
            cached_image.append(image_features)
            cached_text.append(text_features)
    rng_after = _rng_get(device)
    image_ids = torch.cat([b["image_ids"] for b in batches])
    text_ids = _text_ids(batches)

    # 2) Re-forward each micro-batch with gradient (same dropout masks) and back-propagate the full-batch loss
    #    through its own features only. DDP synchronises gradients on the last backward alone.
    last = len(batches) - 1
    for j, b in enumerate(batches):
        _rng_set(rng_states[j], device)
        sync = model.no_sync() if j < last and hasattr(model, "no_sync") else nullcontext()
        with sync:
            image_features, text_features, scale = _features(model, b, device, precision)
            if j < last:
                scale = scale.detach()   # logit_scale's (and logit_bias's) gradient is taken once, in the last pass
            all_image = torch.cat(cached_image[:j] + [image_features] + cached_image[j + 1:])   # (k*B, E)
            all_text = torch.cat(cached_text[:j] + [text_features] + cached_text[j + 1:])       # (k*B, E)
            loss = loss_fn(all_image, all_text, scale, image_ids, **text_ids)
            backward(loss)
    _rng_set(rng_after, device)
    return loss.detach()
