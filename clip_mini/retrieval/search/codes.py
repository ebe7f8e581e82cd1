"""Per-row int8 codes of stored rows, kept beside them as a memory-mapped sidecar: the int8 kernel's first pass
(``exact_int8``).

Each row x (its stored values: float16, bfloat16 or float32, exact in float64) gets a scale s = max_i |x_i| / 127
(float32) and codes c_i = round(x_i / s) in [-127, 127], stored as c + 128 (uint8, 1..255). With them go the two
figures the kernel's error bound rests on (``bounds.quantized_margin``), computed in float64 from the stored values
and the stored scales: ``row_error``, the largest |x - s c| over the rows, and ``code_norm``, the largest |s c|.
The codes are stored row by row, (N, d): a chunk of rows is a contiguous slice of the memory map, the left-hand
operand of the int8 kernel's product as it is (no copy, no packed copy per process).

The sidecar of ``<name>.npy`` (an index's ``embeddings-<gen>.npy``) is two files beside it:

    <name>.int8         the codes (N, d) uint8, then the scales (N,) float32 at ``scales_offset`` (page-aligned):
                        what every process memory-maps read-only, so ``clip-mini serve --workers N`` share one copy
                        through the page cache, as they share the float16 rows
    <name>.int8.json    what it holds: rows, width, row_error, code_norm, the sha256 of the rows it was made from
                        (the ``.npy`` file's, as the index manifest records it), of the codes file, and its own

``clip-mini index`` writes it with each generation of ``MIN_ROWS`` rows or more (``format.commit``; an old
generation's sidecar goes with its other files). For rows that have none (an older index), the int8 kernel makes it
the first time it runs (``for_rows``), beside the rows, or in the user cache where their folder is read-only, or
else in memory. Both files are written atomically (the codes first), under a lock so that processes opening the
same rows at once make it once. A sidecar is used only if its recorded rows' sha256 is the rows' sha256 now, the
codes file's sha256 is the recorded one and the description's own checks out (the files' digests remembered per
file identity, ``fileio.checksums.known_sha256``, so an unchanged file is hashed once); anything else (rows
rewritten, a half-written pair, damage) makes it again.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from clip_mini.retrieval.rows import BF16Rows

FORMAT = "clip-mini int8 codes"
VERSION = 3
LEVELS = 127          # codes in [-LEVELS, LEVELS]
ZERO = 128            # stored as code + ZERO (uint8)
MIN_ROWS = 65_536     # ``clip-mini index`` writes a sidecar from this many rows (the int8 kernel's ``auto`` range)
_BLOCK = 65_536       # rows quantized at a time (bounded memory whatever the index's size)
_PAGE = 4096


@dataclass(frozen=True, eq=False)   # compared and hashed by identity: the kernel keeps its session per codes
class Int8Codes:
    """int8 codes of N rows of width d.

    codes: (N, d) uint8, code + ``ZERO``: row r holds row r's codes (a read-only memory map when it comes from a
        sidecar, ``path``).
    scales: (N,) float32: row r is approximated by scales[r] * (codes[r] - ZERO).
    rows: N. row_error: max over rows of |x - x^| (float64, rounded up); code_norm: max over rows of |x^|.
    """

    codes: np.ndarray
    scales: np.ndarray
    rows: int
    row_error: float
    code_norm: float
    path: Optional[Path] = None
    scales_offset: int = 0   # where the scales start in the file at ``path``

    @property
    def shape(self) -> tuple[int, int]:
        """(N, d): the rows' shape."""
        return self.rows, self.codes.shape[1]


