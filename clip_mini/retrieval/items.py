"""The items table of an index (format version 4): columnar, memory-mapped, read row by row.

An index of millions of rows used to read its whole items CSV into Python lists before the first query (seconds,
and gigabytes of strings at 10M rows). ``items-<gen>.cols`` holds each column as one contiguous section, so
opening it maps the file and parses a small header; a row's value is read when asked for. Only numpy: no pyarrow
import on the query path.

Layout::

    MAGIC (16 bytes) | header length (uint64, little-endian) | header (UTF-8 JSON) | sections, 64-byte aligned

    header = {"rows": n, "columns": [{"name", "kind": "int64" | "str", "offset", "nbytes"
                                      [, "blob_offset", "blob_nbytes"]}, ...]}

An ``int64`` column is n little-endian int64. A ``str`` column is n + 1 int64 offsets into a blob of UTF-8 bytes
(``surrogateescape``: a file name that is not valid UTF-8 round-trips); value i is ``blob[offsets[i]:offsets[i+1]]``.

Columns read back as ``Column`` sequences (len, index, slice, iterate, compare with a list), so code written for
the lists of the CSV format works on either.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from clip_mini.errors import ItemsFormatError

MAGIC = b"CLIPMINI-ITEMS1\n"
_ALIGN = 64
_HEADER_ROOM = 8192   # bytes reserved for the header (a few hundred are used): sections follow at a fixed offset
_CHUNK = 65536        # rows encoded / decoded per step
INT_COLUMNS = ("size", "mtime_ns", "offset", "length", "taken")   # taken: when the photo was taken (retrieval.taken)
ROOTED_COLUMNS = ("path", "shard")   # joined to the root given to read_items


class Column(Sequence):
    """A read-only column of an items table."""

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None

    def tolist(self) -> list:
        return list(self)


class IntColumn(Column):
    def __init__(self, values: np.ndarray):
        self._v = values

    def __len__(self) -> int:
        return len(self._v)

    @property
    def values(self) -> np.ndarray:
        """The column as a read-only int64 array (the memory map itself: nothing is read until used)."""
        return self._v

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._v[i].tolist()
        return int(self._v[i])

    def __iter__(self):
        for s in range(0, len(self._v), _CHUNK):
            yield from self._v[s:s + _CHUNK].tolist()


class StrColumn(Column):
    """UTF-8 strings by offsets into a blob; with ``root``, relative paths are returned joined to it."""

    def __init__(self, offsets: np.ndarray, blob: np.ndarray, name: str, file: Path, root: Optional[str] = None):
        self._off, self._blob, self._name, self._file = offsets, blob, name, file
        self._root = os.path.normpath(root) if root is not None else None
        self._prefix = None if self._root is None else self._root.rstrip(os.sep) + os.sep

    def with_root(self, root: Optional[str]) -> "StrColumn":
        return StrColumn(self._off, self._blob, self._name, self._file, root)

    def stored(self) -> tuple[np.ndarray, np.ndarray]:
        """The values as stored, not joined to any root: (n + 1 int64 offsets, uint8 UTF-8 blob), both memory maps;
        value i is ``blob[offsets[i]:offsets[i + 1]]``. For whole-column scans in numpy (search filters)."""
        return self._off, self._blob

    def __len__(self) -> int:
        return len(self._off) - 1

    def _decode(self, a: int, b: int, row: int) -> str:
        if not 0 <= a <= b <= len(self._blob):
            raise ItemsFormatError(f"{self._file} is corrupt: column {self._name}, row {row} points outside the file")
        s = bytes(self._blob[a:b]).decode("utf-8", "surrogateescape")
        return s if self._prefix is None else self._join(s)

    def _join(self, p: str) -> str:
        if os.sep == "/" and not (p.startswith("..") or p.startswith("/")):
            return self._prefix + p   # stored paths are relpath output (already normal): a concatenation
        return os.path.normpath(os.path.join(self._root, p))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} of {n}")
        return self._decode(int(self._off[i]), int(self._off[i + 1]), i)

    def __iter__(self):
        n = len(self)
        for s in range(0, n, _CHUNK):
            off = self._off[s:min(n, s + _CHUNK) + 1].tolist()
            a0, b0 = off[0], off[-1]
            if not 0 <= a0 <= b0 <= len(self._blob) or any(x > y for x, y in zip(off, off[1:])):
                raise ItemsFormatError(f"{self._file} is corrupt: column {self._name} has bad offsets near row {s}")
            chunk = bytes(self._blob[a0:b0])
            for a, b in zip(off, off[1:]):
                v = chunk[a - a0:b - a0].decode("utf-8", "surrogateescape")
                yield v if self._prefix is None else self._join(v)


def write_items(path: str | Path, items: dict[str, Iterable], names: Sequence[str]) -> None:
    """Write columns ``names`` of ``items`` (sequences of equal length; INT_COLUMNS as integers, the rest as
    strings) to ``path`` atomically, streaming: no column is held encoded in memory at once."""
    from clip_mini.fileio.atomic import atomic_write_with

    atomic_write_with(path, lambda tmp: _write(Path(tmp), items, names))


def _pad(f) -> int:
    pos = f.tell()
    f.write(b"\0" * (-pos % _ALIGN))
    return f.tell()


def _write(tmp: Path, items: dict[str, Iterable], names: Sequence[str]) -> None:
    columns, rows = [], None
    with open(tmp, "wb") as f:
        f.write(b"\0" * _HEADER_ROOM)
        for name in names:
            values = items[name]
            if name in INT_COLUMNS:
                arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype="<i8")
                start = _pad(f)
                f.write(arr.tobytes())
                columns.append({"name": name, "kind": "int64", "offset": start, "nbytes": arr.nbytes})
                count = len(arr)
            else:
                blob_start = _pad(f)
                lengths = []
                buf: list[bytes] = []
                for v in values:
                    b = str(v).encode("utf-8", "surrogateescape")
                    buf.append(b)
                    lengths.append(len(b))
                    if len(buf) == _CHUNK:
                        f.write(b"".join(buf))
                        buf = []
                f.write(b"".join(buf))
                blob_nbytes = f.tell() - blob_start
                offsets = np.zeros(len(lengths) + 1, "<i8")
                np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
                start = _pad(f)
                f.write(offsets.tobytes())
                columns.append({"name": name, "kind": "str", "offset": start, "nbytes": offsets.nbytes,
                                "blob_offset": blob_start, "blob_nbytes": blob_nbytes})
                count = len(lengths)
            if rows is None:
                rows = count
            elif count != rows:
                raise ValueError(f"items column {name} has {count} rows, {names[0]} has {rows}")
        header = json.dumps({"rows": rows or 0, "columns": columns}).encode()
        if len(MAGIC) + 8 + len(header) > _HEADER_ROOM:
            raise ValueError("items header too large")
        f.seek(0)
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)


def read_items(path: str | Path, root: Optional[str] = None) -> dict[str, Column]:
    """Open an items file: ``{column: Column}``, with the ``path`` and ``shard`` columns joined to ``root`` when
    given.

    Raises ItemsFormatError (a damaged file: wrong magic, truncated, sections outside the file)."""
    path = Path(path)
    size = path.stat().st_size
    if size < len(MAGIC) + 8:
        raise ItemsFormatError(f"{path} is corrupt: truncated ({size} bytes)")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(raw[:len(MAGIC)]) != MAGIC:
        raise ItemsFormatError(f"{path} is corrupt: not a clip_mini items file")
    hlen = int.from_bytes(bytes(raw[len(MAGIC):len(MAGIC) + 8]), "little")
    if len(MAGIC) + 8 + hlen > min(size, _HEADER_ROOM):
        raise ItemsFormatError(f"{path} is corrupt: truncated header")
    try:
        header = json.loads(bytes(raw[len(MAGIC) + 8:len(MAGIC) + 8 + hlen]).decode())
        rows = int(header["rows"])
        specs = header["columns"]
    except (ValueError, KeyError, TypeError) as e:
        raise ItemsFormatError(f"{path} is corrupt: bad header ({e})") from None

    def section(offset, nbytes, what: str) -> np.ndarray:
        if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset and 0 <= nbytes
                and offset + nbytes <= size):
            raise ItemsFormatError(f"{path} is corrupt: {what} lies outside the file (truncated?)")
        return raw[offset:offset + nbytes]

    cols: dict[str, Column] = {}
    for spec in specs:
        name, kind = spec.get("name"), spec.get("kind")
        body = section(spec.get("offset"), spec.get("nbytes"), f"column {name}")
        if kind == "int64":
            if body.nbytes != 8 * rows or spec["offset"] % 8:
                raise ItemsFormatError(f"{path} is corrupt: column {name} holds {body.nbytes // 8} rows, not {rows}")
            cols[name] = IntColumn(body.view("<i8"))
        elif kind == "str":
            blob = section(spec.get("blob_offset"), spec.get("blob_nbytes"), f"column {name}'s text")
            if body.nbytes != 8 * (rows + 1) or spec["offset"] % 8:
                raise ItemsFormatError(f"{path} is corrupt: column {name} holds {body.nbytes // 8 - 1} rows, "
                                       f"not {rows}")
            off = body.view("<i8")
            if int(off[0]) != 0 or int(off[-1]) != blob.nbytes:
                raise ItemsFormatError(f"{path} is corrupt: column {name}'s offsets do not span its text")
            col = StrColumn(off, blob, name, path)
            # paths and WebDataset shard files are stored relative to the index's root (absolute ones stay so)
            cols[name] = col.with_root(root) if name in ROOTED_COLUMNS and root is not None else col
        else:
            raise ItemsFormatError(f"{path} is corrupt: column {name} of unknown kind {kind!r}")
    return cols
