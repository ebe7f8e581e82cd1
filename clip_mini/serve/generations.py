"""The index a server answers from, swapped whole when a writer publishes a new generation.

A writer (``clip-mini index --add``) publishes a generation by atomically replacing ``manifest.json`` (see
``clip_mini.retrieval.format``). ``IndexWatcher`` notices the change with one ``stat`` of that file, opens the new
generation completely (checksums verified, model fingerprint checked) and only then replaces its ``current``
reference: one assignment, so a request that took ``current`` keeps a single consistent generation for its whole
life, and requests never wait for a load. A generation that fails to open leaves the old one serving and is
reported in ``reload_error`` (``/api/info``).

A small index is searched by the numpy kernel, whose cost is converting the stored float16 rows to float32 on
every query; a server searches the same rows thousands of times, so a generation of fewer than ``float32_max_rows``
rows (and at most ``float32_cache_bytes``) keeps a float32 copy in memory and scores it with one product.
Conversion is exact: the scores are the library's. A larger one is searched where it lies, through its read-only
memory map, by the library's kernels that read 16-bit rows in place (``clip_mini.retrieval.search``): the map's
pages are the page cache's, so ``--workers N`` hold one copy of the rows between them (a private float32 copy would
be twice the file's size in every worker, and a reload would need room for two of them), and opening a
generation reads nothing but its checksums. The same holds for the rows' int8 codes (``search.codes``), the int8
kernel's first pass, a memory-mapped sidecar of the generation: opening one checks it (and makes it, once, for an
index written before them).

Files are served only from inside the index's image root (``Generation.image_file``): the items file and its
checksums detect damage, not tampering, so a row rewritten to name any other file on the disk must not make the
server read it. Paths are shown relative to that root, so answers don't reveal where the photos live.

Row ids are only meaningful within a generation (an added file shifts the rows after it), so the previous
generation is kept too: a page that got ``/thumb/12?gen=3`` from a search just before a reload still gets the
image it was shown.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from clip_mini.retrieval import search as S
from clip_mini.retrieval.filters import SearchFilter, search as filtered_search
from clip_mini.retrieval.format import EmbeddingIndexError, items_root
from clip_mini.retrieval.index import EmbeddingIndex

log = logging.getLogger("clip_mini.serve")
KEEP_GENERATIONS = 2   # the current one and the one before it (what a writer also keeps on disk)
# Below this many rows a float32 copy of a generation is kept (the numpy kernel, auto's pick there, converts the
# float16 rows on every query); from it on the rows are searched in place (benchmarks/speed/bench_serve.py --arm 1m)
FLOAT32_MAX_ROWS = S.FAISS_SCAN_MIN_ROWS


@dataclass(frozen=True)
class Generation:
    """One fully opened generation of the index."""

    index: EmbeddingIndex
    stamp: tuple   # (inode, mtime_ns, size) of manifest.json when this generation was read
    loaded_at: float
    rows32: Optional[np.ndarray] = None   # float32 copy of the rows for exact search, when it fits the cache
    root: str = "/"        # the folder the rows' images lie in, as the index records it (paths are shown from here)
    real_root: str = "/"   # the same, symlinks resolved: what a served file must lie under
    open_s: float = 0.0    # seconds this server took to open it (checksums, memory map, items, float32 copy)

    def search(self, queries: np.ndarray, k: int, where: Optional[SearchFilter] = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``index.search`` (back end "auto"), on the float32 copy when there is one; with a filter, the exact search
        of the rows it keeps (``retrieval.filters``), on the same rows."""
        if where is not None and where.active:
            return filtered_search(self.index, queries, k, where, embeddings=self.rows32)
        if self.rows32 is not None:
            return _search_rows32(self.rows32, queries, k)
        return self.index.search(queries, k)

    @property
    def number(self) -> int:
        return int(self.index.manifest["generation"])

    def shown_path(self, row: int) -> str:
        """Row ``row``'s path relative to the image root (``"shard.tar#key"`` for a WebDataset row)."""
        return os.path.relpath(self.index.items["path"][row], self.root)

    def image_file(self, row: int) -> str:
        """The file to read row ``row``'s image from: its own file, or (a WebDataset row) a copy read out of its
        shard. Either must resolve (symlinks followed) to a regular file under ``real_root``.

        Raises:
            NotServed: the file lies elsewhere, is no regular file, or is gone; the message says which.
        """
        items = self.index.items
        source = items["shard"][row] if "shard" in items else items["path"][row]
        real = os.path.realpath(source)
        if os.path.commonpath([real, self.real_root]) != self.real_root:
            raise NotServed(f"{source} resolves to {real}, outside the index's image root {self.real_root}")
        try:
            mode = os.stat(real).st_mode
        except OSError as e:
            raise NotServed(f"{source}: {e.strerror or e}") from None
        if not stat.S_ISREG(mode):
            raise NotServed(f"{source} is not a regular file")
        if "shard" not in items:
            return real
        from clip_mini.data.readers import DataError
        from clip_mini.retrieval.wds_source import image_file   # a copy read from the shard by offset

        member = {"shard": [real], **{c: [items[c][row]] for c in ("offset", "length", "sha256")}}
        try:
            return image_file(member, 0)
        except DataError as e:
            raise NotServed(str(e)) from None


