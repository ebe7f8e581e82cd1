"""Fold eval-mode BatchNorm into the convolution before it, for an inference-only copy of a CNN tower.

A locked EfficientNet-Lite0 spends much of its bf16 pass in BatchNorm: each one is a separate, memory-bound sweep
over a feature map, after a convolution that could have applied the same per-channel affine map for free
(``benchmarks/results/speed/towers.json``, ``bn_folding_speedup``). In eval mode ``bn(conv(x)) = conv'(x)`` with
``w' = w * g / sqrt(v + eps)`` and ``b' = (b - m) * g / sqrt(v + eps) + beta``.

timm's CNNs register each BatchNorm right after the convolution it follows (``conv_dw, bn1``, ``conv_pw, bn2``...),
which is the pattern folded here; ``fold_batchnorm`` checks its own output against the unfolded module and refuses
(returns the model unchanged) if they disagree, so an architecture that breaks the pattern is never mis-folded.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn


def _fold_pair(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
    scale = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
    bias = conv.bias.detach() if conv.bias is not None else torch.zeros_like(bn.running_mean)
    conv.weight = nn.Parameter(conv.weight.detach() * scale.view(-1, 1, 1, 1), requires_grad=False)
    conv.bias = nn.Parameter((bias - bn.running_mean) * scale + bn.bias.detach(), requires_grad=False)


def _after_norm(bn: nn.BatchNorm2d) -> nn.Module:
    """What is left of ``bn`` once its affine map lives in the convolution: timm's BatchNormAct2d keeps its act."""
    drop, act = getattr(bn, "drop", None), getattr(bn, "act", None)
    parts = [m for m in (drop, act) if m is not None and not isinstance(m, nn.Identity)]
    return nn.Sequential(*parts) if parts else nn.Identity()


def _fold_in_place(module: nn.Module) -> int:
    folded = 0
    children = list(module.named_children())
    for (name, child), (next_name, nxt) in zip(children, children[1:]):
        if (isinstance(child, nn.Conv2d) and isinstance(nxt, nn.BatchNorm2d) and nxt.affine
                and nxt.track_running_stats and nxt.running_var is not None
                and child.out_channels == nxt.num_features):
            _fold_pair(child, nxt)
            setattr(module, next_name, _after_norm(nxt))
            folded += 1
    for _, child in module.named_children():
        folded += _fold_in_place(child)
    return folded


@torch.no_grad()
def fold_batchnorm(model: nn.Module, example: torch.Tensor, atol: float = 1e-4) -> nn.Module:
    """A copy of eval-mode ``model`` (fp32) with every conv -> BatchNorm pair folded, or ``model`` itself when
    nothing folds or the folded copy's output on ``example`` differs by more than ``atol`` (relative to its scale;
    a warning says so).

    The check runs with TF32 off: on a GPU where it is on (``runtime.devices.enable_tf32``), two fp32 passes that
    sum in different orders differ by TF32's 10-bit mantissa, far above ``atol``, and every fold would be refused.
    """
    from clip_mini.runtime.devices import tf32_disabled

    if model.training:
        raise ValueError("fold_batchnorm needs an eval-mode model (training BatchNorm uses batch statistics)")
    folded = copy.deepcopy(model)
    if _fold_in_place(folded) == 0:
        return model
    with tf32_disabled():
        reference, got = model(example), folded(example)
    err, limit = (got - reference).abs().max().item(), atol * max(1.0, reference.abs().max().item())
    if not err <= limit:
        warnings.warn(f"BatchNorm folding of {type(model).__name__} refused: the folded copy differs by {err:.3g} "
                      f"(limit {limit:.3g}); the tower runs unfolded (slower, same values)", RuntimeWarning,
                      stacklevel=2)
        return model
    return folded
