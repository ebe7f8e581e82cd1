"""Safe image loading: every source becomes an (H, W, 3) uint8 RGB array, or an ``ImageError`` that says why.

Two entry points with different costs (``load_image_bytes`` is ``load_image`` for bytes in memory):

* ``check_images`` runs once when a dataset is built. It reads headers only (plus the last few KB of JPEG/PNG
  files to catch truncation), so 7k images take about a second. It never decodes pixels.
* ``load_image`` fully decodes one image at read time. Anything the header check missed (a file that went bad
  later, corrupt entropy data) surfaces here as ``ImageError``, which the datasets catch.

Mode handling: grayscale/1-bit/palette become RGB; transparency (RGBA, LA, palette with a transparent index) is
composited on white, because captions describe what a viewer sees; CMYK goes through Pillow's conversion;
16-bit and 32-bit integer images are scaled to 8 bits instead of clipped; EXIF orientation is applied.
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from clip_mini.fileio.bounded_read import UnreadableFileError, read_file, read_files
from clip_mini.errors import ImageError

# 64 MP: far above any photo a CLIP pipeline needs, far below what would exhaust memory when decoded (~200 MB).
DEFAULT_MAX_PIXELS = 64_000_000

# Extension -> Pillow format names that are honest for it. Used to catch "wrongly named" files.
_EXT_FORMATS = {
    ".jpg": {"JPEG", "MPO"}, ".jpeg": {"JPEG", "MPO"}, ".jpe": {"JPEG"}, ".png": {"PNG"}, ".gif": {"GIF"},
    ".bmp": {"BMP", "DIB"}, ".webp": {"WEBP"}, ".tif": {"TIFF"}, ".tiff": {"TIFF"}, ".ppm": {"PPM"},
    ".pgm": {"PPM"}, ".pbm": {"PPM"},
}
# Only these decoders run: Pillow would otherwise try every format it knows, EPS included (which runs Ghostscript).
# (MPO is not listed: Pillow's JPEG opener returns it.)
_FORMATS = ["BMP", "DIB", "GIF", "JPEG", "PNG", "PPM", "TIFF", "WEBP"]
# 1 GiB: above any image within DEFAULT_MAX_PIXELS (64 MP of 16-bit RGBA is 512 MB uncompressed); the bytes are
# read into memory before decoding, so an endless or huge file must stop here.
DEFAULT_MAX_FILE_BYTES = 1 << 30
_TAIL = 4096   # bytes read from the end of a JPEG to look for its end-of-image marker
_HEAD = 1 << 16   # bytes read for the header check; files whose header is longer are read whole

ImageSource = Union[str, os.PathLike, Image.Image, np.ndarray]


def load_image(src: ImageSource, max_pixels: int = DEFAULT_MAX_PIXELS, min_size: int | None = None) -> np.ndarray:
    """Decode ``src`` into an (H, W, 3) uint8 RGB array.

    Args:
        src: a file path, a ``PIL.Image.Image``, or a numpy array shaped (H, W), (H, W, 1), (H, W, 3) or
            (H, W, 4), uint8 or float in [0, 1] (4 channels are RGBA, composited on white).
        max_pixels: images with more pixels are refused before decoding (decompression bombs).
        min_size: the smallest width and height the caller needs (the model's resize target). A JPEG file at
            least twice that size on both sides is decoded at 1/2, 1/4 or 1/8 scale by libjpeg itself (Pillow's
            ``draft``), never below ``min_size``: a camera photo costs a fraction of a full decode, and the
            resize that follows antialiases from a still larger image. Other formats decode in full.

    Raises:
        ImageError: missing, unreadable, truncated, oversized or unsupported input.
    """
    if isinstance(src, np.ndarray):
        return _from_array(src, "<array>")
    if isinstance(src, Image.Image):
        return _from_pil(src, "<PIL image>", max_pixels)
    if not isinstance(src, (str, os.PathLike)):
        raise ImageError(repr(src)[:80], f"unsupported image source type {type(src).__name__}")
    path = os.fspath(src)
    return _decode_file(path, _read_whole(path), max_pixels, min_size)


def load_images(paths: Sequence[str], max_pixels: int = DEFAULT_MAX_PIXELS, min_size: int | None = None
                ) -> Iterator[tuple[str, np.ndarray | ImageError]]:
    """``(path, load_image(path))`` for each path in order, or ``(path, the ImageError)``: the files are read
    ahead on one helper thread (``bounded_read.read_files``) instead of one hand-off per file."""
    for path, data in read_files([os.fspath(p) for p in paths], max_bytes=DEFAULT_MAX_FILE_BYTES):
        try:
            yield path, _decode_file(path, _checked_bytes(path, data), max_pixels, min_size)
        except ImageError as e:
            yield path, e


def load_image_bytes(data: bytes, name: str, max_pixels: int = DEFAULT_MAX_PIXELS, min_size: int | None = None
                     ) -> np.ndarray:
    """``load_image`` for an encoded image held in memory (an upload, a tar member): the same format allow-list,
    pixel limit, reduced JPEG decode and Pillow error ladder (``open_image``) as a file, with ``name`` (where the
    bytes came from) in every ``ImageError``.

    Raises:
        ImageError: empty, truncated, oversized or not-an-image bytes, naming ``name``.
    """
    if not data:
        raise ImageError(name, "empty (0 bytes)")
    return _decode_file(name, bytes(data), max_pixels, min_size)


def _decode_file(path: str, data: bytes, max_pixels: int, min_size: int | None) -> np.ndarray:
    with open_image(data, path) as im:
        if min_size and im.format == "JPEG":
            _check_pixels(im, path, max_pixels)   # on the file's own size, before draft shrinks ``im.size``
            im.draft(None, (min_size, min_size))
        return _from_pil(im, path, max_pixels)


@contextmanager
def open_image(data: bytes, name: str, formats: Sequence[str] = _FORMATS, not_image: Optional[str] = None
               ) -> Iterator[Image.Image]:
    """``Image.open`` on bytes, with only ``formats``' decoders; whatever Pillow raises while the image is opened
    or decoded inside the block becomes an ``ImageError`` naming ``name`` (``ImageError`` passes through).

    The one place that knows Pillow's failure modes: an unknown format (``not_image`` says what to send instead),
    a decompression bomb past Pillow's own limit, and truncation or corrupt data, which Pillow reports as
    ``OSError`` ("image file is truncated", "broken data stream"), ``SyntaxError``, ``ValueError`` or ``EOFError``.
    """
    try:
        with Image.open(io.BytesIO(data), formats=list(formats)) as im:
            yield im
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(name, not_image or "not an image (or a format other than " + ", ".join(formats) + ")") \
            from None
    except Image.DecompressionBombError as e:
        raise ImageError(name, f"too many pixels ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(name, f"cannot decode: {type(e).__name__}: {e}") from None


def _read_whole(path: str) -> bytes:
    try:
        data = read_file(path, max_bytes=DEFAULT_MAX_FILE_BYTES)[0]
    except OSError as e:
        data = e
    return _checked_bytes(path, data)


def _checked_bytes(path: str, data: bytes | OSError) -> bytes:
    """A file's bytes, or the ``ImageError`` for what reading it gave (an ``OSError``, or nothing)."""
    if isinstance(data, FileNotFoundError):
        raise ImageError(path, "missing file")
    if isinstance(data, UnreadableFileError):
        raise ImageError(path, data.reason)
    if isinstance(data, OSError):
        raise ImageError(path, f"cannot read: {data.strerror or data}")
    if not data:
        raise ImageError(path, "empty file (0 bytes)")
    return data


def _check_pixels(im: Image.Image, name: str, max_pixels: int) -> None:
    w, h = im.size
    if w * h > max_pixels:
        raise ImageError(name, f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (decompression bomb?)")


def _from_pil(im: Image.Image, name: str, max_pixels: int) -> np.ndarray:
    _check_pixels(im, name, max_pixels)
    im = ImageOps.exif_transpose(im)   # phone photos store rotation in EXIF; captions describe the upright view
    mode = im.mode
    if mode in ("I", "F") or mode.startswith("I;16"):
        arr = np.asarray(im)
        if mode == "F" and arr.size and np.nanmax(arr) > 1.0:
            arr = arr / 255.0   # float images from files are usually 0..255; arrays passed in are 0..1
        return _from_array(arr, name)
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    elif mode in ("LA", "La", "PA", "RGBa"):
        im = im.convert("RGBA")
    if im.mode == "RGBA":
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, im)
    if im.mode != "RGB":
        im = im.convert("RGB")   # L, 1, CMYK, YCbCr, LAB, HSV
    return np.asarray(im, dtype=np.uint8).copy()


def _from_array(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)) or 0 in arr.shape:
        raise ImageError(name, f"array shape {arr.shape} is not (H, W), (H, W, 1), (H, W, 3) or (H, W, 4)")
    arr = _to_uint8(arr, name)
    if arr.ndim == 2:
        return np.repeat(arr[:, :, None], 3, axis=2)
    if arr.shape[2] == 4:
        # Composite on white in integer arithmetic: out = rgb * a + 255 * (1 - a).
        alpha = arr[:, :, 3:4].astype(np.uint16)
        rgb = (arr[:, :, :3].astype(np.uint16) * alpha + 255 * (255 - alpha) + 127) // 255
        return rgb.astype(np.uint8)
    return np.ascontiguousarray(arr)


