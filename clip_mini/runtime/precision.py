"""Compute precision: one autocast helper shared by training, evaluation and the feature passes."""
from __future__ import annotations

import torch


def autocast(device: torch.device, precision: str):
    """Autocast for ``device``'s type: bf16 for ``"bf16"``, fp16 for ``"fp16"`` (GPUs without bf16; training pairs it
    with a GradScaler), a no-op context for fp32."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=precision in ("bf16", "fp16"))
