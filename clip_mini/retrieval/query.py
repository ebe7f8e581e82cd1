"""Fast text queries: the text tower and head in numpy, so ``clip-mini search`` starts without torch.

Importing torch, transformers and timm costs 5 to 9 s of start-up on a small CPU, while a query is a dozen tokens
through a few layers: milliseconds of numpy. ``NumpyTextEncoder`` reads only the text weights from
``model.safetensors`` plus ``tokenizer.json`` (with the ``tokenizers`` library) and computes exactly what
``CLIPModel.encode_text`` computes in eval mode (DistilBERT: embeddings + LayerNorm, post-norm blocks with exact
GELU, the [CLS] state; then the projection head and L2 normalisation). ``tests/test_search_query.py`` checks the
two agree to 1e-5. Image queries and anything else still go through the torch model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from clip_mini.manifest import ModelDirError, read_manifest

QUERY_FILES = ("config.json", "model.safetensors", "tokenizer.json")   # what the numpy path reads


class QueryEncoderError(ModelDirError):
    """A model directory cannot serve fast text queries; the message names the file."""


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 (max abs error 1.5e-7, below float32 resolution near 1): numpy has no erf and
    # scipy would cost more start-up than the whole query.
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x * np.float32(1 / np.sqrt(2))))


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


class NumpyTextEncoder:
    """``encode_text`` of a saved model, in numpy (eval mode: no dropout)."""

    def __init__(self, weights: dict[str, np.ndarray], config: dict, tokenizer, fingerprint: str):
        self.w, self.cfg, self.tokenizer, self.fingerprint = weights, config["model"], tokenizer, fingerprint
        self.dim = int(self.cfg["embed_dim"])
        self.n_heads = int(self.cfg["text"]["n_heads"])
        self.n_layers = int(self.cfg["text"]["n_layers"])

    @classmethod
    def load(cls, model_dir: str | Path, verify: bool = True) -> "NumpyTextEncoder":
        """Read the text weights and tokenizer of a model directory (checksums verified unless ``verify=False``)."""
        from safetensors import safe_open
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        try:
            manifest = read_manifest(model_dir, verify, required=QUERY_FILES)
        except ModelDirError as e:
            raise QueryEncoderError(str(e)) from None
        try:
            config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
            max_length = int(config["model"]["text"]["max_length"])
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
                weights = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()
                           if k.startswith(("text.bert.", "text_head."))}
        except Exception as e:  # json, safetensors and tokenizers each raise their own types
            raise QueryEncoderError(f"{model_dir}: cannot read the text tower for fast queries: {e}") from None
        tokenizer.enable_truncation(max_length)
        tokenizer.no_padding()
        return cls(weights, config, tokenizer, manifest["fingerprint"])

    def encode_text(self, captions: Sequence[str]) -> np.ndarray:
        """Embed captions: (n, d) float32, rows L2-normalised."""
        if isinstance(captions, str) or not captions:
            raise QueryEncoderError("captions must be a non-empty list of strings")
        for i, c in enumerate(captions):
            if not isinstance(c, str) or not c.strip():
                raise QueryEncoderError(f"caption {i} is empty or not a string: {c!r:.80}")
        # One caption at a time: no padding, so no mask is needed and results match a padded batch exactly.
        out = np.stack([self._encode_one(self.tokenizer.encode(c).ids) for c in captions])
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def _encode_one(self, ids: list[int]) -> np.ndarray:
        w, p = self.w, "text.bert."
        x = w[p + "embeddings.word_embeddings.weight"][ids] + \
            w[p + "embeddings.position_embeddings.weight"][: len(ids)]  # (L, D)
        x = _layer_norm(x, w[p + "embeddings.LayerNorm.weight"], w[p + "embeddings.LayerNorm.bias"], 1e-12)
        for i in range(self.n_layers):
            x = self._block(x, f"{p}transformer.layer.{i}.")
        # TextConfig.pooling: one unpadded caption, so the masked mean is the plain mean over its tokens.
        return self._head(x.mean(0) if self.cfg["text"].get("pooling", "cls") == "mean" else x[0])

    def _lin(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def _block(self, x: np.ndarray, p: str) -> np.ndarray:
        L, D = x.shape
        hs = D // self.n_heads
        q, k, v = (self._lin(x, f"{p}attention.{n}_lin").reshape(L, self.n_heads, hs).transpose(1, 0, 2)
                   for n in ("q", "k", "v"))  # (H, L, hs)
        scores = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(hs))  # (H, L, L)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        ctx = (scores / scores.sum(-1, keepdims=True)) @ v  # (H, L, hs)
        sa = self._lin(ctx.transpose(1, 0, 2).reshape(L, D), f"{p}attention.out_lin")
        x = _layer_norm(sa + x, self.w[p + "sa_layer_norm.weight"], self.w[p + "sa_layer_norm.bias"], 1e-12)
        ffn = self._lin(_gelu(self._lin(x, f"{p}ffn.lin1")), f"{p}ffn.lin2")
        return _layer_norm(ffn + x, self.w[p + "output_layer_norm.weight"], self.w[p + "output_layer_norm.bias"],
                           1e-12)

    def _head(self, x: np.ndarray) -> np.ndarray:
        x = self._lin(x, "text_head.proj")
        if self.cfg["head"] == "linear":
            return x
        return _layer_norm(x + self._lin(_gelu(x), "text_head.fc"), self.w["text_head.norm.weight"],
                           self.w["text_head.norm.bias"], 1e-5)