def _to_uint8(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype == bool:
        return arr.astype(np.uint8) * 255
    if np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():
            raise ImageError(name, "float image contains NaN or infinity")
        return (np.clip(arr, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if np.issubdtype(arr.dtype, np.integer):
        # 16-bit (and Pillow's 32-bit "I" mode holding 16-bit PNG data): scale the full range down, don't clip.
        top = 65535 if arr.max(initial=0) > 255 or arr.dtype.itemsize == 2 else 255
        return ((np.clip(arr, 0, top).astype(np.uint32) * 255 + top // 2) // top).astype(np.uint8)
    raise ImageError(name, f"unsupported array dtype {arr.dtype}")


def probe_image(path: str, max_pixels: int = DEFAULT_MAX_PIXELS, listings: dict | None = None) -> str | None:
    """Header-only check of one file; returns a reason string if it is unusable, else None."""
    try:
        head, tail, size = read_file(path, head=_HEAD, tail=_TAIL, max_bytes=DEFAULT_MAX_FILE_BYTES)
    except FileNotFoundError:
        return "missing file" + _case_hint(path, {} if listings is None else listings)
    except UnreadableFileError as e:
        return e.reason
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    if size == 0:
        return "empty file (0 bytes)"
    header = _header(head)
    if isinstance(header, str) and size > len(head):   # a header longer than _HEAD (big EXIF, TIFF IFD at the end)
        try:
            header = _header(read_file(path, max_bytes=DEFAULT_MAX_FILE_BYTES)[0])
        except OSError as e:
            return f"cannot read: {getattr(e, 'reason', None) or e.strerror or e}"
    if isinstance(header, str):
        return header
    fmt, (w, h) = header
    if w * h > max_pixels:
        return f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (decompression bomb?)"
    ext = os.path.splitext(path)[1].lower()
    if ext in _EXT_FORMATS and fmt not in _EXT_FORMATS[ext]:
        return f"wrongly named: extension {ext} but the content is {fmt}"
    return _tail_check(fmt, tail)


def _header(data: bytes) -> tuple[str, tuple[int, int]] | str:
    """``(format, (width, height))`` from the start of a file, or the reason it cannot be read."""
    try:
        with open_image(data, "header", not_image="not an image") as im:
            return im.format, im.size
    except ImageError as e:
        return e.reason


def _tail_check(fmt: str, tail: bytes) -> str | None:
    # A cheap truncation test: JPEGs end with the EOI marker FFD9, PNGs with the IEND chunk. Inside JPEG
    # entropy data 0xFF is always stuffed (FF00), so FFD9 in the tail means the stream really ended.
    if fmt == "PNG" and b"IEND" not in tail[-12:]:
        return "truncated (no PNG IEND chunk)"
    if fmt in ("JPEG", "MPO") and b"\xff\xd9" not in tail:
        return "truncated (no JPEG end-of-image marker)"
    return None


def _case_hint(path: str, listings: dict[str, list[str]]) -> str:
    # A name that differs only in case ("IMG_1.JPG" vs "img_1.jpg") works on macOS but not Linux; say so.
    folder, name = os.path.split(path)
    if folder not in listings:
        try:
            listings[folder] = os.listdir(folder or ".")
        except OSError:
            listings[folder] = []
    matches = [n for n in listings[folder] if n.lower() == name.lower()]
    return f" (a file named {matches[0]!r} exists: names are case-sensitive)" if matches else ""


def check_images(paths: Iterable[str], max_pixels: int = DEFAULT_MAX_PIXELS, progress: bool = False
                 ) -> dict[str, str]:
    """Header-check many files once; returns ``{path: reason}`` for each unusable one.

    Missing, zero-byte, non-image, wrongly named (extension disagrees with content), oversized and
    tail-truncated JPEG/PNG files are reported. Pixels are not decoded, so damage in the middle of a file is
    only found by ``load_image`` at read time.
    """
    paths = list(dict.fromkeys(str(p) for p in paths))
    listings: dict[str, list[str]] = {}   # folder listings for case hints, read once per folder
    if progress:
        from tqdm import tqdm

        paths = tqdm(paths, desc="checking images", unit="img", leave=False)
    bad = {}
    for p in paths:
        reason = probe_image(p, max_pixels, listings)
        if reason is not None:
            bad[p] = reason
    return bad
