"""Query encoders on onnxruntime: text and image queries without importing torch, timm or albumentations.

Importing torch, transformers and timm costs seconds of start-up on a small CPU, while a query is one caption or
one picture through the towers. ``TextQueryEncoder`` tokenizes with the ``tokenizers`` library (the model's own
``tokenizer.json``) and runs ``text.onnx``; ``ImageQueryEncoder`` decodes with Pillow (``load_image``), applies the
eval transform in numpy (``preprocess_np``) and runs ``image.onnx``. The ONNX files are the model's own towers,
heads and normalisation exported by ``onnx_export`` (checked against torch to 1e-4 in
``tests/test_search_query.py``), found or made by ``ensure_onnx`` and checksum-verified on every load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from clip_mini.fileio.atomic import sha256_file
from clip_mini.errors import QueryEncoderError
from clip_mini.features.unit import unit_rows
from clip_mini.fileio.manifest import read_json, read_manifest
from clip_mini.model.onnx_export import ensure_onnx

QUERY_FILES = ("config.json", "tokenizer.json", "preprocess.json")   # what the query path reads besides ONNX


def _session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3   # no warnings about unused initialisers on stderr
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _checked_file(model_dir: Path, manifest: dict, name: str) -> Path:
    path = model_dir / name
    if sha256_file(path) != manifest["files"][name]:
        raise QueryEncoderError(f"{path} is corrupt: its checksum does not match manifest.json")
    return path


class TextQueryEncoder:
    """``encode_text`` of a saved model through ``text.onnx`` (eval mode)."""

    def __init__(self, session, tokenizer, fingerprint: str):
        self.session, self.tokenizer, self.fingerprint = session, tokenizer, fingerprint

    @classmethod
    def load(cls, model_dir: str | Path, repair: bool = False) -> "TextQueryEncoder":
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        manifest = read_manifest(model_dir, verify=False, required=QUERY_FILES)
        config = read_json(model_dir / "config.json")
        onnx_path = ensure_onnx(model_dir, "text", repair)
        try:
            max_length = int(config["model"]["text"]["max_length"])
            tokenizer = Tokenizer.from_file(str(_checked_file(model_dir, manifest, "tokenizer.json")))
        except QueryEncoderError:
            raise
        except Exception as e:  # json and tokenizers raise their own types
            raise QueryEncoderError(f"{model_dir}: cannot read the tokenizer: {e}") from None
        tokenizer.enable_truncation(max_length)
        tokenizer.enable_padding(pad_id=int(config.get("pad_token_id", 0)))
        return cls(_session(onnx_path), tokenizer, manifest["fingerprint"])

    def encode_text(self, captions: Sequence[str]) -> np.ndarray:
        """Embed captions: (n, d) float32, rows L2-normalised."""
        if isinstance(captions, str) or not captions:
            raise QueryEncoderError("captions must be a non-empty list of strings")
        for i, c in enumerate(captions):
            if not isinstance(c, str) or not c.strip():
                raise QueryEncoderError(f"caption {i} is empty or not a string: {c!r:.80}")
        enc = self.tokenizer.encode_batch(list(captions))
        ids = np.array([e.ids for e in enc], dtype=np.int64)             # (n, L), padded to the longest
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]


class ImageQueryEncoder:
    """``encode_image`` of a saved model: Pillow decode, numpy eval transform, ``image.onnx``."""

    def __init__(self, session, preprocess: dict, fingerprint: str):
        self.session, self.preprocess, self.fingerprint = session, preprocess, fingerprint

    @classmethod
    def load(cls, model_dir: str | Path, repair: bool = False) -> "ImageQueryEncoder":
        model_dir = Path(model_dir)
        manifest = read_manifest(model_dir, verify=False, required=QUERY_FILES)
        path = _checked_file(model_dir, manifest, "preprocess.json")
        try:
            pre = json.loads(path.read_text(encoding="utf-8"))
            int(pre["image_size"]), [float(v) for v in (*pre["mean"], *pre["std"])]
        except (ValueError, KeyError, TypeError) as e:
            raise QueryEncoderError(f"{path}: not a preprocessing config: {e}") from None
        return cls(_session(ensure_onnx(model_dir, "image", repair)), pre, manifest["fingerprint"])

    def encode_image(self, images: Sequence[Any], batch_size: int = 16, flip_average: bool = False) -> np.ndarray:
        """Images as paths, bytes, PIL images or arrays: (n, d) float32, rows L2-normalised; ``flip_average``: each
        the unit sum of the image's row and its left-right mirror's, as ``model.clip.ImageForward`` makes them."""
        from clip_mini.data.images import ImageError, load_image, load_image_bytes
        from clip_mini.retrieval.preprocess_np import eval_pixels

        if not images or isinstance(images, (str, bytes)):
            raise QueryEncoderError("images must be a non-empty list")
        out = []
        for start in range(0, len(images), batch_size):
            pixels = []
            for i, item in enumerate(images[start:start + batch_size], start):
                try:
                    size = int(self.preprocess["image_size"])
                    if isinstance(item, (bytes, bytearray)):   # an upload: the same decode as the file it came from
                        image = load_image_bytes(item, "<bytes>", min_size=size)
                    else:
                        image = load_image(item, min_size=size)
                    pixels.append(eval_pixels(image, self.preprocess))
                except ImageError as e:
                    raise QueryEncoderError(f"image {i}: {e}") from None
            batch = np.stack(pixels)   # (b, 3, H, W)
            if flip_average:
                batch = np.concatenate([batch, batch[..., ::-1]])   # (2b, 3, H, W): then the mirrors
            rows = self.session.run(None, {"pixels": batch})[0]
            if flip_average:
                plain, mirrored = np.split(unit_rows(rows), 2)
                rows = unit_rows(plain + mirrored)
            out.append(rows)
        return np.concatenate(out)

