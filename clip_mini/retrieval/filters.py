"""Search filters: which rows a query may return (a folder, a glob, a date range), applied before the top-k.

``clip-mini search --under/--glob/--after/--before``, ``EmbeddingIndex.search / search_text / search_image / hits``
(``under=``, ``glob=``, ``after=``, ``before=``, or ``filters=SearchFilter.of(...)``) and ``clip-mini serve``'s API
all go through this module, so a filter means the same everywhere:

* ``under``: a folder inside the index's folder (the folder its paths are stored relative to: ``clip-mini index
  --images photos/`` gives ``photos/``, or the deepest folder holding every image), relative to it (``2024/trip``)
  or absolute. A folder outside it is an error naming the index's folder.
* ``glob``: a pattern on the path relative to the index's folder, as ``.gitignore`` reads one: ``*`` and ``?`` do
  **not** cross ``/``; ``**`` does (``2024/**/*.jpg``; ``**/`` is zero or more folders); ``[abc]``, ``[a-z]``,
  ``[!abc]`` as in ``fnmatch``. A pattern without ``/`` is matched against the file name at any depth (``*.jpg``,
  ``IMG_2*``); one with ``/`` against the whole relative path (a leading ``/`` only anchors it); one ending in ``/``
  matches everything in the folders it names (``2024/trip/``; ``trip/``: every folder named trip, at any depth).
  Case-sensitive (``*.[jJ][pP][gG]`` for both cases). ``*.jpg``, ``name.jpg`` and ``folder/**`` are matched on the
  path bytes in numpy; other patterns by one regular-expression scan over all the paths (~0.1-0.3 s at 1M rows).
* ``after`` / ``before``: when the photo was taken (``taken``: EXIF DateTimeOriginal, else DateTime, else the file's
  mtime, recorded at index time, all as local wall-clock time). ``after D`` keeps photos taken at or after the
  start of D, ``before D`` those taken before the start of D: ``after 2024-01-01 before 2025-01-01`` is the year
  2024. D is ``YYYY``, ``YYYY-MM``, ``YYYY-MM-DD``, ``YYYY-MM-DDTHH:MM`` or ``YYYY-MM-DDTHH:MM:SS`` (a space for
  the T is fine), or a ``datetime.date`` / ``datetime``. An index built before dates were recorded refuses date
  filters (``DatesNotIndexedError``: re-index; its embeddings are reused) and still takes the others.

How it runs: the kept row ids are found from the items table in numpy (the path column's UTF-8 bytes, the
``taken`` column; no Python string per row on a columnar index) and cached per index and filter; then only those
rows are scored (``search_rows``): gathered in blocks from the memory-mapped rows and searched with the library's
exact kernels (``retrieval.search``), their top-k merged by score, ties by row id. A filter that keeps 1% of the rows
reads and scores 1% of the rows, and ``k`` results come back whenever ``k`` rows pass. A filtered search is exact
whatever the back end asked for (faiss's approximate indexes cannot skip rows without losing the top-k).
"""
from __future__ import annotations

import calendar
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any, Optional

import numpy as np

from clip_mini.errors import DatesNotIndexedError, FilterError
from clip_mini.retrieval.format import items_root
from clip_mini.retrieval.items import IntColumn, StrColumn
from clip_mini.retrieval.reader import IndexReader, _unit_queries
from clip_mini.retrieval.rows import BF16Rows
from clip_mini.retrieval.taken import TAKEN_COLUMNS

DATE_FORMATS = ("YYYY", "YYYY-MM", "YYYY-MM-DD", "YYYY-MM-DDTHH:MM", "YYYY-MM-DDTHH:MM:SS")
_DATE = re.compile(r"(\d{4})(?:-(\d{1,2})(?:-(\d{1,2})(?:[T ](\d{1,2}):(\d{2})(?::(\d{2}))?)?)?)?")
_GATHER_BYTES = 32 << 20   # rows gathered (and searched) per block: memory stays bounded whatever the filter keeps
_CACHE = 16                # filters whose kept rows an index remembers ...
_CACHE_BYTES = 256 << 20   # ... within this much memory (the newest is always kept)


