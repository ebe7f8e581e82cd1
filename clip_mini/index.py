"""EmbeddingIndex: stored image embeddings plus their file table, searched exactly or with faiss.

Index directory (format version 1)::

    manifest.json           names the current generation's files; model fingerprint, dim, count, checksums
    embeddings-<gen>.npy    (count, dim) float16, L2-normalised; row i belongs to items row i
    items-<gen>.csv         path, size, mtime_ns, sha256, caption; sorted by path
    faiss-<gen>.index       optional approximate index over the same rows
    skipped.csv             images the last build could not embed, with the reason
    .work/                  embeddings of an unfinished build (what a resumed build reuses)
    .lock                   held by the one process allowed to write

Readers never see a mix of two generations: data files are never changed once written, a writer publishes a
generation by atomically replacing ``manifest.json``, and readers open exactly the files that manifest names.
The previous generation's files are kept, so a reader holding the old manifest can still open them; if a reader
is slower than two commits it finds a file gone, re-reads the manifest and tries again.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from clip_mini.io import atomic_write_json, atomic_write_text, sha256_file

FORMAT_VERSION = 1
ITEM_COLUMNS = ("path", "size", "mtime_ns", "sha256", "caption")
_DATA_FILE = re.compile(r"^(embeddings|items|faiss)-(\d+)\.(npy|csv|index)$")
_OPEN_RETRIES = 5


class EmbeddingIndexError(ValueError):
    """An index directory is missing, corrupt, busy or built with another model, or a request on it is unusable."""


class EmbeddingIndex:
    """One generation of an index directory, opened read-only (embeddings are memory-mapped).

    Build or update with ``EmbeddingIndex.build`` / ``add`` / ``merge``; open with ``EmbeddingIndex.load``;
    query with ``search`` (arrays of scores and row ids; ``paths[ids]`` names the files).
    """

    def __init__(self, path: Path, manifest: dict, embeddings: np.ndarray, items: dict[str, list]):
        self.path, self.manifest, self.embeddings, self.items = Path(path), manifest, embeddings, items
        self.paths = np.array(items["path"], dtype=object)
        self._faiss = None

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def __repr__(self) -> str:
        return f"EmbeddingIndex({str(self.path)!r}, count={len(self)}, dim={self.dim}, model={self.fingerprint})"

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def fingerprint(self) -> str:
        return self.manifest["model_fingerprint"]

    # -- opening --------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> "EmbeddingIndex":
        """Open the current generation of an index directory.

        Args:
            path: index directory.
            verify: check the sha256 of every data file against the manifest (reads each file once).

        Raises:
            EmbeddingIndexError: missing directory or files, corrupt manifest or data, unknown format version.
        """
        path = Path(path)
        if not (path / "manifest.json").is_file():
            what = "is not an index (no manifest.json)" if path.is_dir() else "does not exist"
            raise EmbeddingIndexError(f"index {path} {what}; build one with `clip-mini index`")
        for attempt in range(_OPEN_RETRIES):
            manifest = read_manifest(path)
            try:
                return cls._open(path, manifest, verify)
            except FileNotFoundError as e:
                # A writer removed this generation after we read its manifest: retry with the new manifest.
                if read_manifest(path)["generation"] == manifest["generation"] or attempt == _OPEN_RETRIES - 1:
                    raise EmbeddingIndexError(f"index {path} is missing {Path(e.filename).name}") from None
        raise AssertionError("unreachable")

    @classmethod
    def _open(cls, path: Path, manifest: dict, verify: bool) -> "EmbeddingIndex":
        files = manifest["files"]
        if verify:
            for name in (files["embeddings"], files["items"]):
                if sha256_file(path / name) != manifest["checksums"][name]:
                    raise EmbeddingIndexError(f"{path / name} is corrupt: its sha256 does not match manifest.json")
        emb_path = path / files["embeddings"]
        try:
            embeddings = np.load(emb_path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise
        except (ValueError, OSError) as e:
            raise EmbeddingIndexError(f"{emb_path} is corrupt: {e}") from None
        want = (int(manifest["count"]), int(manifest["dim"]))
        if embeddings.dtype != np.float16 or embeddings.shape != want:
            raise EmbeddingIndexError(f"{emb_path} holds {embeddings.dtype} {embeddings.shape}, manifest.json says "
                                      f"float16 {want}")
        items = read_items(path / files["items"])
        if len(items["path"]) != want[0]:
            raise EmbeddingIndexError(f"{path / files['items']} has {len(items['path'])} rows, manifest.json "
                                      f"says {want[0]}")
        return cls(path, manifest, embeddings, items)

    def check_model(self, fingerprint: Optional[str], model_name: str = "the model") -> None:
        """Refuse a query model whose fingerprint differs from the one that built the index."""
        if fingerprint != self.fingerprint:
            raise EmbeddingIndexError(
                f"index {self.path} was built with model {self.fingerprint} ({self.manifest.get('model_dir')}), "
                f"but {model_name} has fingerprint {fingerprint}: embeddings of different models are not "
                "comparable; query with the index's model or rebuild the index")

    # -- searching ------------------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int = 10, backend: str = "auto") -> tuple[np.ndarray, np.ndarray]:
        """Top-K rows by cosine similarity.

        Args:
            queries: (Q, dim) or (dim,) L2-normalised query features (text or image, same model).
            k: results per query (clipped to the index size).
            backend: "exact", "faiss", or "auto" (faiss when a faiss index is stored and the index has at least
                ``search.FAISS_THRESHOLD`` rows, else exact).

        Returns:
            ``scores`` (Q, k) float32 best first and ``ids`` (Q, k) int64 rows (-1 where faiss found fewer).
        """
        from clip_mini import search as S

        if backend not in ("auto", "exact", "faiss"):
            raise EmbeddingIndexError(f"unknown search backend {backend!r} (use auto, exact or faiss)")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise EmbeddingIndexError(f"k must be a positive integer, got {k!r}")
        has_file = "faiss" in self.manifest["files"]
        if backend == "auto":
            backend = "faiss" if has_file and len(self) >= S.FAISS_THRESHOLD and S.faiss_available() else "exact"
        try:
            if backend == "exact":
                return S.exact_search(self.embeddings, queries, k)
            return S.faiss_search(self.faiss_index(), queries, k, self.dim)
        except ValueError as e:
            raise EmbeddingIndexError(f"search in {self.path}: {e}") from None

    def faiss_index(self, kind: str = "hnsw"):
        """The stored faiss index (checksum-verified), or one built in memory over these rows if none is stored."""
        from clip_mini import search as S

        if self._faiss is None:
            name = self.manifest["files"].get("faiss")
            if name is None:
                self._faiss = S.build_faiss(self.embeddings, kind)
            else:
                if sha256_file(self.path / name) != self.manifest["checksums"][name]:
                    raise EmbeddingIndexError(f"{self.path / name} is corrupt: its sha256 does not match manifest")
                self._faiss = S.load_faiss(self.path / name)
        return self._faiss

    # -- writing (see index_build) --------------------------------------------------------------------------
    @classmethod
    def build(cls, path: str | Path, embedder, images: Sequence[str], captions: Optional[dict] = None,
              **kwargs) -> "EmbeddingIndex":
        """Make ``path`` index exactly ``images`` (incremental, resumable); see ``index_build.sync_index``."""
        from clip_mini.index_build import sync_index

        return sync_index(path, embedder, images, captions=captions, prune=True, **kwargs)

    def add(self, embedder, images: Sequence[str], captions: Optional[dict] = None,
            **kwargs) -> "EmbeddingIndex":
        """Embed ``images`` that are new or changed and commit them next to the existing rows; returns the result."""
        from clip_mini.index_build import sync_index

        return sync_index(self.path, embedder, images, captions=captions, prune=False, **kwargs)

    @classmethod
    def merge(cls, path: str | Path, sources: Optional[Sequence[str | Path]] = None, **kwargs) -> "EmbeddingIndex":
        """Merge shard indexes (default: all of ``path/shards/``) into ``path``; see ``index_shards.merge_indexes``."""
        from clip_mini.index_shards import merge_indexes

        return merge_indexes(path, sources, **kwargs)


# -- manifest and items files --------------------------------------------------------------------------------
def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: str | Path) -> dict:
    """Read and validate ``manifest.json`` (its own digest included, so any edit or damage is caught)."""
    mpath = Path(path) / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EmbeddingIndexError(f"index {Path(path)} does not exist or has no manifest.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EmbeddingIndexError(f"{mpath} is corrupt: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise EmbeddingIndexError(f"{mpath} is corrupt: its content does not match its manifest_sha256")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EmbeddingIndexError(f"{mpath}: index format version {manifest.get('format_version')!r}, this "
                                  f"clip_mini reads version {FORMAT_VERSION}; rebuild the index")
    return manifest


def read_items(path: Path) -> dict[str, list]:
    """Read an items CSV into columns (stdlib csv: the search path does not import pandas)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or tuple(header) != ITEM_COLUMNS:
                raise EmbeddingIndexError(f"{path}: expected columns {','.join(ITEM_COLUMNS)}, got {header}")
            rows = list(reader)
    except UnicodeDecodeError as e:
        raise EmbeddingIndexError(f"{path} is corrupt: not UTF-8 ({e})") from None
    cols: dict[str, list] = {c: [] for c in ITEM_COLUMNS}
    for i, row in enumerate(rows, start=2):
        if len(row) != len(ITEM_COLUMNS):
            raise EmbeddingIndexError(f"{path}: line {i}: {len(row)} fields, expected {len(ITEM_COLUMNS)}")
        for c, v in zip(ITEM_COLUMNS, row):
            cols[c].append(v)
    cols["size"] = [int(v) for v in cols["size"]]
    cols["mtime_ns"] = [int(v) for v in cols["mtime_ns"]]
    return cols


