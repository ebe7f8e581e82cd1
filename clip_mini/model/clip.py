"""CLIPModel: image and text towers, projection heads, learnable temperature, and the model directory format.

Model directory (no pickle anywhere): ``config.json``, ``model.safetensors``, tokenizer files, ``preprocess.json``
and ``manifest.json`` (sha256 of every file plus a fingerprint that identifies the model for indexes).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from clip_mini.config import ConfigError, ModelConfig, PreprocessConfig, TextConfig, VisionConfig, from_dict
from clip_mini.fileio.atomic import atomic_dir, atomic_write_json, sha256_file
from clip_mini.fileio.manifest import (MODEL_FILES, ModelDirError, fingerprint as _fingerprint, model_fingerprint,
                                 read_json as _read_json, read_manifest)
from clip_mini.model.text import TextEncoder, build_tokenizer, load_tokenizer, resolve_text_config
from clip_mini.runtime.precision import autocast
from clip_mini.model.vision import ImageEncoder, inference_tower, pixel_dtype, tower_input

FORMAT_VERSION = 1


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """L2-normalise rows in fp32: under bf16 autocast ``F.normalize`` returns bf16 rows whose norms are off by
    up to a few 1e-3, enough to reorder near-tied retrieval scores. (B, E) -> (B, E) float32."""
    return F.normalize(x.float(), dim=-1)


class ProjectionHead(nn.Module):
    """Map a tower's features into the shared space: linear, or Linear→GELU→Linear + residual + LayerNorm."""

    def __init__(self, in_dim: int, out_dim: int, kind: str = "mlp", dropout: float = 0.1):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(in_dim, out_dim)
        if kind == "mlp":
            self.fc = nn.Linear(out_dim, out_dim)
            self.drop = nn.Dropout(dropout)
            self.norm = nn.LayerNorm(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        if self.kind == "linear":
            return x
        return self.norm(x + self.drop(self.fc(F.gelu(x))))


class CLIPModel(nn.Module):
    """Dual encoder. ``forward`` returns (logits_per_image, logits_per_text); the loss lives in ``loss.py``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_token_id: int = 0, tokenizer: Any = None):
        super().__init__()
        cfg = dataclasses.replace(cfg, text=resolve_text_config(cfg.text))
        self.cfg = cfg
        self.vocab_size, self.pad_token_id = vocab_size, pad_token_id
        self.tokenizer = tokenizer
        self.visual = ImageEncoder(cfg.vision)
        self.text = TextEncoder(cfg.text, vocab_size, pad_token_id)
        self.image_head = ProjectionHead(self.visual.width, cfg.embed_dim, cfg.head, cfg.head_dropout)
        self.text_head = ProjectionHead(self.text.width, cfg.embed_dim, cfg.head, cfg.head_dropout)
        self.logit_scale = nn.Parameter(torch.tensor(float(cfg.init_logit_scale)))
        self.logit_bias = (None if cfg.init_logit_bias is None   # SigLIP's (train.loss: siglip)
                           else nn.Parameter(torch.tensor(float(cfg.init_logit_bias))))
        self.preprocess = self.visual.preprocess
        apply_trainable(self)

    # -- encoders -------------------------------------------------------------------------------------------
    def encode_image(self, pixels: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.project_image(self.visual(pixels), normalize)

    def project_image(self, tower_features: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """The image side after the tower: (B, tower width) -> (B, E). Used with precomputed tower outputs."""
        image_features = self.image_head(tower_features)  # (B, E)
        return _unit_rows(image_features) if normalize else image_features

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    normalize: bool = True) -> torch.Tensor:
        return self.project_text(self.text(input_ids, attention_mask), normalize)

    def project_text(self, tower_features: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """The text side after the tower: (B, tower width) -> (B, E). Used with precomputed tower outputs."""
        text_features = self.text_head(tower_features)  # (B, E)
        return _unit_rows(text_features) if normalize else text_features

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        image_features = self.encode_image(pixels)
        text_features = self.encode_text(input_ids, attention_mask)
        logits_per_image = self.scale() * image_features @ text_features.T  # (B_img, B_txt)
        return logits_per_image, logits_per_image.T

    def scale(self) -> torch.Tensor:
        """exp(logit_scale), clamped in the forward pass too so a stray step can never exceed the cap."""
        return self.logit_scale.clamp(max=self.cfg.max_logit_scale).exp()

    def logit_params(self) -> torch.Tensor:
        """What the loss takes besides the features: ``scale()``, or ``[scale(), logit_bias]`` with a bias."""
        if self.logit_bias is None:
            return self.scale()
        return torch.stack([self.scale(), self.logit_bias])

    @torch.no_grad()
    def clamp_logit_scale(self) -> None:
        self.logit_scale.clamp_(0.0, self.cfg.max_logit_scale)

    # -- building -------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ModelConfig, captions=None, load_pretrained: bool = True, tokenizer=None) -> "CLIPModel":
        """The one model builder (training, tests, tools): the model around ``tokenizer`` (default: one made from
        the config, trained on ``captions`` if from scratch), with the config's local pretrained weights loaded."""
        if tokenizer is None:
            tokenizer = build_tokenizer(cfg.text, captions)
        model = cls(cfg, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
        if load_pretrained and cfg.vision.pretrained:
            model.visual.load_pretrained(cfg.vision.pretrained)
        if load_pretrained and cfg.text.pretrained:
            model.text.load_pretrained(cfg.text.pretrained)
        return model

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if self.tokenizer is None:
            raise RuntimeError("this model has no tokenizer attached")
        return self.tokenizer(list(captions), padding="longest", truncation=True,
                              max_length=self.cfg.text.max_length, return_tensors="pt")

    # -- model directory ------------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, extra: Optional[dict] = None) -> str:
        """Write a complete model directory atomically; returns the fingerprint. The towers' ONNX export (what
        torch-free queries run) is made by ``model.onnx_export.export_if_missing``, or on first use."""
        from safetensors.torch import save_file

        from clip_mini.version import __version__

        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with atomic_dir(out_dir) as tmp:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config = {"clip_mini_version": __version__, "format_version": FORMAT_VERSION,
                      "model": dataclasses.asdict(self.cfg), "vocab_size": self.vocab_size,
                      "pad_token_id": self.pad_token_id, **(extra or {})}
            atomic_write_json(tmp / "config.json", config)
            atomic_write_json(tmp / "preprocess.json", dataclasses.asdict(self.preprocess))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp))
            files = sorted(p.name for p in tmp.iterdir() if p.is_file())
            checksums = {name: sha256_file(tmp / name) for name in files}
            fingerprint = _fingerprint(checksums)
            atomic_write_json(tmp / "manifest.json", {"format_version": FORMAT_VERSION, "files": checksums,
                                                      "fingerprint": fingerprint})
        return fingerprint

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, verify: bool = True) -> "CLIPModel":
        """Load a model directory written by ``save_pretrained``; checksums are verified unless ``verify=False``."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        manifest = read_manifest(model_dir, verify=verify)
        mcfg, vocab_size, pad_id = read_model_config(model_dir)
        # Weights come from model.safetensors only: __init__ never reads the pretrained sources in the config.
        tokenizer = load_tokenizer(model_dir) if "tokenizer.json" in manifest["files"] else None
        model = cls(mcfg, vocab_size=vocab_size, pad_token_id=pad_id, tokenizer=tokenizer)
        try:
            state = load_file(str(model_dir / "model.safetensors"))
            model.load_state_dict(state)
        except (SafetensorError, RuntimeError, OSError) as e:
            raise ModelDirError(f"{model_dir / 'model.safetensors'}: cannot load weights: {e}") from None
        model.preprocess = read_preprocess(model_dir)
        model.fingerprint = manifest["fingerprint"]
        return model.eval()


def read_model_config(model_dir: Path) -> tuple[ModelConfig, int, int]:
    """A model directory's (or built-in package's) ``config.json``: ``(model config, vocab_size, pad_token_id)``."""
    config = _read_json(model_dir / "config.json")
    try:
        return (from_dict(ModelConfig, config["model"], "model."), int(config["vocab_size"]),
                int(config["pad_token_id"]))
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise ModelDirError(f"{model_dir / 'config.json'}: bad model config: {e}") from None


def read_preprocess(model_dir: Path) -> PreprocessConfig:
    """A model directory's ``preprocess.json``, checked field by field."""
    try:
        return from_dict(PreprocessConfig, _read_json(model_dir / "preprocess.json"), "preprocess.")
    except ConfigError as e:
        raise ModelDirError(f"{model_dir / 'preprocess.json'}: {e}") from None