@dataclass(frozen=True)
class SearchFilter:
    """Which rows a search may return; every field None (``SearchFilter()``) keeps them all. Build one with ``of``,
    which checks and parses its arguments; ``rows(index)`` gives the kept row ids of an index."""

    under: Optional[str] = None    # a folder, as given (resolved against each index's folder)
    glob: Optional[str] = None     # a pattern on the path relative to the index's folder
    after: Optional[int] = None    # taken >= after (wall-clock seconds, see ``retrieval.taken``)
    before: Optional[int] = None   # taken < before

    @classmethod
    def of(cls, under: Any = None, glob: Optional[str] = None, after: Any = None, before: Any = None
           ) -> "SearchFilter":
        """A filter from user input: ``under`` a folder (str or path), ``glob`` a pattern, ``after`` / ``before`` a
        date string in one of ``DATE_FORMATS`` or a ``date`` / ``datetime``; None or "" leaves a filter out.

        Raises:
            FilterError: a date in no accepted format (the message lists them), an empty date range, a glob with a
                NUL character or an unclosed ``[``.
        """
        under = os.fspath(under) if isinstance(under, os.PathLike) else under
        for name, value in (("under", under), ("glob", glob)):
            if value is not None and not isinstance(value, str):
                raise FilterError(f"{name} must be a string, got {type(value).__name__}")
            if value and "\0" in value:
                raise FilterError(f"{name} {value!r} contains a NUL character")
        flt = cls(under if under and under.strip() else None, glob if glob and glob.strip() else None,
                  parse_date(after, "after"), parse_date(before, "before"))
        if flt.glob is not None:
            glob_regex(flt.glob)   # a bad pattern fails here, before any index is opened
        if flt.after is not None and flt.before is not None and flt.after >= flt.before:
            raise FilterError(f"after {_show(flt.after)} and before {_show(flt.before)}: no date lies between "
                              "them (after must be the earlier date)")
        return flt

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.under, self.glob, self.after, self.before))

    def __bool__(self) -> bool:
        return self.active

    @property
    def dated(self) -> bool:
        return self.after is not None or self.before is not None

    def describe(self) -> dict:
        """The filters that are set, as JSON-ready strings (dates as ISO wall-clock times)."""
        out = {"under": self.under, "glob": self.glob,
               "after": None if self.after is None else _show(self.after),
               "before": None if self.before is None else _show(self.before)}
        return {k: v for k, v in out.items() if v is not None}

    def rows(self, index: IndexReader) -> Optional[np.ndarray]:
        """The sorted int64 ids of ``index``'s rows that pass, or None when the filter keeps every row (none set).
        Cached on the index (its generation's rows never change).

        Raises:
            FilterError: ``under`` outside the index's folder.
            DatesNotIndexedError: a date filter on an index that records no dates.
        """
        if not self.active:
            return None
        cache, lock = _cache_of(index)
        with lock:
            hit = cache.get(self)
            if hit is not None:
                cache.move_to_end(self)
                return hit
        keep = np.ones(len(index), bool)
        if self.dated:
            keep &= _date_mask(index, self.after, self.before)
        if self.under is not None or self.glob is not None:
            paths = _PathTable.of(index)
            if self.under is not None:
                keep &= paths.under_mask(relative_under(self.under, paths.root))
            if self.glob is not None:   # only the rows the other filters kept are matched
                idx = np.flatnonzero(keep)
                keep[idx] = paths.glob_mask(self.glob, idx)
        rows = np.flatnonzero(keep).astype(np.int64)
        rows.flags.writeable = False
        with lock:
            cache[self] = rows
            while len(cache) > 1 and (len(cache) > _CACHE or sum(r.nbytes for r in cache.values()) > _CACHE_BYTES):
                cache.popitem(last=False)
        return rows


def index_folder(index: IndexReader) -> str:
    """The folder ``under`` and ``glob`` are relative to: the one the index stores its paths relative to (absolute)."""
    return _PathTable.of(index).root


