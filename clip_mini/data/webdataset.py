"""WebDataset shards: reading samples (with their byte offsets), checking them, and reading an image back.

A shard is a tar file holding ``KEY.jpg`` (or .png/.webp) + ``KEY.txt`` (+ ``KEY.json``) per sample, the layout
img2dataset writes; shard lists are brace patterns (``data/{000000..000099}.tar``). The ``webdataset`` library
expands the patterns and opens the URLs (local paths, ``pipe:`` commands, http), and writes shards in
``clip-mini convert``; the samples are grouped here, from ``tarfile``'s stream, because an index needs each image's
offset in the tar (to read one image back without unpacking the shard) and because damage must be reported with
the shard and the key and must not cost the samples before it.
"""
from __future__ import annotations

import io
import os
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np

from clip_mini.data.readers import DataError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
Report = Callable[[str, str, str], None]   # (shard, key, reason) of a skipped sample


def _wds():
    try:
        import webdataset
    except ImportError:
        raise DataError("WebDataset shards need the webdataset library: pip install 'clip-mini[webdataset]'") \
            from None
    return webdataset


def is_local(url: str) -> bool:
    return not url.startswith("pipe:") and "://" not in url


def expand_shards(pattern: str) -> list[str]:
    """The shard URLs a brace pattern names (``::`` separates patterns); local shards must exist.

    Raises:
        DataError: an empty pattern or a local shard that does not exist.
    """
    urls = _wds().shardlists.expand_urls(pattern) if pattern and pattern.strip() else []
    if not urls:
        raise DataError(f"no shards in {pattern!r}: give a tar path or a brace pattern like "
                        "data/{000000..000009}.tar")
    missing = [u for u in urls if is_local(u) and not os.path.isfile(u)]
    if missing:
        raise DataError(f"{len(missing)} of {len(urls)} shards of {pattern!r} do not exist, e.g. {missing[0]}")
    return [os.path.abspath(u) if is_local(u) else u for u in urls]


def shard_identity_of(url: str) -> tuple[int, int]:
    """(size, mtime_ns) of a local shard, (-1, -1) for a URL: what says a shard is unchanged."""
    try:
        st = os.stat(url)
        return st.st_size, st.st_mtime_ns
    except OSError:
        return -1, -1


@dataclass
class Sample:
    """One sample of a shard: the image bytes and where they sit in the tar, the caption, the optional JSON."""
    shard: str
    key: str
    image: Optional[bytes] = None
    image_ext: str = ""
    offset: int = -1            # byte offset of the image member's data in the tar
    caption: Optional[str] = None
    meta: Optional[bytes] = None
    extra: dict = field(default_factory=dict)

    def problem(self) -> Optional[str]:
        """Why the sample cannot be used (None when it can)."""
        if self.image is None:
            return "missing image (no .jpg/.jpeg/.png/.webp member)"
        if not self.image:
            return f"empty image member .{self.image_ext}"
        if self.caption is None:
            return "missing caption (no .txt member)"
        if not self.caption.strip():
            return "empty caption"
        return None


def _split_name(name: str) -> tuple[str, str]:
    # webdataset's convention: the key is everything before the first dot of the file name (dirs kept)
    d, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return os.path.join(d, stem) if d else stem, ext.lower()


def _add(sample: Sample, ext: str, data: bytes, offset: int, report: Report) -> None:
    if ext in IMAGE_EXTS and sample.image is None:
        sample.image, sample.image_ext, sample.offset = data, ext, offset
    elif ext == "txt":
        try:
            sample.caption = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            sample.caption = ""
            report(sample.shard, sample.key, "caption is not UTF-8")
    elif ext == "json":
        sample.meta = data
    else:
        sample.extra[ext] = data


def iter_shard(url: str, report: Report, images: bool = True) -> Iterator[Sample]:
    """The samples of one shard in tar order (members of one key must be adjacent, as webdataset requires).

    Unusable samples are passed to ``report(shard, key, reason)`` and not yielded. A damaged or truncated tar
    yields every sample completed before the damage, then reports the shard and the key being read.
    ``images=False`` skips the image bytes (captions only; the offsets are still recorded).
    """
    current: Optional[Sample] = None
    try:
        stream = open(url, "rb") if is_local(url) else _wds().gopen(url, "rb")
    except OSError as e:
        report(url, "", f"cannot open shard: {e.strerror or e}")
        return
    with stream:
        try:
            # streaming mode: the same for pipes, http and files (and gzip)
            tar = tarfile.open(fileobj=stream, mode="r|*")
            for info in tar:
                if not info.isreg():
                    continue
                key, ext = _split_name(info.name)
                if current is None or key != current.key:
                    if current is not None:
                        yield from _checked(current, report)
                    current = Sample(url, key)
                wanted = images or ext not in IMAGE_EXTS
                data = tar.extractfile(info).read() if wanted else b"?"
                if wanted and len(data) != info.size:
                    raise tarfile.ReadError(f"member {info.name} is cut short")
                _add(current, ext, data, info.offset_data, report)
                tar.members = []   # streaming: do not keep every member's header
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            # The sample being read may be incomplete: report it (and the rest of the shard) as lost.
            report(url, current.key if current else "", f"damaged or truncated tar, rest of shard skipped: {e}")
            return
    if current is not None:
        yield from _checked(current, report)


def _checked(sample: Sample, report: Report) -> Iterator[Sample]:
    why = sample.problem()
    if why is None:
        yield sample
    else:
        report(sample.shard, sample.key, why)


def decode_image(sample_or_bytes, name: str) -> np.ndarray:
    """Decode image bytes into (H, W, 3) uint8 with clip_mini's safe loader; errors name ``name`` (shard:key)."""
    from clip_mini.data.images import load_image_bytes

    data = sample_or_bytes.image if isinstance(sample_or_bytes, Sample) else sample_or_bytes
    return load_image_bytes(data, name)


def read_member(shard: str, offset: int, length: int) -> bytes:
    """Read one member's bytes back from a local shard by offset (no unpacking of the rest).

    Raises:
        DataError: a shard that is not a local file, is gone, or is shorter than the recorded member.
    """
    if not is_local(shard):
        raise DataError(f"{shard}: reading an image back needs a local shard (this one is a URL)")
    try:
        with open(shard, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except OSError as e:
        raise DataError(f"{shard}: cannot read the image at byte {offset}: {e.strerror or e}") from None
    if len(data) != length:
        raise DataError(f"{shard}: shorter than recorded (image at byte {offset}, {length} bytes): was it rewritten?")
    return data


class SkipLog:
    """Collects skipped samples (shard, key, reason); prints the first few, keeps all for a skipped.csv."""

    def __init__(self, prefix: str = "webdataset", show: int = 5):
        self.rows: list[tuple[str, str, str]] = []
        self.prefix, self.show = prefix, show

    def __call__(self, shard: str, key: str, reason: str) -> None:
        self.rows.append((shard, key, reason))
        if len(self.rows) <= self.show:
            print(f"{self.prefix}: skipped {os.path.basename(shard)}:{key}: {reason}")

    def write_csv(self, path) -> None:
        import csv

        from clip_mini.fileio.atomic import atomic_write_text

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["shard", "key", "reason"])
        w.writerows(self.rows)
        atomic_write_text(path, buf.getvalue())