def apply_trainable(model: CLIPModel) -> None:
    """Freeze a tower whose config says ``trainable: false`` (LiT-style: heads and temperature still train)."""
    for tower, trainable in ((model.visual, model.cfg.vision.trainable), (model.text, model.cfg.text.trainable)):
        for p in tower.parameters():
            p.requires_grad_(trainable)


__all__ = ["CLIPModel", "ProjectionHead", "ModelDirError", "read_manifest", "model_fingerprint",
           "VisionConfig", "TextConfig"]


class ImageForward:
    """Pixels -> unit image embeddings for a pass without gradients: indexing, evaluation, the indexing benchmark.

    Under bf16 the tower is a bf16-weight copy run without autocast (``vision.inference_tower``: faster than
    autocast, within 1e-2 cosine of fp32); the projection head runs under
    autocast and rows are normalised in fp32. One object per pass: building it copies the tower.

    ``flip_average``: each row is the unit sum of the unit rows of the pixels and of their left-right mirror
    (``torch.flip`` on the last axis), one batch of 2B through the tower: twice the image pass; what it buys is
    measured per model by ``benchmarks/studies/flip_average.py`` (benchmarks/RESULTS.md). An index records it
    (``flip_average`` in its manifest), as evaluation results do.
    """

    def __init__(self, model: CLIPModel, precision: str, device: torch.device | str, flip_average: bool = False):
        self.model, self.precision, self.device = model, precision, torch.device(device)
        self.flip_average = bool(flip_average)
        self.tower = inference_tower(model.visual, precision)
        self.cast = precision if self.tower is model.visual else "fp32"   # the bf16 copy runs as it is
        self.input_dtype = pixel_dtype(self.tower)   # the loader's pixels can come in it

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, E) float32 unit rows on the model's device."""
        pixels = pixels.to(self.device, non_blocking=True)
        if self.flip_average:
            pixels = torch.cat([pixels, torch.flip(pixels, dims=[-1])])   # (2B, 3, H, W): then the mirrors
        with torch.inference_mode():
            with autocast(self.device, self.cast):
                tower_features = self.tower(tower_input(self.tower, pixels))
            with autocast(self.device, self.precision):
                rows = self.model.project_image(tower_features.float()).float()   # (B or 2B, E) unit rows
            if self.flip_average:
                plain, mirrored = rows.chunk(2)
                rows = _unit_rows(plain + mirrored)
            return rows
