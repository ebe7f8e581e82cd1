"""Embedding functions over a saved model directory: ``clip_mini.load(dir).encode_text / encode_image``.

Inputs are checked up front so a bad item is named before any work is done (or, with ``on_error="skip"``, left
out and reported); outputs are (n, d) rows computed in batches under ``torch.inference_mode`` with the directory's
own preprocessing, L2-normalised unless asked otherwise. Images are decoded and preprocessed on worker threads a
batch ahead of the forward pass, as indexing does (Pillow and OpenCV release the GIL while they work).
"""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence, Union

import numpy as np
import torch

from clip_mini.runtime.devices import DeviceArg, resolve_device, resolve_precision, to_device, use_device
from clip_mini.errors import InputError
from clip_mini.runtime.precision import autocast

__all__ = ["Embedder", "InputError"]

# CLIP's single prompt; ``clip_mini.eval.scoring`` scores zero-shot accuracy with the same default
DEFAULT_TEMPLATES = ("a photo of a {}.",)

Output = Literal["numpy", "torch"]
OnError = Literal["raise", "skip"]
Features = Union[np.ndarray, torch.Tensor]


class Embedder:
    """Text and image embedding functions for one saved model (``clip_mini.load(model_dir)``).

    Args:
        model: a ``CLIPModel``.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        batch_size: default inputs per forward pass (each call may override it).
        precision: "auto" (bf16 where ``device`` computes it natively, else fp32: ``resolve_precision``), "fp32",
            "bf16" or "fp16" autocast for the towers (rows are renormalised in fp32).
        model_dir: the directory the model came from (shown by ``repr``; recorded by indexes built with it).
    """

    def __init__(self, model, device: DeviceArg = "auto", batch_size: int = 64, precision: str = "auto",
                 model_dir: Optional[str | Path] = None):
        if precision not in ("auto", "fp32", "bf16", "fp16"):
            raise InputError(f"precision must be auto, fp32, bf16 or fp16, got {precision!r}")
        # the current CUDA device too, before the model copy or any pinned batch opens a context on GPU 0
        self.device = use_device(resolve_device(device))
        self.model = model.to(self.device).eval()
        self.batch_size = _positive(batch_size, "batch_size")
        self.precision = resolve_precision(precision, self.device)
        self.model_dir = None if model_dir is None else str(model_dir)
        self._transform = None
        self.fingerprint = getattr(model, "fingerprint", None)
        self.dim = model.cfg.embed_dim

    def __repr__(self) -> str:
        v, t, p = self.model.cfg.vision, self.model.cfg.text, self.model.preprocess
        image = f"{v.backbone} {p.image_size}px" + (f" + {v.concat} {v.concat_size}px" if v.concat else "")
        return (f"Embedder({self.model_dir!r}, dim={self.dim}, image={image}, "
                f"text={t.pooling}-pooled {t.max_length} tokens, device={str(self.device)!r}, "
                f"precision={self.precision!r}, batch_size={self.batch_size}, model={self.fingerprint})")

    @property
    def transform(self):
        """The model's eval transform, built on first use: albumentations costs seconds to import, and a
        text-only user never needs it."""
        if self._transform is None:
            from clip_mini.data import build_eval_transform

            self._transform = build_eval_transform(self.model.preprocess)
        return self._transform

    @classmethod
    def load(cls, model_dir: str | Path, device: DeviceArg = "auto", batch_size: int = 64,
             precision: str = "auto") -> "Embedder":
        """A model directory, or the name of a built-in model (``clip_mini.list_models()``; built into the user
        cache on first use: ``clip_mini.builtin.registry``), as an ``Embedder``."""
        from clip_mini.builtin.registry import resolve_model
        from clip_mini.model.clip import CLIPModel

        device = resolve_device(device)   # before reading weights: a bad --device fails at once
        model_dir = resolve_model(model_dir)
        return cls(CLIPModel.from_pretrained(model_dir), device=device, batch_size=batch_size, precision=precision,
                   model_dir=model_dir)

    # -- text ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_text(self, texts: str | Sequence[str], batch_size: Optional[int] = None, normalize: bool = True,
                    output: Output = "numpy", show_progress: bool = False, on_error: OnError = "raise"):
        """Embed one caption or a list of them.

        Args:
            texts: a string, or a list of strings.
            batch_size: captions per forward pass (default: the embedder's).
            normalize: L2-normalise the rows (cosine similarity is then a dot product).
            output: "numpy" (float32 array) or "torch" (float32 tensor on the embedder's device).
            show_progress: a progress bar over batches.
            on_error: "raise" an ``InputError`` naming the first unusable caption (not a string, or empty), or
                "skip" it and report it.

        Returns:
            (n, d) features, or (d,) for a single string. With ``on_error="skip"``: ``(features, failed)`` where
            ``features`` holds the rows of the usable captions in input order and ``failed`` maps each skipped
            caption's position to the reason (a single unusable string gives ``(None, {0: reason})``).
        """
        single, items = _as_list(texts, "texts", str)
        _check_on_error(on_error)
        failed = {}
        for i, c in enumerate(items):
            reason = (f"is a {type(c).__name__}, not a string: {c!r:.80}" if not isinstance(c, str)
                      else "is empty" if not c.strip() else None)
            if reason is not None:
                if on_error != "skip":
                    raise InputError(f"caption {i} {reason}")
                failed[i] = reason
        ok = [i for i in range(len(items)) if i not in failed]
        bs = self._batch_size(batch_size)
        out = []
        for start in _progress(range(0, len(ok), bs), show_progress, "embedding captions", len(ok), bs):
            tokens = self.model.tokenize([items[i] for i in ok[start:start + bs]])
            with autocast(self.device, self.precision):
                feats = self.model.encode_text(to_device(tokens["input_ids"], self.device),
                                               to_device(tokens["attention_mask"], self.device), normalize=False)
            out.append(_finish(feats, normalize))
        return _result(out, single, failed, on_error, output, self.dim, self.device)

    # -- images ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, images: Any, batch_size: Optional[int] = None, normalize: bool = True,
                     output: Output = "numpy", show_progress: bool = False, on_error: OnError = "raise",
                     workers: Optional[int] = None):
        """Embed one image or a list of them, given as paths, PIL images or (H, W, 3) arrays.

        Args:
            images: one image, or a list of them.
            batch_size: images per forward pass (default: the embedder's).
            normalize: L2-normalise the rows.
            output: "numpy" (float32 array) or "torch" (float32 tensor on the embedder's device).
            show_progress: a progress bar over images.
            on_error: "raise" an ``InputError`` naming the first image that cannot be decoded, or "skip" it.
            workers: threads decoding and preprocessing the next batch while the model runs the current one
                (default: up to 4, one per CPU core; 0 decodes in the calling thread).

        Returns:
            (n, d) features, or (d,) for a single image; with ``on_error="skip"``, ``(features, failed)`` as in
            ``encode_text`` (``failed`` maps input position to the reason the image could not be used).
        """
        single, items = _as_list(images, "images", (str, os.PathLike, np.ndarray))
        _check_on_error(on_error)
        bs = self._batch_size(batch_size)
        workers = min(4, os.cpu_count() or 1) if workers is None else workers
        out, failed = [], {}
        bar = _progress(None, show_progress, "embedding images", len(items), 1)
        for pixels, bad in self._decoded_batches(items, bs, workers):
            if bad and on_error != "skip":
                i, reason = next(iter(bad.items()))
                raise InputError(f"image {i}: {reason}")
            failed.update(bad)
            if pixels is not None:
                with autocast(self.device, self.precision):
                    feats = self.model.encode_image(to_device(pixels, self.device), normalize=False)
                out.append(_finish(feats, normalize))
            if bar is not None:
                bar.update(len(bad) + (0 if pixels is None else len(pixels)))
        if bar is not None:
            bar.close()
        return _result(out, single, failed, on_error, output, self.dim, self.device)

    def _decoded_batches(self, items: list, bs: int, workers: int) -> Iterator[tuple[Optional[torch.Tensor], dict]]:
        """Yield ``(pixels (b, 3, S, S) or None, {position: reason})`` per batch, decoding up to two batches ahead."""
        def batch(start: int):
            return [(i, self._prepare(items[i])) for i in range(start, min(start + bs, len(items)))]

        def collect(prepared) -> tuple[Optional[torch.Tensor], dict]:
            ok = [x for _, x in prepared if isinstance(x, torch.Tensor)]
            bad = {i: x for i, x in prepared if not isinstance(x, torch.Tensor)}
            pixels = torch.stack(ok) if ok else None
            if pixels is not None and self.device.type == "cuda":
                pixels = pixels.pin_memory()   # lets the copy to the GPU run asynchronously
            return pixels, bad

        starts = range(0, len(items), bs)
        if workers <= 0:
            for start in starts:
                yield collect(batch(start))
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="clip_mini-decode") as pool:
            pending: deque = deque()
            for start in starts:
                pending.append([(i, pool.submit(self._prepare, items[i]))
                                for i in range(start, min(start + bs, len(items)))])
                if len(pending) > 2:
                    yield collect([(i, f.result()) for i, f in pending.popleft()])
            while pending:
                yield collect([(i, f.result()) for i, f in pending.popleft()])

    def _prepare(self, item: Any) -> torch.Tensor | str:
        """Decode and preprocess one image; the reason as a string when it cannot be used."""
        from clip_mini.data import ImageError, load_image

        try:
            return self.transform(load_image(item, min_size=self.transform.base[0]))
        except ImageError as e:
            return str(e)

    def encode_pixels(self, pixels: torch.Tensor) -> np.ndarray:
        """Embed already-preprocessed pixels (B, 3, S, S)."""
        with torch.inference_mode(), autocast(self.device, self.precision):
            feats = self.model.encode_image(to_device(pixels, self.device), normalize=False)
        return _finish(feats, True).cpu().numpy()

    # -- query arithmetic -----------------------------------------------------------------------------------------
    def encode_query(self, terms: Any) -> np.ndarray:
        """One (d,) float32 unit row for weighted text and image terms: a caption, or a list of
        ``(caption or image, weight)`` pairs (a ``str`` is a caption; a path-like, PIL image or array an image; a
        negative weight means "without"), combined as ``EmbeddingIndex.search`` and ``clip-mini search`` combine
        them (``clip_mini.features.terms``)::

            query = model.encode_query([("a circle", 1.0), ("red", -1.0)])

        Raises:
            InputError: an empty query, a bad weight, only negative terms, terms that cancel out.
        """
        from clip_mini.features.terms import as_terms, combine

        return combine(as_terms(terms), self.encode_text, self.encode_image)

    # -- match maps ---------------------------------------------------------------------------------------------
    def explain(self, image: Any, text: str, method: str = "auto") -> np.ndarray:
        """Where in ``image`` the text matches: a float32 (H, W) map over the image's own pixels, in [0, 1],
        higher where the image matches (``clip_mini.model.explain``: by default, for a ViT tower, occlusion maps
        where its patch grid is coarser than 8 a side (the drop in image-text cosine as a one-patch window slides
        over the image) and relevance maps otherwise (gradient-weighted attention through every block), and
        Grad-CAM for CNN towers; or name ``method``: "occlusion", "relevance", "gradcam", "tokens" (patch tokens
        scored through the image head)).

        The tower's patch grid is upsampled bilinearly to the image size; with ``center_crop`` preprocessing the
        map covers the centre square the model saw, and is 0 outside it.

        Raises:
            InputError: an unreadable image, an empty text, or an unknown method.
        """
        from clip_mini.data import ImageError, load_image
        from clip_mini.model.explain import METHODS, match_map, upsample

        if method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"the text to explain must be a non-empty string, got {text!r:.80}")
        try:
            array = load_image(image)   # in full: the map is drawn over the image's own pixels
        except ImageError as e:
            raise InputError(str(e)) from None
        pixels = self.transform(array)
        text_row = self.encode_text(text, output="torch")
        heat = match_map(self.model, pixels, text_row, method)
        h, w = array.shape[:2]
        if self.model.preprocess.resize_mode != "center_crop":
            return upsample(heat, h, w)
        s = min(h, w)
        out = np.zeros((h, w), np.float32)
        out[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s] = upsample(heat, s, s)
        return out

    # -- zero-shot classification -----------------------------------------------------------------------------
    def label_embeddings(self, labels: Sequence[str], template: str | Sequence[str] = DEFAULT_TEMPLATES,
                         batch_size: Optional[int] = None) -> np.ndarray:
        """One L2-normalised (d,) row per label: the mean of its normalised prompt embeddings, one prompt per
        template (CLIP's prompt ensembling).

        Args:
            labels: class names ("cat", "a red circle"); each is put into every template's ``{}``.
            template: a prompt with ``{}``, or a list of them.

        Raises:
            InputError: no labels, a label that is empty or only spaces (named by position), a repeated label,
                no templates, or a template without ``{}``.
        """
        labels, templates = check_labels(labels), check_templates(template)
        prompts = [t.format(c) for c in labels for t in templates]
        feats = self.encode_text(prompts, batch_size=batch_size).reshape(len(labels), len(templates), -1).mean(1)
        from clip_mini.features.unit import unit_rows

        return unit_rows(feats)

    def classify(self, images: Any, labels: Sequence[str], template: str | Sequence[str] = DEFAULT_TEMPLATES,
                 top: int = 2, batch_size: Optional[int] = None, on_error: OnError = "raise",
                 show_progress: bool = False, workers: Optional[int] = None):
        """Zero-shot classification: each image gets the label whose prompt embedding is nearest.

        Args:
            images: one image or a list (paths, PIL images or arrays), as for ``encode_image``.
            labels: at least 2 class names; template: as in ``label_embeddings``.
            top: labels reported per image (at least 1, at most the number of labels).
            on_error: "raise" on an image that cannot be read, or "skip" it (returned in ``failed``).

        Returns:
            One dict per image, in input order: ``path`` (the input when it is a path, else its position),
            ``label``, ``score``, ``runner_up``, ``runner_up_score`` (empty and NaN when ``top`` is 1) and
            ``top``, the ``top`` best ``(label, score)`` pairs. Scores are probabilities over the labels: the
            softmax of the cosine similarities times the model's logit scale, as in training. A single image
            gives one dict. With ``on_error="skip"``: ``(rows, failed)`` as in ``encode_image``.
        """
        labels = check_labels(labels)
        if len(labels) < 2:
            raise InputError(f"classification needs at least 2 labels, got {labels}")
        if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or not 1 <= top <= len(labels):
            raise InputError(f"top must be an integer from 1 to the number of labels ({len(labels)}), got {top!r}")
        _check_on_error(on_error)
        class_rows = self.label_embeddings(labels, template, batch_size)
        single, items = _as_list(images, "images", (str, os.PathLike, np.ndarray))
        feats, failed = self.encode_image(items, batch_size=batch_size, on_error="skip", show_progress=show_progress,
                                          workers=workers)
        if failed and on_error != "skip":
            i, reason = next(iter(failed.items()))
            raise InputError(f"image {i}: {reason}")
        logits = feats @ class_rows.T * float(self.model.scale().detach())
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        ok = [i for i in range(len(items)) if i not in failed]
        rows = []
        for n, i in enumerate(ok):
            order = np.argsort(-probs[n], kind="stable")[:top]
            best = [(labels[c], float(probs[n, c])) for c in order]
            item = items[i]
            rows.append({"path": os.fspath(item) if isinstance(item, (str, os.PathLike)) else i,
                         "label": best[0][0], "score": best[0][1],
                         "runner_up": best[1][0] if top > 1 else "",
                         "runner_up_score": best[1][1] if top > 1 else float("nan"), "top": best})
        result = (rows[0] if rows else None) if single else rows
        return (result, failed) if on_error == "skip" else result

    def _batch_size(self, batch_size: Optional[int]) -> int:
        return self.batch_size if batch_size is None else _positive(batch_size, "batch_size")