def items_csv(items: dict[str, list]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(ITEM_COLUMNS)
    writer.writerows(zip(*(items[c] for c in ITEM_COLUMNS)))
    return buf.getvalue()


def current_generation(path: Path) -> int:
    return read_manifest(path)["generation"] if (path / "manifest.json").is_file() else 0


def commit(path: Path, generation: int, items: dict[str, list], meta: dict, faiss_kind: Optional[str] = None,
           progress: bool = True) -> EmbeddingIndex:
    """Publish generation ``generation``: ``embeddings-<gen>.npy`` must already be written (atomically).

    Writes the items file and the optional faiss index, then atomically replaces the manifest; finally removes
    data files older than the previous generation. Must run under ``writer_lock``.
    """
    from clip_mini import __version__

    emb_name, items_name = f"embeddings-{generation}.npy", f"items-{generation}.csv"
    atomic_write_text(path / items_name, items_csv(items))
    files = {"embeddings": emb_name, "items": items_name}
    if faiss_kind:
        from clip_mini import search as S

        emb = np.load(path / emb_name, mmap_mode="r")
        files["faiss"] = f"faiss-{generation}.index"
        S.save_faiss(S.build_faiss(emb, faiss_kind, progress=progress), path / files["faiss"])
    previous = current_generation(path)
    emb = np.load(path / emb_name, mmap_mode="r")
    manifest = {
        "format_version": FORMAT_VERSION, "generation": generation, "files": files,
        "checksums": {name: sha256_file(path / name) for name in files.values()},
        "count": int(emb.shape[0]), "dim": int(emb.shape[1]), "dtype": "float16", "faiss_kind": faiss_kind,
        "clip_mini_version": __version__, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta,
    }
    del emb
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    atomic_write_json(path / "manifest.json", manifest)
    _remove_old_generations(path, keep={generation, previous})
    return EmbeddingIndex.load(path, verify=False)


def _remove_old_generations(path: Path, keep: set[int]) -> None:
    for p in path.iterdir():
        m = _DATA_FILE.match(p.name)
        if m and int(m.group(2)) not in keep:
            p.unlink(missing_ok=True)


@contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Hold ``path/.lock`` exclusively; a second writer fails at once instead of interleaving generations."""
    import fcntl

    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EmbeddingIndexError(f"index {path} is being written by another process; wait for it to "
                                      "finish (a killed writer releases the lock automatically)") from None
        for p in path.glob(".*.tmp*"):   # temporaries of a writer that was killed mid-write
            p.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)
