"""A fine-tuned model as a small delta over the pretrained towers it started from, and back.

The towers (DINOv2 ViT-S/14, MiniLM-L6) come from PyPI packages; what training changed is ours to ship. A full
fp16 copy of the trained tensors would be ~75 MB, so the delta stores, per tensor of the state dict:

* ``KEY`` -- the difference ``trained - base`` in fp16, for small tensors (norms, biases, positions);
* ``KEY@whole`` -- a tensor the base does not have (the heads, the temperature), stored as it is;
* ``KEY@a`` / ``KEY@b`` -- a rank-r factorisation ``b @ a`` of the difference of a large matrix (truncated SVD,
  the "LoRA extraction" of a full fine-tune);
* ``KEY@rows`` / ``KEY@values`` / ``KEY@scale`` -- an embedding table: every row is scaled by ``scale`` (the
  weight decay of rows whose tokens never occurred in training), and the rows that training moved beyond that
  get their own fp16 difference.

Tensors that training left unchanged are not stored. The cost of each approximation is measured on val by
``benchmarks/quality/ship_photo_model.py``; ``apply_delta`` always computes in fp32.
"""
from __future__ import annotations

from typing import Mapping

import torch

from clip_mini.errors import ModelDirError

LOW_RANK_MIN = 4        # a matrix is factorised only when rank * LOW_RANK_MIN <= its smaller side
EMBEDDING_MIN_ROWS = 4096   # a matrix with at least this many rows, each a token, is an embedding table
MOVED_ROW_FACTOR = 1.5  # a row is stored when its relative change exceeds this many times the decay-only rows'


def _is_embedding(key: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and t.shape[0] >= EMBEDDING_MIN_ROWS and "embed" in key


def make_delta(trained: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
               rank: int) -> dict[str, torch.Tensor]:
    """The delta that turns ``base`` into (an approximation of) ``trained``; ``rank`` bounds each factorisation."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    out: dict[str, torch.Tensor] = {}
    for key, value in trained.items():
        t = value.detach().float().cpu()
        b = base.get(key)
        if b is None or tuple(b.shape) != tuple(t.shape):
            out[f"{key}@whole"] = t.half() if t.is_floating_point() and t.ndim else value.detach().cpu().clone()
            continue
        b = b.detach().float().cpu()
        if not t.is_floating_point() or torch.equal(t, b):
            continue
        diff = t - b
        if _is_embedding(key, t):
            out.update(_embedding_delta(key, t, b))
        elif t.ndim == 2 and rank * LOW_RANK_MIN <= min(t.shape):
            u, s, vh = torch.linalg.svd(diff, full_matrices=False)
            root = s[:rank].sqrt()
            out[f"{key}@b"] = (u[:, :rank] * root).half().contiguous()
            out[f"{key}@a"] = (root[:, None] * vh[:rank]).half().contiguous()
        else:
            out[key] = diff.half()
    return out


def _embedding_delta(key: str, t: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    norms = (b * b).sum(1).clamp_min(1e-12)
    scale_per_row = (t * b).sum(1) / norms            # decay alone leaves each row at a common multiple of itself
    scale = scale_per_row.median()
    rest = t - b * scale
    moved = rest.norm(dim=1) / norms.sqrt()
    floor = (t - b).norm(dim=1).div(norms.sqrt()).median()
    rows = torch.nonzero(moved > MOVED_ROW_FACTOR * floor.clamp_min(1e-8)).flatten()
    return {f"{key}@scale": scale.reshape(1).float(), f"{key}@rows": rows.to(torch.int64),
            f"{key}@values": rest[rows].half().contiguous()}


def apply_delta(base: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``base`` with ``delta`` applied (a new fp32 state dict); a delta key that names no tensor is an error."""
    state = {k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone() for k, v in base.items()}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in delta.items():
        key, _, part = name.partition("@")
        groups.setdefault(key, {})[part] = value
    for key, parts in groups.items():
        if set(parts) == {"whole"}:
            value = parts["whole"]
            state[key] = value.float() if value.is_floating_point() else value.clone()
            continue
        if key not in state:
            raise ModelDirError(f"the delta changes {key!r}, which the model does not have")
        w = state[key]
        if set(parts) == {""}:
            if tuple(parts[""].shape) != tuple(w.shape) or not w.is_floating_point():
                raise ModelDirError(f"the delta's difference for {key!r} has shape {tuple(parts[''].shape)}, "
                                    f"the model's tensor {tuple(w.shape)}")
            state[key] = w + parts[""].float()
        elif set(parts) == {"a", "b"}:
            low = parts["b"].float() @ parts["a"].float()
            if low.shape != w.shape:
                raise ModelDirError(f"the delta's factors for {key!r} give {tuple(low.shape)}, "
                                    f"the model has {tuple(w.shape)}")
            state[key] = w + low
        elif set(parts) == {"rows", "values", "scale"}:
            rows, values = parts["rows"].long(), parts["values"].float()
            if values.shape[1:] != w.shape[1:] or len(rows) != len(values) or (len(rows) and rows.max() >= len(w)):
                raise ModelDirError(f"the delta's rows for {key!r} do not fit its shape {tuple(w.shape)}")
            w = w * parts["scale"].float()
            w[rows] += values
            state[key] = w
        else:
            raise ModelDirError(f"the delta stores {sorted(parts)} for {key!r}; expected a@b, rows/values/scale, "
                                "whole or one difference")
    return state


def delta_bytes(delta: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in delta.values())