def load(model_dir, device: str = "auto", batch_size: int = 64, precision: str = "auto") -> Embedder:
    """``clip_mini.load``: a model directory or built-in model name as an ``Embedder`` (see ``Embedder.load``)."""
    return Embedder.load(model_dir, device=device, batch_size=batch_size, precision=precision)

def check_labels(labels: Any) -> list[str]:
    """Class names as a list: refuses none, a non-string, an empty or all-space name, and a repeated name."""
    if isinstance(labels, str):
        raise InputError(f"labels must be a list of class names, got one string {labels!r:.80} (split it first)")
    labels = list(labels) if hasattr(labels, "__iter__") else None
    if not labels:
        raise InputError("the label list is empty: give at least two class names")
    seen = {}
    for i, name in enumerate(labels):
        if not isinstance(name, str):
            raise InputError(f"label {i + 1} is a {type(name).__name__}, not a string: {name!r:.80}")
        if not name.strip():
            raise InputError(f"label {i + 1} is {'empty' if not name else 'only spaces'}: {name!r}")
        if name.strip() in seen:
            raise InputError(f"label {i + 1} ({name.strip()!r}) repeats label {seen[name.strip()] + 1}")
        seen[name.strip()] = i
    return [name.strip() for name in labels]


def check_templates(template: Any) -> list[str]:
    """Prompt templates as a list, each with one ``{}`` for the class name."""
    templates = [template] if isinstance(template, str) else list(template or [])
    if not templates:
        raise InputError("no prompt template given")
    for t in templates:
        if not isinstance(t, str) or "{}" not in t:
            raise InputError(f"prompt template {t!r} has no {{}} for the class name")
        try:
            t.format("x")
        except (IndexError, KeyError, ValueError) as e:
            raise InputError(f"prompt template {t!r} is not a format string with one {{}}: {e}") from None
    return templates


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise InputError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def _as_list(items: Any, what: str, single_types) -> tuple[bool, list]:
    """``(was a single item, items as a list)``; a lone string, path, bytes or array counts as one item."""
    if isinstance(items, single_types) or (what == "images" and not hasattr(items, "__len__")):
        if isinstance(items, np.ndarray) and items.ndim == 4:
            raise InputError("images is one 4-D array; pass a list of (H, W, 3) arrays")
        return True, [items]
    if not hasattr(items, "__len__"):
        raise InputError(f"{what} must be a string or a list, got {type(items).__name__}")
    items = list(items)
    if not items:
        raise InputError(f"{what} is empty: nothing to encode")
    return False, items


def _finish(feats: torch.Tensor, normalize: bool) -> torch.Tensor:
    # fp32 before normalising: under bf16/fp16 autocast the rows would be off the unit sphere by ~1e-3.
    feats = feats.float()
    return torch.nn.functional.normalize(feats, dim=-1) if normalize else feats


def _result(out: list[torch.Tensor], single: bool, failed: dict, on_error: str, output: str, dim: int,
            device: torch.device):
    if output not in ("numpy", "torch"):
        raise InputError(f"output must be 'numpy' or 'torch', got {output!r}")
    feats = torch.cat(out) if out else torch.zeros((0, dim), device=device)
    result = feats if output == "torch" else feats.cpu().numpy().astype(np.float32, copy=False)
    if single:
        result = result[0] if len(result) else None
    return (result, failed) if on_error == "skip" else result


def _progress(iterable, show: bool, desc: str, total: int, per_step: int):
    if not show:
        return iterable
    from tqdm import tqdm

    if iterable is None:
        return tqdm(total=total, desc=desc, unit="img")
    return tqdm(iterable, desc=desc, unit="batch", total=(total + per_step - 1) // per_step)