def merge(filters: Optional[SearchFilter], under=None, glob=None, after=None, before=None) -> SearchFilter:
    """One filter from a ``filters=`` object and/or keyword arguments (what the ``EmbeddingIndex`` methods take);
    giving both is an error."""
    loose = SearchFilter.of(under, glob, after, before)
    if filters is None:
        return loose
    if not isinstance(filters, SearchFilter):
        raise FilterError(f"filters must be a SearchFilter (SearchFilter.of(...)), got {type(filters).__name__}")
    if loose.active:
        raise FilterError("give the filters either as filters=SearchFilter.of(...) or as under=, glob=, after=, "
                          "before=, not both")
    return filters


# -- dates -----------------------------------------------------------------------------------------------------
def parse_date(value: Any, name: str = "date") -> Optional[int]:
    """A date filter's value as wall-clock seconds (its start: ``2024-03`` is 1 March 2024 00:00), or None.

    Raises:
        FilterError: not one of ``DATE_FORMATS`` or no such date (the message names the accepted formats).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, datetime):
        if value.tzinfo is not None:   # an aware time: its wall-clock time here, as mtimes are recorded
            value = value.astimezone().replace(tzinfo=None)
        return calendar.timegm(value.timetuple())
    if isinstance(value, date):
        return calendar.timegm(value.timetuple())
    accepted = f"use one of {', '.join(DATE_FORMATS)} (e.g. 2024-06-30 or 2024-06-30T18:30)"
    if not isinstance(value, str):
        raise FilterError(f"{name} must be a date string or a datetime.date, got {type(value).__name__}; {accepted}")
    m = _DATE.fullmatch(value.strip())
    if not m:
        raise FilterError(f"{name} {value!r} is not a date: {accepted}")
    y, mo, d, h, mi, s = (int(g) if g is not None else None for g in m.groups())
    try:
        when = datetime(y, mo or 1, d or 1, h or 0, mi or 0, s or 0)
    except ValueError as e:
        raise FilterError(f"{name} {value!r} is not a date ({e}): {accepted}") from None
    return calendar.timegm(when.timetuple())


def _show(seconds: int) -> str:
    return (datetime(1970, 1, 1) + timedelta(seconds=int(seconds))).isoformat()


def _date_mask(index: IndexReader, after: Optional[int], before: Optional[int]) -> np.ndarray:
    items = index.items
    if not all(c in items for c in TAKEN_COLUMNS):
        if "shard" in items:
            raise DatesNotIndexedError(f"index {index.path} holds WebDataset samples, which record no capture "
                                       "dates: filter them by under or glob")
        raise DatesNotIndexedError(f"index {index.path} records no capture dates (it was built before clip-mini "
                                   "recorded them): re-index to filter by date (clip-mini index with the same "
                                   "--images and --out: the embeddings are reused, only the dates are read)")
    col = items["taken"]
    taken = col.values if isinstance(col, IntColumn) else np.asarray(list(col), np.int64)
    keep = np.ones(len(taken), bool)
    if after is not None:
        keep &= taken >= after
    if before is not None:
        keep &= taken < before
    return keep


# -- paths -----------------------------------------------------------------------------------------------------
def relative_under(under: str, root: str) -> str:
    """``under`` (relative to ``root`` or absolute) as a POSIX path relative to ``root`` ("" for ``root`` itself).

    Raises:
        FilterError: it lies outside ``root`` (the message names ``root``).
    """
    given = os.path.expanduser(under)
    target = os.path.normpath(given if os.path.isabs(given) else os.path.join(root, given))
    for a, b in ((target, root), (os.path.realpath(target), os.path.realpath(root))):   # a symlinked spelling too
        try:
            rel = os.path.relpath(a, b)
        except ValueError:   # another drive (Windows)
            continue
        if rel != os.pardir and not rel.startswith(os.pardir + os.sep) and not os.path.isabs(rel):
            return "" if rel == os.curdir else Path(rel).as_posix()
    raise FilterError(f"under {under!r} lies outside the index's folder {root}: give a folder inside it, relative "
                      "to it (e.g. 2024/trip) or absolute")


def glob_regex(pattern: str) -> str:
    """The regular expression (no anchors) a relative path must match in full for ``glob`` ``pattern`` (see the
    module docstring); no part of it matches a NUL character, which delimits paths in ``_PathTable``.

    Raises:
        FilterError: an empty pattern, or an unclosed ``[``.
    """
    if not pattern or not pattern.strip("/"):
        raise FilterError(f"glob {pattern!r} is empty: give a pattern such as *.jpg or 2024/**")
    anywhere = "/" not in pattern.rstrip("/") and not pattern.startswith("/")
    pat = pattern.lstrip("/")
    if pat.endswith("/"):
        pat += "**"
    out, i, n = [], 0, len(pat)
    while i < n:
        c = pat[i]
        if c == "*":
            j = i
            while j < n and pat[j] == "*":
                j += 1
            if j - i == 1:
                out.append("[^/\0]*")
            elif (i == 0 or pat[i - 1] == "/") and j < n and pat[j] == "/":
                out.append("(?:[^\0]*/)?")   # "**/": zero or more whole folders
                j += 1
            else:
                out.append("[^\0]*")
            i = j
        elif c == "?":
            out.append("[^/\0]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pat[j] in "!^":
                j += 1
            if j < n and pat[j] == "]":
                j += 1
            while j < n and pat[j] != "]":
                j += 1
            if j >= n:
                raise FilterError(f"glob {pattern!r}: the [ at position {i + 1} is never closed (write [[] for a "
                                  "literal [)")
            body = pat[i + 1:j]
            negate = body[:1] in ("!", "^")
            body = re.sub(r"([\\\[&~|^])", r"\\\1", body[1:] if negate else body)
            out.append(f"[^/\0{body}]" if negate else f"[{body}]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    body = "".join(out)
    if anywhere and body.startswith("[^/\0]*"):   # "*.jpg": the same language, without the folder group's backtracking
        return "[^\0]*" + body[len("[^/\0]*"):]
    return f"(?:[^\0]*/)?{body}" if anywhere else body


class _PathTable:
    """Every row's path relative to the index's folder: a UTF-8 blob and n + 1 offsets (numpy), as a columnar index
    stores them (read in place), or built once from an older index's lists."""

    def __init__(self, root: str, offsets: np.ndarray, blob: np.ndarray):
        self.root, self.offsets, self.blob = root, offsets, blob

    @classmethod
    def of(cls, index: IndexReader) -> "_PathTable":
        cache = index.__dict__.get("_path_table")
        if cache is None:
            cache = index.__dict__["_path_table"] = cls._build(index)
        return cache

    @classmethod
    def _build(cls, index: IndexReader) -> "_PathTable":
        col = index.items["path"]
        root = items_root(index.manifest, index.path)
        if isinstance(col, StrColumn) and root is not None:   # stored relative to the root: the bytes as they are
            off, blob = col.stored()
            if len(off) > 1 and bool((np.diff(off) < 0).any()):
                raise FilterError(f"{index.path}: the items file's path offsets are damaged; re-index")
            return cls(os.path.normpath(root), off, blob)
        paths = list(col)   # an older (CSV) or unrooted index: relative paths made once, in Python
        if root is None:
            root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else os.sep
        root = os.path.normpath(root)
        rel = [Path(os.path.relpath(p, root)).as_posix().encode("utf-8", "surrogateescape") for p in paths]
        off = np.zeros(len(rel) + 1, np.int64)
        np.cumsum([len(b) for b in rel], out=off[1:])
        return cls(root, off, np.frombuffer(b"".join(rel), np.uint8))

    def under_mask(self, prefix: str) -> np.ndarray:
        """Rows whose relative path is ``prefix`` or lies under it (all rows for "")."""
        n = len(self.offsets) - 1
        if not prefix:
            return np.ones(n, bool)
        p = prefix.encode("utf-8", "surrogateescape")
        rows = self._affix(np.arange(n), p, end=False)
        lens = self.offsets[rows + 1] - self.offsets[rows]
        nxt = np.full(len(rows), ord("/"), np.uint8)
        longer = lens > len(p)
        nxt[longer] = self.blob[self.offsets[rows[longer]] + len(p)]
        keep = np.zeros(n, bool)
        keep[rows[nxt == ord("/")]] = True   # "2024" keeps 2024/x.jpg and 2024 itself, not 2024b/x.jpg
        return keep

    def _affix(self, rows: np.ndarray, data: bytes, end: bool) -> np.ndarray:
        """Those of ``rows`` whose path starts (``end`` False) or ends with the bytes ``data``: compared byte by
        byte in numpy, the candidates shrinking at each step (the first bytes compared rule out most rows)."""
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        cand = np.flatnonzero(ends - starts >= len(data))
        base = (ends[cand] - len(data)) if end else starts[cand]
        order = range(len(data) - 1, -1, -1) if end else range(len(data))   # a suffix from its last byte
        for j in order:
            ok = self.blob[base + j] == data[j]
            cand, base = cand[ok], base[ok]
            if not len(cand):
                break
        return rows[cand]

    def _literal_glob(self, pattern: str, rows: np.ndarray) -> Optional[np.ndarray]:
        """The common patterns without a regular expression: ``*.jpg`` (a file-name suffix), ``name.jpg`` (a file
        name at any depth), ``2024/trip/**`` or ``2024/trip/`` (everything in a folder); None for the others."""
        special = re.compile(r"[*?\[]")
        anywhere = "/" not in pattern.rstrip("/") and not pattern.startswith("/")
        pat = pattern.lstrip("/")
        enc = lambda text: text.encode("utf-8", "surrogateescape")   # noqa: E731
        folder = None if anywhere else re.fullmatch(r"(.+?)/(?:\*\*)?", pat)
        if anywhere and pat.startswith("*") and not special.search(pat[1:]) and not pat.endswith("/"):
            found = self._affix(rows, enc(pat[1:]), end=True)   # the suffix has no "/": it ends the file name
        elif anywhere and not special.search(pat) and not pat.endswith("/"):
            name = enc(pat)
            whole = self._affix(rows, name, end=False)
            found = np.union1d(self._affix(rows, b"/" + name, end=True), whole[self._lens(whole) == len(name)])
        elif folder is not None and not special.search(folder.group(1)):
            prefix = enc(folder.group(1) + "/")
            found = self._affix(rows, prefix, end=False)
            found = found[self._lens(found) > len(prefix)]
        else:
            return None
        keep = np.zeros(len(rows), bool)
        keep[np.searchsorted(rows, found)] = True
        return keep

    def _lens(self, rows: np.ndarray) -> np.ndarray:
        return self.offsets[rows + 1] - self.offsets[rows]

    def glob_mask(self, pattern: str, rows: np.ndarray) -> np.ndarray:
        """For each of ``rows`` (sorted ids), whether its relative path matches ``pattern``.

        One regular-expression scan over the rows' paths joined by NUL bytes (decoded once), not one match call per
        row; a table that is not valid UTF-8 (a file name in another encoding) is matched row by row."""
        fast = self._literal_glob(pattern, rows)
        if fast is not None:
            return fast
        body = glob_regex(pattern)
        off, blob = self.offsets, self.blob
        n = len(off) - 1
        starts, ends = off[:-1][rows], off[1:][rows]
        lens = ends - starts
        # the rows' bytes, each preceded by a NUL, and one NUL at the end; boolean masks only (no index array of
        # the blob's size): the table's offsets run from 0 to the blob's end without gaps
        total = int(lens.sum()) + len(rows) + 1
        joined = np.zeros(total, np.uint8)
        delim = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens + 1, out=delim[1:])
        if total > len(rows) + 1:
            if len(rows) == n:
                picked = blob[int(off[0]):int(off[-1])]
            else:
                sel = np.zeros(n, bool)
                sel[rows] = True
                picked = blob[int(off[0]):int(off[-1])][np.repeat(sel, np.diff(off))]
            dst = np.ones(total, bool)
            dst[delim] = False
            joined[dst] = picked
        try:
            text = joined.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            rx = re.compile(body)
            return np.array([rx.fullmatch(bytes(blob[a:b]).decode("utf-8", "surrogateescape")) is not None
                             for a, b in zip(starts.tolist(), ends.tolist())], bool)
        if len(text) != total:   # multi-byte characters: delimiter positions counted in characters
            cont = (joined & 0xC0) == 0x80
            chars = lens - _segment_sums(cont, delim[:-1] + 1, lens)
            delim = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(chars + 1, out=delim[1:])
        found = np.fromiter((m.start() for m in re.finditer(f"\0(?:{body})(?=\0)", text)), np.int64)
        keep = np.zeros(len(rows), bool)
        keep[np.searchsorted(delim, found)] = True
        return keep


