"""Compute precision: one autocast helper shared by training, evaluation and the feature passes."""
from __future__ import annotations

import torch


def autocast(device: torch.device, precision: str):
    """bf16 autocast context for ``precision == "bf16"``, a no-op context for fp32."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
