"""Decoded-image cache: each image is decoded and resized once, later epochs read raw uint8 pixels.

Layout (one folder per target size and resize mode, e.g. ``~/.cache/clip_mini/images-squash-64-v2/``):

* ``data.bin``: append-only uint8 pixel records, read with one ``pread`` each (no JPEG decode, no resize);
* ``index.tsv``: one line per record, ``key  offset  height  width  crc32``; the key hashes the image's
  absolute path, file size and mtime, so an edited file gets a new key and is decoded again;
* ``lock``: ``flock`` taken only while appending, so several processes (DataLoader workers, two runs) can
  share the cache. The pixels are written before their index line, and every read checks the CRC, so a
  crash or a torn write costs a re-decode, never wrong pixels.

A record is the first step of a transform (``transforms.resize_op`` at the transform's ``base`` geometry): a square
``size`` image for "squash", shorter side ``size`` for "center_crop" (the crop is left to the transform, so
training crops still see the whole picture). The eval transform and the training transform start at different
sizes (``transforms.train_base_size``: training crops need more pixels), so a run uses two folders; ``get`` picks
the one matching the transform. Old records of changed files are not reclaimed; delete the folder to reset it.

Default location: ``$CLIP_MINI_CACHE_DIR``, else ``$XDG_CACHE_HOME/clip_mini``, else ``~/.cache/clip_mini``.
A user cache rather than the data folder, because datasets are often read-only or shared; keys hold absolute
paths, so one cache serves every dataset.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from clip_mini.fileio.checksums import cache_root
from clip_mini.config import DataConfig, PreprocessConfig
from clip_mini.data.images import DEFAULT_MAX_PIXELS, ImageError, load_image
from clip_mini.data.transforms import resize_op, train_base_size

VERSION = 2   # 2: large JPEGs decoded at reduced scale (load_image(min_size=)); v1 records were full decodes
_FREE_MARGIN = 1 << 30   # leave at least 1 GiB free on the cache disk


def default_cache_dir() -> Path:
    """Root of the image caches (see module docstring for the order of precedence): clip_mini's one user cache."""
    return cache_root()


@functools.lru_cache(maxsize=8)
def _resizer(size: int, mode: str):
    return resize_op(size, mode)   # building an albumentations op validates its arguments: not free, so once


