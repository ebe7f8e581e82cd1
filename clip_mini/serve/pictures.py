"""What the server sends and receives as pictures: thumbnails, originals, uploaded queries, attention maps, match
maps ("why this match").

Every decode goes through ``clip_mini.data.images`` (a fixed list of decoders, a pixel limit checked before
decoding, size-capped reads of regular files only, one translation of Pillow's errors), so an indexed file swapped
for something else, or an upload crafted as a decompression bomb or as a strip a million pixels long, becomes an
``ImageError`` rather than a hung or exhausted server.
"""
from __future__ import annotations

import functools
import io
import os
import threading
from collections import OrderedDict
from typing import Hashable, Optional

import numpy as np
from PIL import Image

from clip_mini.data.images import DEFAULT_MAX_FILE_BYTES, ImageError, load_image, open_image
from clip_mini.fileio.bounded_read import UnreadableFileError, read_file

THUMB_PX = 256
# Formats a browser shows as they are; an indexed TIFF or PPM is sent re-encoded as PNG. (Pillow's JPEG opener
# returns MPO files, so MPO is a result here but not an opener name.)
_BROWSER_TYPES = {"JPEG": "image/jpeg", "MPO": "image/jpeg", "PNG": "image/png", "GIF": "image/gif",
                  "WEBP": "image/webp", "BMP": "image/bmp"}
# Uploads: the formats a browser can send; never the full Pillow list (EPS would run Ghostscript).
UPLOAD_FORMATS = ["JPEG", "PNG", "GIF", "WEBP", "BMP"]
# 36 MP (6000x6000; was 40): any phone photo; one decode holds at most ~144 MB (Pillow keeps RGB as 4 bytes a
# pixel) and the server's image pool decodes one at a time. The working copy is then reduced (``reduced``).
UPLOAD_MAX_PIXELS = 36_000_000
# The longer side at most this many times the shorter: camera panoramas stay near 10:1. A strip 1 pixel wide and a
# million long is no photo; squashed or centre-cropped for the model, a sliver of it is all the model would see.
UPLOAD_MAX_ASPECT = 20


def _file_key(path: str) -> tuple:
    return (path, *file_version(path))


