"""Fuse a convolution and the activation after it into one oneDNN call, for the bf16 inference copy of a CNN tower.

After BatchNorm folding (``clip_mini.model.layers.bn_fold``), EfficientNet-Lite0's bf16 pass still swept every feature
map a second time for its ReLU6: a separate, memory-bound clamp, in place as timm builds it, and ATen's in-place bf16
kernels are much slower than its out-of-place ones on CPU. Fusing removes that sweep
(``benchmarks/results/speed/towers.json``, ``activation_fusion_speedup``). oneDNN applies the same clamp as a post-op
while the convolution writes its output; ATen exposes that as ``torch.ops.mkldnn._convolution_pointwise``, the op
inductor's CPU fusion emits for frozen CNNs. The outputs are bitwise the same (a clamp of the same bf16 values).

It is an internal op, so ``fuse_conv_act`` uses it only where it exists and checks its own output against the
unfused module on an example, returning the module unchanged otherwise. The fused module runs the plain
convolution and activation whenever the fused call cannot: off the CPU, or where a graph would be recorded
(an input or a weight that needs a gradient under grad mode: the op has no backward).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

try:
    from timm.layers.conv2d_same import Conv2dSame
    from timm.layers.padding import pad_same
except ImportError:   # an older timm: no dynamic SAME padding to handle
    Conv2dSame, pad_same = (), None


def _post_op(act: nn.Module) -> tuple[str, list[float]] | None:
    """oneDNN's name and scalars for ``act``, or None where it has no post-op."""
    if type(act) is nn.ReLU:
        return "relu", []
    if type(act) in (nn.ReLU6, nn.Hardtanh):
        return "hardtanh", [float(act.min_val), float(act.max_val)]
    return None   # SiLU and GELU would run before the bf16 rounding, so not bitwise equal: fuse_conv_act refuses


def _lone_activation(module: nn.Module) -> nn.Module | None:
    """The activation ``module`` is, or its only non-identity part (bn_fold leaves ``Sequential(act)``)."""
    if isinstance(module, nn.Sequential):
        parts = [m for m in module if not isinstance(m, nn.Identity)]
        return parts[0] if len(parts) == 1 else None
    return module


class ConvAct(nn.Module):
    """``act(conv(x))`` as one oneDNN convolution with the activation as its post-op."""

    def __init__(self, conv: nn.Conv2d, act: nn.Module):
        super().__init__()
        self.conv, self.act = conv, act
        self.attr, self.scalars = _post_op(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or conv.weight.requires_grad)):
            return self.act(conv(x))
        padding = conv.padding
        if isinstance(conv, Conv2dSame):
            x, padding = pad_same(x, conv.weight.shape[-2:], conv.stride, conv.dilation), (0, 0)
        return torch.ops.mkldnn._convolution_pointwise(x, conv.weight, conv.bias, list(padding), list(conv.stride),
                                                        list(conv.dilation), conv.groups, self.attr, self.scalars, "")


def _fuse_in_place(module: nn.Module) -> int:
    fused = 0
    children = list(module.named_children())
    for (name, child), (next_name, nxt) in zip(children, children[1:]):
        act = _lone_activation(nxt)
        if (type(child) in (nn.Conv2d, Conv2dSame) and isinstance(child.padding, tuple)
                and child.padding_mode == "zeros" and act is not None and _post_op(act) is not None):
            setattr(module, name, ConvAct(child, act))
            setattr(module, next_name, nn.Identity())
            fused += 1
    for _, child in module.named_children():
        if not isinstance(child, ConvAct):
            fused += _fuse_in_place(child)
    return fused


def available() -> bool:
    """Whether this torch build has oneDNN's fused convolution op."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
    except (AttributeError, RuntimeError):
        return False


@torch.no_grad()
def fuse_conv_act(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """A copy of eval-mode ``model`` with each convolution -> activation pair (timm's registration order, as in
    ``bn_fold``) run as one fused call; ``model`` itself where nothing fuses, the op is missing, or the copy's
    output on ``example`` (same dtype, device and memory format as the real inputs) is not bitwise equal."""
    if model.training or example.device.type != "cpu" or not available():
        return model
    fused = copy.deepcopy(model)
    if _fuse_in_place(fused) == 0:
        return model
    try:
        same = torch.equal(fused(example), model(example))
    except (RuntimeError, TypeError):   # a layout, dtype or signature this build's op refuses
        return model
    return fused if same else model
