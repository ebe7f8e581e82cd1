"""A fine-tuned model as a small delta over the pretrained towers it started from, and back.

The towers (DINOv2 ViT-S/14, MiniLM-L6) come from PyPI packages; what training changed is ours to ship. A full
fp16 copy of the trained tensors would be ~75 MB, so the delta stores, per tensor of the state dict:

* ``KEY`` -- the difference ``trained - base`` in fp16, for small tensors (norms, biases, positions);
* ``KEY@whole`` -- a tensor the base does not have (the heads, the temperature), stored as it is;
* ``KEY@a`` / ``KEY@b`` -- a rank-r factorisation ``b @ a`` of the difference of a large matrix (truncated SVD,
  the "LoRA extraction" of a full fine-tune), each factor holding the square roots of the singular values; a
  matrix is factorised only when its factors take at most half the bytes of its fp16 difference;
* ``KEY@rows`` / ``KEY@values`` / ``KEY@scale`` -- an embedding table: every row is scaled by ``scale`` (the
  weight decay of rows whose tokens never occurred in training), and the rows that training moved beyond that
  get their own difference.

Factors and moved rows are fp16, or int8 (``make_delta(..., factors="int8")``, about half the bytes) with a
symmetric float32 scale beside each: ``KEY@b_scale`` per row of ``b`` (the matrix's output rows), ``KEY@a_scale``
per column of ``a`` (its input columns), ``KEY@values_scale`` per moved row; the stored value is ``int8 * scale``
(about 1% of ``b @ a``, well under a thousandth of the weight it is added to). Tensors that training left unchanged
are not stored. The cost of each approximation is measured on val by ``benchmarks/quality/ship_photo_model.py``; ``apply_delta`` always computes in fp32.
"""
from __future__ import annotations

from typing import Mapping

import torch

from clip_mini.errors import ModelDirError

FACTOR_BYTES = {"fp16": 2, "int8": 1}   # bytes per stored value of the factors and moved rows
EMBEDDING_MIN_ROWS = 4096   # a matrix with at least this many rows, each a token, is an embedding table
MOVED_ROW_FACTOR = 1.5  # a row is stored when its relative change exceeds this many times the decay-only rows'


def _is_embedding(key: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and t.shape[0] >= EMBEDDING_MIN_ROWS and "embed" in key


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-d) as int8 values and a float32 scale per row, symmetric: ``x ~ q * scale[:, None]``."""
    scale = x.abs().amax(1) / 127
    q = (x / torch.where(scale > 0, scale, 1)[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale.float()


def _store(name: str, x: torch.Tensor, factors: str, per_column: bool = False) -> dict[str, torch.Tensor]:
    if factors == "fp16":
        return {name: x.half().contiguous()}
    q, scale = _int8_rows(x.T if per_column else x)
    return {name: (q.T if per_column else q).contiguous(), f"{name}_scale": scale}


def make_delta(trained: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
               rank: int, factors: str = "fp16") -> dict[str, torch.Tensor]:
    """The delta that turns ``base`` into (an approximation of) ``trained``; ``rank`` bounds each factorisation,
    ``factors`` ("fp16" or "int8") is how the factors and the embedding table's moved rows are stored."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if factors not in FACTOR_BYTES:
        raise ValueError(f"factors must be one of {sorted(FACTOR_BYTES)}, got {factors!r}")
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
            out.update(_embedding_delta(key, t, b, factors))
        elif t.ndim == 2 and rank * sum(t.shape) * FACTOR_BYTES[factors] <= t.numel():
            u, s, vh = torch.linalg.svd(diff, full_matrices=False)
            root = s[:rank].sqrt()
            out.update(_store(f"{key}@b", u[:, :rank] * root, factors))
            out.update(_store(f"{key}@a", root[:, None] * vh[:rank], factors, per_column=True))
        else:
            out[key] = diff.half()
    return out


def _embedding_delta(key: str, t: torch.Tensor, b: torch.Tensor, factors: str) -> dict[str, torch.Tensor]:
    norms = (b * b).sum(1).clamp_min(1e-12)
    scale_per_row = (t * b).sum(1) / norms            # decay alone leaves each row at a common multiple of itself
    scale = scale_per_row.median()
    rest = t - b * scale
    moved = rest.norm(dim=1) / norms.sqrt()
    floor = (t - b).norm(dim=1).div(norms.sqrt()).median()
    rows = torch.nonzero(moved > MOVED_ROW_FACTOR * floor.clamp_min(1e-8)).flatten()
    return {f"{key}@scale": scale.reshape(1).float(), f"{key}@rows": rows.to(torch.int64),
            **_store(f"{key}@values", rest[rows], factors)}


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
        elif {"a", "b"} <= set(parts) <= {"a", "b", "a_scale", "b_scale"}:
            low = _stored(key, parts, "b") @ _stored(key, parts, "a", per_column=True)
            if low.shape != w.shape:
                raise ModelDirError(f"the delta's factors for {key!r} give {tuple(low.shape)}, "
                                    f"the model has {tuple(w.shape)}")
            state[key] = w + low
        elif {"rows", "values", "scale"} <= set(parts) <= {"rows", "values", "scale", "values_scale"}:
            rows, values = parts["rows"].long(), _stored(key, parts, "values")
            if values.shape[1:] != w.shape[1:] or len(rows) != len(values) or (len(rows) and rows.max() >= len(w)):
                raise ModelDirError(f"the delta's rows for {key!r} do not fit its shape {tuple(w.shape)}")
            w = w * parts["scale"].float()
            w[rows] += values
            state[key] = w
        else:
            raise ModelDirError(f"the delta stores {sorted(parts)} for {key!r}; expected a/b (int8 with "
                                "a_scale/b_scale), rows/values/scale (int8 values with values_scale), whole or one "
                                "difference")
    return state


def _stored(key: str, parts: Mapping[str, torch.Tensor], name: str, per_column: bool = False) -> torch.Tensor:
    """The fp32 value of part ``name`` of ``key``'s group: a float as it is, an int8 times its ``name_scale``."""
    value, scale = parts[name], parts.get(f"{name}_scale")
    if value.dtype != torch.int8:
        if scale is not None:
            raise ModelDirError(f"the delta's {name} for {key!r} is {value.dtype}, yet it has a {name}_scale")
        return value.float()
    if scale is None:
        raise ModelDirError(f"the delta's {name} for {key!r} is int8 without its {name}_scale")
    n = value.shape[1 if per_column else 0] if value.ndim == 2 else None
    if n is None or tuple(scale.shape) != (n,) or not scale.is_floating_point():
        raise ModelDirError(f"the delta's {name}_scale for {key!r} has shape {tuple(scale.shape)} "
                            f"({scale.dtype}); its int8 {name} of shape {tuple(value.shape)} needs one float per "
                            f"{'column' if per_column else 'row'}")
    return value.float() * (scale.float() if per_column else scale.float()[:, None])


def delta_bytes(delta: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in delta.values())