def quantize(rows, start: int = 0, stop: Optional[int] = None) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Codes, scales, the largest residual norm and the largest approximate norm of rows start..stop.

    Raises:
        ValueError: a row that is not finite (no bound holds for it).
    """
    x = np.asarray(rows[start:stop], dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("rows with non-finite values have no int8 codes (their error bound would not hold)")
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(len(x), np.float32)
    scales = (amax / np.float32(LEVELS)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(x / safe[:, None]), -LEVELS, LEVELS).astype(np.int16)
    codes[scales == 0] = 0
    # exact in float64: a float32 scale times a 7-bit integer, and the float16 / bfloat16 / float32 values
    approx = scales.astype(np.float64)[:, None] * codes
    err = np.sqrt(np.square(x.astype(np.float64) - approx).sum(axis=1))
    norm = np.sqrt(np.square(approx).sum(axis=1))
    up = 1 + 1e-12   # the float64 sums' rounding (d terms, relative d 2^-53)
    return ((codes + ZERO).astype(np.uint8), scales, float(err.max(initial=0.0)) * up,
            float(norm.max(initial=0.0)) * up)


def _fill(rows, codes: np.ndarray, scales: np.ndarray) -> tuple[float, float]:
    """Quantize ``rows`` block by block into ``codes`` and ``scales``; the two bound figures."""
    row_error = code_norm = 0.0
    for start in range(0, len(rows), _BLOCK):
        c, s, e, m = quantize(rows, start, start + _BLOCK)
        codes[start:start + len(c)], scales[start:start + len(s)] = c, s
        row_error, code_norm = max(row_error, e), max(code_norm, m)
    return row_error, code_norm


def build(rows) -> Int8Codes:
    """Codes of every row, in memory."""
    n, d = rows.shape
    codes = np.empty((n, d), np.uint8)
    scales = np.empty(n, np.float32)
    return Int8Codes(codes, scales, n, *_fill(rows, codes, scales))


# -- the sidecar files ---------------------------------------------------------------------------------------------
def sidecar_path(source: Path) -> Path:
    """The codes file beside ``source`` (``embeddings-3.npy`` -> ``embeddings-3.int8``)."""
    return source.with_suffix(".int8")


def _json_path(codes_path: Path) -> Path:
    return codes_path.with_name(codes_path.name + ".json")


def _cache_path(source: Path) -> Path:
    """Where rows in a read-only folder keep their sidecar: the user cache, named by the rows' real path."""
    from clip_mini.fileio.checksums import cache_root

    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "int8" / f"{key}.int8"