def file_version(path: str) -> tuple[int, int]:
    """(size, mtime_ns) of a file: what tells a cached picture of it from a fresh one (raises OSError)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def thumbnail_jpeg(path: str) -> bytes:
    """A JPEG at most ``THUMB_PX`` on its longer side (cached per file version: path, size, mtime)."""
    try:
        key = _file_key(path)
    except OSError as e:
        raise ImageError(path, f"cannot read: {e.strerror or e}") from None
    return _thumbnail(key)


@functools.lru_cache(maxsize=4096)   # ~10 KB each: at most ~40 MB
def _thumbnail(key: tuple) -> bytes:
    img = Image.fromarray(load_image(key[0]))
    img.thumbnail((THUMB_PX, THUMB_PX), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def original(path: str) -> tuple[bytes, str]:
    """The indexed file's bytes and media type, checked to be an image; re-encoded as PNG if a browser can't
    show its format."""
    try:
        data = read_file(path, max_bytes=DEFAULT_MAX_FILE_BYTES)[0]
    except UnreadableFileError as e:
        raise ImageError(path, e.reason) from None
    except OSError as e:
        raise ImageError(path, f"cannot read: {e.strerror or e}") from None
    try:
        with open_image(data, path, [f for f in _BROWSER_TYPES if f != "MPO"]) as im:
            return data, _BROWSER_TYPES[im.format]
    except ImageError:   # no format a browser shows: re-encoded below, if it is an image at all
        pass
    buf = io.BytesIO()
    Image.fromarray(load_image(path)).save(buf, format="PNG")   # raises ImageError if it is no image at all
    return buf.getvalue(), "image/png"


def decode_upload(data: bytes, name: str = "upload", min_size: Optional[int] = None,
                  max_pixels: int = UPLOAD_MAX_PIXELS, max_aspect: int = UPLOAD_MAX_ASPECT,
                  keep_aspect: bool = True) -> np.ndarray:
    """An uploaded query image as an (H, W, 3) uint8 RGB array (EXIF rotation applied, pixel count and aspect
    ratio limited from the header, before anything is decoded).

    With ``min_size`` (the model's input side) the image is decoded at reduced scale (``reduced``): a query needs a
    few hundred pixels a side; without this a 6000x6000 PNG, 35 KB on the wire, became a gigabyte of float arrays
    in the eval transform's resize. ``keep_aspect=False`` (a model that squashes the whole image to a square)
    reduces each axis on its own, so a long thin image shrinks along its length too.
    """
    if not data:
        raise ImageError(name, "empty upload (0 bytes)")
    with open_image(data, name, UPLOAD_FORMATS, "not an image (send " + ", ".join(UPLOAD_FORMATS) + ")") as im:
        w, h = im.size   # from the header: nothing is decoded before these checks
        if w * h > max_pixels:
            raise ImageError(name, f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}")
        if max(w, h) > max_aspect * min(w, h):
            raise ImageError(name, f"{w}x{h}: the longer side is more than {max_aspect} times the shorter, the "
                                   f"limit for a query image (aspect ratio {max_aspect}:1); crop it")
        return load_image(reduced(im, min_size, keep_aspect) if min_size else im, max_pixels=max_pixels)


# Modes whose values are not intensities (palette indices, 1-bit) or that ``reduce`` refuses: converted first.
_BEFORE_REDUCE = {"1": "L", "P": "RGB", "PA": "RGBA", "I;16": "I", "I;16L": "I", "I;16B": "I", "I;16N": "I"}


def reduced(im: Image.Image, min_size: int, keep_aspect: bool = True) -> Image.Image:
    """``im`` decoded at about the smallest scale that keeps each side at least ``2 * min_size``.

    A JPEG is decoded at 1/2, 1/4 or 1/8 scale by libjpeg (``draft``); then the image is box-averaged by an integer
    factor (``Image.reduce``), so the eval transform's own resize only sees a few hundred pixels a side. With
    ``keep_aspect`` one factor, from the shorter side, serves both axes (a centre crop needs the true proportions);
    without it each axis gets its own, and a 300 x 6,000 strip becomes 300 x 461 for a 224-pixel model. Box averaging
    followed by that area resize is area averaging, up to rounding, so the query embedding is the full decode's
    to within that. The result keeps the file's EXIF (Pillow copies ``info``), so ``load_image`` still turns it
    upright.
    """
    target = 2 * min_size
    if im.format == "JPEG":
        im.draft(None, (target, target))
    w, h = im.size
    fx, fy = (max(1, min(w, h) // target),) * 2 if keep_aspect else (max(1, w // target), max(1, h // target))
    if fx < 2 and fy < 2:
        return im
    if im.mode in _BEFORE_REDUCE:
        im = im.convert("RGBA" if im.mode == "P" and "transparency" in im.info else _BEFORE_REDUCE[im.mode])
    return im.reduce((fx, fy))


class MapRenderer:
    """PNG overlays drawn by the torch model: the ViT's CLS attention (mean over heads and layers) and a text query's
    match map (``Embedder.explain``: where in the image the query matches).

    Loading it imports torch (seconds), which the search path never needs: the server starts it in the background
    (``load_in_background``) and ``/api/info`` reports ``state``; a request that arrives first waits for it. The
    model is loaded once, under a lock, and shared by every thread: a match map's backward pass takes the model's
    own lock for its gradient (``clip_mini.model.explain``) and each pass's attention kernel holds for its own thread
    (``model.vision``, ``model.text``), so maps drawn at once beside each other equal maps drawn alone.
    """

    def __init__(self, model_dir: str, device: str = "auto"):
        self.model_dir, self.device = model_dir, device
        self._embedder = None
        self._lock = threading.Lock()
        self.state = "not loaded"   # -> "loading" -> "loaded", or "failed: why"

    def load_in_background(self) -> None:
        if self._embedder is None:
            self.state = "loading"
            threading.Thread(target=self._load_logged, name="clip-mini-attention-load", daemon=True).start()

    def _load_logged(self) -> None:
        try:
            self._model()
        except Exception as e:   # the request that needs the model gets the error; here it is reported
            self.state = f"failed: {type(e).__name__}: {e}"

    def _model(self):
        with self._lock:
            if self._embedder is None:
                self.state = "loading"
                from clip_mini.embed import Embedder

                self._embedder = Embedder.load(self.model_dir, device=self.device)
                self.state = "loaded"
        return self._embedder

    def unavailable(self) -> Optional[str]:
        """Why this model has no attention maps (not a ViT), or None."""
        backbone = self._model().model.visual.cfg.backbone
        return None if backbone == "vit" else f"attention maps need a ViT image tower; this model uses {backbone}"

    def explain_unavailable(self) -> Optional[str]:
        """Why this model has no match maps (``clip_mini.model.explain.unexplainable``), or None."""
        from clip_mini.model.explain import unexplainable

        return unexplainable(self._model().model)

    def png(self, path: str, size: int = 448) -> bytes:
        from clip_mini.model.attention import attention_map
        from clip_mini.pictures.draw import overlay_image

        embedder = self._model()
        image = load_image(path)
        if embedder.model.preprocess.resize_mode == "center_crop":   # the patch grid covers the centre square
            h, w = image.shape[:2]
            s = min(h, w)
            image = np.ascontiguousarray(image[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s])
        heat = attention_map(embedder.model, embedder.transform(image))
        buf = io.BytesIO()
        overlay_image(image, heat, size=size).save(buf, format="PNG")
        return buf.getvalue()

    def explain_png(self, path: str, text: str, longest: int = THUMB_PX) -> bytes:
        """The image at ``path`` with the match map of ``text`` over it, drawn as ``clip-mini search --explain``
        draws a hit (``pictures.draw.match_overlay``), at the size of its thumbnail (``thumbnail_jpeg``)."""
        from clip_mini.pictures.draw import match_overlay

        embedder = self._model()
        image = load_image(path)   # once: the map is computed and drawn over the same pixels
        heat = embedder.explain(image, text)
        buf = io.BytesIO()
        match_overlay(image, heat, longest).save(buf, format="PNG")
        return buf.getvalue()


class PictureCache:
    """Rendered pictures by key, least recently used first out: at most ``max_bytes`` in all (the newest entry is
    always kept; 0 keeps none) and ``max_entries``. Safe to share between threads; ``hits`` and ``misses`` count ``get``s."""

    def __init__(self, max_bytes: int, max_entries: int = 4096):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Optional[bytes]:
        with self._lock:
            data = self._entries.get(key)
            if data is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return data

    def put(self, key: Hashable, data: bytes) -> None:
        if self.max_bytes <= 0:   # caching off
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._entries[key] = data
            self._bytes += len(data)
            while len(self._entries) > 1 and (self._bytes > self.max_bytes or len(self._entries) > self.max_entries):
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "hits": self.hits, "misses": self.misses}
