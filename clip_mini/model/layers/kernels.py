"""Which attention kernel the towers run: fused ``scaled_dot_product_attention``, or matmul + softmax + matmul.

On CPU, the kernel ``scaled_dot_product_attention`` picks (ATen's flash attention) has a slow backward at these
towers' sizes (24 to 257 tokens, head width 32 to 64): it is a large share of the model-only training step at
open_clip's tiny-CLIP size, and the plain attention (timm's and transformers' own non-fused paths, the same
arithmetic) makes the whole step much faster (``benchmarks/results/speed/train.json``). Its forward is as fast as
the plain one, and faster on long sequences (257 tokens: DINOv2 ViT-S/14 at 224 px), so passes that
record no graph (``torch.inference_mode``: evaluation, indexing, the frozen-feature pass) keep it, as does any GPU.

``torch.no_grad`` counts as training here: gradient accumulation's first, gradient-free pass must run the same
kernel as its re-forward, or the cached and fresh features of a micro-batch would differ in the last bits.
"""
from __future__ import annotations

import torch


def fused_attention(x: torch.Tensor) -> bool:
    """Whether a tower pass over input ``x`` should use the fused kernel (see the module docstring)."""
    return x.device.type != "cpu" or torch.is_inference_mode_enabled()