def _scales_offset(n: int, d: int) -> int:
    return -(-n * d // _PAGE) * _PAGE


def write(rows, codes_path: Path, source_sha256: str) -> Int8Codes:
    """Write the sidecar of ``rows`` (whose file's sha256 is ``source_sha256``) at ``codes_path``: the codes file,
    then its description, each atomically. Returns the codes, memory-mapped from the new file."""
    from clip_mini.fileio.atomic import atomic_path, atomic_write_json
    from clip_mini.fileio.checksums import known_sha256

    n, d = rows.shape
    offset = _scales_offset(n, d)
    with atomic_path(codes_path) as tmp:
        with open(tmp, "wb") as f:
            f.truncate(offset + 4 * n)
        out = np.memmap(tmp, dtype=np.uint8, mode="r+")
        codes = out[:n * d].reshape(n, d)
        row_error, code_norm = _fill(rows, codes, out[offset:offset + 4 * n].view(np.float32))
        out.flush()
        del out, codes
    meta = {"format": FORMAT, "version": VERSION, "rows": n, "dim": d, "levels": LEVELS, "zero": ZERO,
            "layout": "rows", "scales_offset": offset, "row_error": row_error,
            "code_norm": code_norm,
            "source_sha256": source_sha256, "sha256": known_sha256(codes_path)}
    meta["meta_sha256"] = _digest(meta)
    atomic_write_json(_json_path(codes_path), meta)
    return _open(codes_path, meta)


def _digest(meta: dict) -> str:
    """The description's own sha256 (its other keys): an edited or damaged figure is caught, as the bound rests
    on them."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _open(codes_path: Path, meta: dict) -> Int8Codes:
    n, d, offset = meta["rows"], meta["dim"], meta["scales_offset"]
    with open(codes_path, "rb") as f:
        raw = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    return Int8Codes(raw[:n * d].reshape(n, d), raw[offset:offset + 4 * n].view(np.float32), n,
                     float(meta["row_error"]), float(meta["code_norm"]), codes_path, offset)


def load(codes_path: Path, shape: tuple[int, int], source_sha256: str) -> Optional[Int8Codes]:
    """The sidecar at ``codes_path`` if it is whole and was made from rows of this shape and sha256; else None."""
    from clip_mini.fileio.checksums import known_sha256

    try:
        meta = json.loads(_json_path(codes_path).read_text(encoding="utf-8"))
        n, d = shape
        if not (isinstance(meta, dict) and meta.get("meta_sha256") == _digest(meta)
                and meta.get("format") == FORMAT and meta.get("version") == VERSION and meta.get("rows") == n
                and meta.get("dim") == d and meta.get("levels") == LEVELS and meta.get("zero") == ZERO
                and meta.get("layout") == "rows" and meta.get("scales_offset") == _scales_offset(n, d)
                and meta.get("source_sha256") == source_sha256):
            return None
        if os.stat(codes_path).st_size != meta["scales_offset"] + 4 * n:
            return None
        if known_sha256(codes_path) != meta.get("sha256"):
            return None
        return _open(codes_path, meta)
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- which rows have which codes -----------------------------------------------------------------------------------
def source_file(rows) -> Optional[Path]:
    """The ``.npy`` file ``rows`` are the whole of, memory-mapped (an index's embeddings as loaded, float16 or
    bfloat16 bits); None for rows in memory or part of a file."""
    arr = rows.bits if isinstance(rows, BF16Rows) else rows
    if not isinstance(arr, np.memmap) or getattr(arr, "filename", None) is None or not arr.flags.c_contiguous:
        return None
    path = Path(arr.filename)
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    # a view of part of the file (memmap slices keep the file's name and offset) is not the file's rows
    if arr.offset + arr.nbytes != size or arr._mmap is None:
        return None
    base = np.frombuffer(arr._mmap, np.uint8)
    if arr.ctypes.data != base.ctypes.data + arr.offset % mmap.ALLOCATIONGRANULARITY:
        return None
    return path


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


_lock = threading.Lock()
_known: dict[str, tuple[tuple, Int8Codes]] = {}   # rows file -> (its identity, its codes), the latest last
KNOWN = 4   # rows files whose codes stay open (a server holds two generations)


def ready(rows) -> bool:
    """Whether the int8 codes of ``rows`` are at hand without making them: a file's rows whose valid sidecar is
    open in this process or lies beside them (or in the user cache)."""
    return for_rows(rows, make=False) is not None


def for_rows(rows, make: bool = True) -> Optional[Int8Codes]:
    """The int8 codes of ``rows``: for a ``.npy`` file's rows, its sidecar (opened once per file identity; made if
    missing or stale, unless ``make`` is false: then None); for rows in memory, made now (``build``; None unless
    ``make``).

    Raises:
        ValueError: rows that are not finite.
    """
    source = source_file(rows)
    if source is None:
        return build(rows) if make else None
    key = str(source)
    with _lock:
        try:
            identity = _identity(source)
        except OSError:
            return build(rows) if make else None
        known = _known.get(key)
        if known is not None and known[0] == identity:
            return known[1]
        places = [sidecar_path(source), _cache_path(source)]
        if not make and not any(_json_path(p).is_file() for p in places):
            return None
        from clip_mini.fileio.checksums import known_sha256

        sha = known_sha256(source)
        codes = next((c for c in (load(p, rows.shape, sha) for p in places) if c is not None), None)
        if codes is None and make:
            codes = _make(rows, source, places, sha)
        if codes is not None and _identity(source) == identity:   # not rewritten meanwhile
            _known.pop(key, None)
            _known[key] = (identity, codes)
            while len(_known) > KNOWN:   # the oldest go (and the kernel's session for them, ``exact_int8``)
                _known.pop(next(iter(_known)))
        return codes


def _make(rows, source: Path, places: list[Path], sha: str) -> Int8Codes:
    """Write the sidecar in the first place that takes it (another process may have just written it: the lock,
    then a second look); codes in memory if none does."""
    from filelock import FileLock, Timeout

    from clip_mini.fileio.checksums import cache_root

    for place in places:
        try:
            lock_dir = cache_root() / "int8" / "locks"
            lock_dir.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(lock_dir / (hashlib.sha256(str(place).encode()).hexdigest()[:32] + ".lock")),
                            timeout=600)
            with lock:
                codes = load(place, rows.shape, sha)
                return codes if codes is not None else write(rows, place, sha)
        except (OSError, Timeout):   # a folder that refuses the files (OutputError is an OSError), a lock held
            continue
    return build(rows)


def write_beside(source: Path) -> Int8Codes:
    """Write (or find up to date) the sidecar beside the ``.npy`` file ``source``: what ``clip-mini index`` runs for
    each generation of ``MIN_ROWS`` rows or more."""
    from clip_mini.fileio.checksums import known_sha256
    from clip_mini.retrieval.rows import wrap

    rows = wrap(np.load(source, mmap_mode="r"))
    sha = known_sha256(source)
    place = sidecar_path(Path(source))
    codes = load(place, rows.shape, sha)
    return codes if codes is not None else write(rows, place, sha)