def _segment_sums(flags: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Sum of ``flags[s:s + l]`` for each (s, l), without a cumulative sum the size of ``flags``."""
    out = np.zeros(len(starts), np.int64)
    nonempty = np.flatnonzero(lens > 0)
    if len(nonempty):
        # reduceat sums from each start to the next one: empty rows between two non-empty ones add nothing
        sums = np.add.reduceat(flags.astype(np.uint8), starts[nonempty], dtype=np.int64)
        # the last segment runs to the end of the array: past its own row only the closing NUL, never a flag
        out[nonempty] = sums
    return out


def _cache_of(index: IndexReader):
    d = index.__dict__
    if "_filter_rows" not in d:
        d.setdefault("_filter_lock", threading.Lock())
        d.setdefault("_filter_rows", OrderedDict())
    return d["_filter_rows"], d["_filter_lock"]


# -- searching the kept rows -----------------------------------------------------------------------------------
def search_rows(embeddings, queries: np.ndarray, k: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` among ``rows`` (sorted int64 ids) of ``embeddings`` (float16 memory map, ``BF16Rows`` or
    float32): ``scores`` (Q, k') float32 best first and ``ids`` (Q, k') the original row ids, k' = min(k, rows).

    The kept rows are gathered block by block (a run of consecutive rows, as a folder of a path-sorted index is, is
    a view: nothing copied) and searched with ``exact_search``; each block's top-k is exact and scored as the full
    search scores it (float64 products rounded once), so merging them by score, ties by row id, is the exact top-k
    of the kept rows, the order an unfiltered search would give them."""
    from clip_mini.retrieval.search import exact_search

    queries = np.atleast_2d(np.asarray(queries, np.float32))
    nq = len(queries)
    k = min(int(k), len(rows))
    best_s, best_i = np.zeros((nq, 0), np.float32), np.zeros((nq, 0), np.int64)
    if k == 0:
        return best_s, best_i
    step = max(1024, _GATHER_BYTES // (2 * embeddings.shape[1]))
    for start in range(0, len(rows), step):
        ids = rows[start:start + step]
        s, i = exact_search(_gather(embeddings, ids), queries, min(k, len(ids)))
        s, i = np.concatenate([best_s, s], 1), np.concatenate([best_i, ids[i]], 1)
        order = np.lexsort((i, -s), axis=-1)[:, :k]
        best_s, best_i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    return best_s, best_i


def _gather(embeddings, ids: np.ndarray):
    lo, hi = int(ids[0]), int(ids[-1]) + 1
    bf16 = isinstance(embeddings, BF16Rows)
    src = embeddings.bits if bf16 else embeddings
    block = src[lo:hi] if hi - lo == len(ids) else src[ids]
    return BF16Rows(np.ascontiguousarray(block)) if bf16 else block


def search(index: IndexReader, queries, k: int, flt: SearchFilter, embeddings=None
           ) -> tuple[np.ndarray, np.ndarray]:
    """``index.search`` restricted to the rows ``flt`` keeps (all of them when it is empty), over ``embeddings``
    (default: the index's stored rows; a server passes its float32 copy). Same checks and result shapes, except
    that a query gets fewer than ``k`` results when fewer rows pass."""
    from clip_mini.errors import EmbeddingIndexError

    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise EmbeddingIndexError(f"k must be a positive integer, got {k!r}")
    queries = _unit_queries(queries, index.dim)
    q = np.asarray(queries, np.float32)
    if q.ndim not in (1, 2) or q.shape[-1] != index.dim:
        raise EmbeddingIndexError(f"search in {index.path}: queries must be (n, {index.dim}) or ({index.dim},), got "
                                  f"shape {q.shape}")
    rows = flt.rows(index)
    if rows is None:
        rows = np.arange(len(index), dtype=np.int64)
    return search_rows(index.embeddings if embeddings is None else embeddings, q, k, rows)