class NotServed(Exception):
    """A row's image is not served: outside the image root, not a regular file, or unreadable (logged, 404)."""


def image_roots(index: EmbeddingIndex) -> tuple[str, str]:
    """The folder the index's images lie in, as recorded and with symlinks resolved.

    Format 2 indexes record it in the manifest; for a format 1 index (absolute paths only) it is the deepest folder
    holding every row, which only keeps rows within the folders the index spans.
    """
    root = items_root(index.manifest, index.path)
    if root is None:
        paths = index.items["shard"] if "shard" in index.items else index.items["path"]
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else "/"
    root = os.path.normpath(os.path.abspath(root))
    return root, os.path.realpath(root)


class IndexWatcher:
    """Holds the current generation of one index directory and reloads it when the manifest changes.

    Args:
        path: index directory.
        fingerprint: the query model's fingerprint; a generation built by another model is refused.
        poll_s: seconds between manifest checks in the background thread (``start``); ``refresh`` checks now.
        verify: check the data files' sha256 when opening a generation.
        float32_cache_bytes: keep a float32 copy of a generation's rows up to this size (0: never) ...
        float32_max_rows: ... and only when it has fewer rows than this; a larger generation is searched through
            its shared memory map.
        flip_average: whether the server's image queries are flip-averaged; a generation whose rows are made
            otherwise is refused, as another model's is.
    """

    def __init__(self, path: str | Path, fingerprint: str, poll_s: float = 1.0, verify: bool = True,
                 float32_cache_bytes: int = 2 << 30, float32_max_rows: int = FLOAT32_MAX_ROWS,
                 flip_average: bool = False):
        self.path, self.fingerprint, self.poll_s, self.verify = Path(path), fingerprint, poll_s, verify
        self.flip_average = flip_average
        self.float32_cache_bytes, self.float32_max_rows = float32_cache_bytes, float32_max_rows
        self.reload_error: Optional[str] = None
        self._failed_stamp: Optional[tuple] = None
        self._lock = threading.Lock()   # one reload at a time; readers never take it
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        first = self._open(self._stamp())   # raises: a server must not start on a bad index
        self.current: Generation = first
        self._recent: dict[int, Generation] = {first.number: first}

    def _stamp(self) -> tuple:
        st = os.stat(self.path / "manifest.json")
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _open(self, stamp: tuple) -> Generation:
        start = time.perf_counter()
        index = EmbeddingIndex.load(self.path, verify=self.verify)
        index.check_model(self.fingerprint, "the server's model")
        index.check_flip_average(self.flip_average, "the server's image queries")
        rows32 = None
        if (not uses_faiss(index) and len(index) < self.float32_max_rows
                and len(index) * index.dim * 4 <= self.float32_cache_bytes):
            rows32 = np.asarray(index.embeddings, dtype=np.float32)
        elif not uses_faiss(index):
            S.prepare(index.embeddings)   # the int8 codes (made once if the index has none): not on a first query
        roots = image_roots(index)
        return Generation(index, stamp, time.time(), rows32, *roots, open_s=time.perf_counter() - start)

    def generation(self, number: Optional[int]) -> Optional[Generation]:
        """The current generation (``number`` None) or a recent one by number; None once it has been dropped."""
        if number is None:
            return self.current
        return self._recent.get(number)

    def refresh(self) -> bool:
        """Open and switch to a newly published generation, if any; returns whether the server switched."""
        with self._lock:
            try:
                stamp = self._stamp()
            except OSError as e:   # the manifest is replaced by rename, so it is never missing unless deleted
                self.reload_error = f"cannot read {self.path / 'manifest.json'}: {e.strerror or e}"
                return False
            if stamp == self.current.stamp or stamp == self._failed_stamp:
                return False
            try:
                new = self._open(stamp)
            except EmbeddingIndexError as e:
                self.reload_error, self._failed_stamp = str(e), stamp
                log.warning("keeping generation %d: %s", self.current.number, e)
                return False
            self.reload_error, self._failed_stamp = None, None
            if new.number == self.current.number:   # the same generation re-published (e.g. touched): keep rows
                self.current = dataclasses.replace(self.current, stamp=stamp)
                return False
            recent = {n: g for n, g in self._recent.items() if n != new.number}
            recent[new.number] = new
            self._recent = dict(sorted(recent.items())[-KEEP_GENERATIONS:])
            self.current = new   # the swap: one reference assignment
            log.info("now serving generation %d (%d images, opened in %.2f s)", new.number, len(new.index), new.open_s)
            return True

    # -- background polling ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="clip-mini-index-watcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception as e:   # a bug here must not silently end reloading: log it and keep polling
                self.reload_error = f"reload failed: {type(e).__name__}: {e}"
                log.exception("index reload failed")


def uses_faiss(index: EmbeddingIndex) -> bool:
    """Whether ``index.search(..., backend="auto")`` answers from its stored faiss index."""
    return ("faiss" in index.manifest["files"] and len(index) >= S.FAISS_THRESHOLD) and S.faiss_available()


def _search_rows32(rows: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k over float32 rows in memory: one product over the rows where they lie, no per-chunk copy (faster
    than searching the stored float16 rows, which must be converted chunk by chunk). The library's numpy kernel, so
    the same scores and order: best first, ties by row id."""
    return S.exact_search(rows, queries, k, chunk_rows=len(rows), kernel="numpy")