def decode_resized(path: str, size: int, mode: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """What the cache stores for ``path``: the decode (a large JPEG at reduced scale, never below ``size``, as
    ``load_image(min_size=)`` does for every pass), then the eval transform's resize step."""
    img = load_image(path, max_pixels, min_size=size)
    return np.ascontiguousarray(_resizer(size, mode)(image=img)["image"], dtype=np.uint8)


class ImageCache:
    """Persistent cache of decoded, resized uint8 RGB images keyed by (path, size, mtime, target size, mode).

    Args:
        cache_dir: root folder (None: ``default_cache_dir()``); a subfolder per size and mode is used.
        size: default target size (the model's image size).
        mode: "squash" or "center_crop", as in ``PreprocessConfig.resize_mode``.
        max_pixels: decompression-bomb limit passed to ``load_image``.
    """

    def __init__(self, cache_dir: Optional[str | Path] = None, size: int = 64, mode: str = "squash",
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        resize_op(size, mode)   # validate mode early
        self.size, self.mode, self.max_pixels = size, mode, max_pixels
        self.root = Path(cache_dir or default_cache_dir())
        self.dir = self.root / f"images-{mode}-{size}-v{VERSION}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0
        self.writable = True
        self._index: dict[str, tuple[int, int, int, int]] = {}
        self._index_pos = 0
        self._pid: Optional[int] = None
        self._fds: dict[str, int] = {}
        self._siblings: dict[tuple[int, str], ImageCache] = {}

    def get(self, path: str | os.PathLike, base: Optional[tuple[int, str]] = None) -> np.ndarray:
        """Pixels of ``path`` resized for this cache: (h, w, 3) uint8, identical on every call for one file.

        Args:
            path: image file.
            base: (size, mode) geometry wanted, as a transform's ``base``; None: this cache's own. Another
                geometry is served by a sibling cache in its own folder under the same root.

        Raises:
            ImageError: the file is missing or cannot be decoded.
        """
        if base is not None and tuple(base) != (self.size, self.mode):
            return self.sibling(*base).get(path)
        path = os.path.abspath(os.fspath(path))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ImageError(path, "missing file") from None
        key = hashlib.sha1(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
        if not self._open():
            return decode_resized(path, self.size, self.mode, self.max_pixels)
        rec = self._index.get(key)
        if rec is None:
            self._refresh()   # another process may have added it since we last looked
            rec = self._index.get(key)
        if rec is not None:
            arr = self._read(rec)
            if arr is not None:
                self.hits += 1
                return arr
        arr = decode_resized(path, self.size, self.mode, self.max_pixels)
        self.misses += 1
        self._append(key, arr)
        return arr

    def sibling(self, size: int, mode: str) -> "ImageCache":
        """The cache of another geometry under the same root (made on first use)."""
        if (size, mode) not in self._siblings:
            self._siblings[(size, mode)] = ImageCache(self.root, size, mode, self.max_pixels)
        return self._siblings[(size, mode)]

    def __len__(self) -> int:
        if self._open():
            self._refresh()
        return len(self._index)

    def _open(self) -> bool:
        """Open the files for this process; False if the cache cannot even be read (then get() just decodes)."""
        # Descriptors are per process: a forked DataLoader worker must not share the parent's flock.
        if self._pid == os.getpid():
            return bool(self._fds)
        self._pid, self._fds = os.getpid(), {}
        try:
            self._fds = {
                "data": os.open(self.dir / "data.bin", os.O_RDWR | os.O_CREAT, 0o644),
                "index": os.open(self.dir / "index.tsv", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644),
                "lock": os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644),
            }
        except OSError:   # a read-only cache (shared, or on a read-only mount) still serves what it holds
            self._close_fds()
            self.writable = False
            try:
                self._fds = {"data": os.open(self.dir / "data.bin", os.O_RDONLY),
                             "index": os.open(self.dir / "index.tsv", os.O_RDONLY)}
            except OSError:
                self._close_fds()
        return bool(self._fds)

    def _refresh(self) -> None:
        end = os.fstat(self._fds["index"]).st_size
        if end <= self._index_pos:
            return
        chunk = os.pread(self._fds["index"], end - self._index_pos, self._index_pos)
        complete = chunk[: chunk.rfind(b"\n") + 1]   # a line still being written is read next time
        for line in complete.decode("ascii", errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) == 5 and all(p.isdigit() for p in parts[1:]):
                self._index[parts[0]] = tuple(int(p) for p in parts[1:])
        self._index_pos += len(complete)

    def _read(self, rec: tuple[int, int, int, int]) -> Optional[np.ndarray]:
        offset, h, w, crc = rec
        buf = bytearray(h * w * 3)
        if os.preadv(self._fds["data"], [buf], offset) != len(buf) or zlib.crc32(buf) != crc:
            return None   # torn or lost write: decode again
        return np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 3)

    def _append(self, key: str, arr: np.ndarray) -> None:
        if not self.writable:
            return
        data = arr.tobytes()
        try:
            with _Locked(self._fds["lock"]):
                offset = os.fstat(self._fds["data"]).st_size
                os.pwrite(self._fds["data"], data, offset)
                line = f"{key}\t{offset}\t{arr.shape[0]}\t{arr.shape[1]}\t{zlib.crc32(data)}\n"
                os.write(self._fds["index"], line.encode("ascii"))
        except OSError as e:
            # Full disk or lost permission: keep training from fresh decodes, just stop caching.
            self.writable = False
            print(f"warning: image cache {self.dir} is no longer written ({e.strerror or e}); "
                  "images are decoded every epoch", file=sys.stderr)

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def close(self) -> None:
        if self._pid == os.getpid():
            self._close_fds()
        self._fds, self._pid = {}, None
        for sibling in self._siblings.values():
            sibling.close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_fds={}, _pid=None)   # reopened lazily in the receiving process
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Locked:
    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self):
        try:
            import fcntl
        except ImportError:   # not POSIX: no cross-process lock, single-process use stays correct
            return self
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        try:
            import fcntl
        except ImportError:
            return
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def cache_geometry(cfg: DataConfig, pre: PreprocessConfig) -> dict[str, tuple[int, str]]:
    """(size, resize mode) of the records for the eval transform and for the training transform."""
    return {"eval": (pre.image_size, pre.resize_mode),
            "train": (train_base_size(pre.image_size, cfg.scale_min), pre.resize_mode)}


def make_cache(cfg: DataConfig, pre: PreprocessConfig, n_images: int) -> Optional[ImageCache]:
    """The cache if ``cfg.cache`` is on and it fits on disk (with 1 GiB to spare), else None with a reason.

    Args:
        cfg: ``cache`` (on/off), ``cache_dir`` (None: default location), ``scale_min`` (training geometry).
        pre: the model's image size and resize mode, which the records are made for.
        n_images: number of distinct images that will be read.
    """
    if not cfg.cache:
        return None
    size, mode = pre.image_size, pre.resize_mode
    root = Path(cfg.cache_dir or default_cache_dir())
    # Every image gets an eval and a training record; center_crop keeps the aspect ratio, so records are larger
    # (1.5x covers 4:3 and 3:2 photos).
    sides = [s for s, _ in cache_geometry(cfg, pre).values()]
    need = int(n_images * sum(s * s for s in sides) * 3 * (1.0 if mode == "squash" else 1.5))
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
        if need + _FREE_MARGIN > free:
            print(f"data: image cache off: needs ~{need >> 20} MiB at {root}, {free >> 20} MiB free")
            return None
        return ImageCache(root, size, mode)
    except OSError as e:
        print(f"data: image cache off: cannot use {root} ({e.strerror or e})")
        return None
