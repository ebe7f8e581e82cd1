"""The index directory format: manifest, items table, generations, atomic commits, the writer lock.

See ``clip_mini.retrieval.index`` for the layout. Everything here is plain files and numpy: no torch, no pandas, so opening
an index for a text search stays fast.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from clip_mini.errors import EmbeddingIndexError
from clip_mini.fileio.atomic import atomic_write_json, sha256_file
from clip_mini.retrieval.rows import storage_dtype, wrap
from clip_mini.retrieval.taken import TAKEN_COLUMNS

# 2: item paths are relative to the manifest's "root" (the indexed folder, recorded once), so a folder moved or
# shared together with its index keeps working. Version 1 (absolute paths) is still read.
FORMAT_VERSION = 2
# 3: bfloat16 rows (stored as uint16 bits, see clip_mini.retrieval.rows); float16 indexes stay version 2, so a
# clip_mini that predates bfloat16 still reads them and refuses a bf16 one with a clear "format version" error
BF16_FORMAT_VERSION = 3
# 4: the items table columnar and memory-mapped (items-<gen>.cols, clip_mini.retrieval.items), read row by row
# instead of whole; what every commit writes now, float16 or bfloat16. Versions 1-3 (items CSV) are still read.
COLUMNAR_FORMAT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
ITEM_COLUMNS = ("path", "size", "mtime_ns", "sha256", "caption")
# Rows indexed from WebDataset shards add where the image sits (path is "shard#key"); a reader that predates
# them stops at the header with "expected columns ...", so the format version stays.
WDS_COLUMNS = ("shard", "key", "offset", "length")
# Rows of an image folder also record when each photo was taken (TAKEN_COLUMNS, ``clip_mini.retrieval.taken``): a
# reader that predates them ignores the extra columns, and an index without them searches as before (date filters
# ask for a re-index), so the format version stays too.
# (an embeddings file's int8 codes, ``search.codes``, are embeddings-<gen>.int8 and .int8.json: they go with it)
_DATA_FILE = re.compile(r"^(embeddings|items|faiss)-(\d+)\.(npy|csv|cols|index|int8|int8\.json)$")


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
    if manifest.get("format_version") not in READ_VERSIONS:
        raise EmbeddingIndexError(f"{mpath}: index format version {manifest.get('format_version')!r}, this "
                                  f"clip_mini reads versions {', '.join(map(str, READ_VERSIONS))}; rebuild the "
                                  "index or upgrade clip_mini")
    return manifest


def relative_items(items: dict[str, list], index_dir: Path) -> tuple[dict[str, list], Optional[dict]]:
    """Item paths (and WebDataset rows' shard files) relative to the deepest folder holding them all, and that
    folder (absolute, and relative to the index directory); paths stay as given when any is not absolute. A
    columnar index (format version 4) joins both back on reading; an items CSV (versions 1-3) stored shard files
    absolute."""
    paths = items["path"]
    if not paths or not all(os.path.isabs(p) for p in paths):
        return items, None
    try:
        root = os.path.commonpath([os.path.dirname(p) for p in paths])
    except ValueError:   # images on several drives (Windows): no common folder, keep the paths absolute
        return items, None
    try:
        from_index = Path(os.path.relpath(root, os.path.abspath(index_dir))).as_posix()
    except ValueError:   # the index on another drive: only the absolute folder can find it
        from_index = None
    rel = [Path(os.path.relpath(p, root)).as_posix() for p in paths]
    out = {**items, "path": rel}
    if "shard" in items:   # WebDataset rows: the tar files too, so shards moved with their index are found
        out["shard"] = [Path(os.path.relpath(s, root)).as_posix() if os.path.isabs(s) else s for s in items["shard"]]
    return out, {"path": root, "from_index": from_index}


def items_root(manifest: dict, index_dir: Path) -> Optional[str]:
    """The folder item paths are relative to: found from the index directory when the two moved together, else
    where it was when the index was written; None for absolute item paths (format version 1)."""
    root = manifest.get("root")
    if not root:
        return None
    if root.get("from_index") is not None:
        beside = os.path.normpath(os.path.join(os.path.abspath(index_dir), root["from_index"]))
        if os.path.isdir(beside):
            return beside
    return root["path"]


def absolute_items(items: dict[str, list], manifest: dict, index_dir: Path) -> dict[str, list]:
    """Items with absolute paths (what every reader works with), from either format version."""
    root = items_root(manifest, index_dir)
    if root is None:
        return items
    root = os.path.normpath(root)
    if os.sep != "/":
        return {**items, "path": [os.path.normpath(os.path.join(root, p)) for p in items["path"]]}
    # Stored paths are os.path.relpath output (already normal), so joining is a concatenation except for paths
    # that leave the root: much cheaper than normpath for every row, a cold query's cost on a large index.
    prefix = root.rstrip("/") + "/"
    return {**items, "path": [prefix + p if not (p.startswith("..") or p.startswith("/"))
                              else os.path.normpath(os.path.join(root, p)) for p in items["path"]]}


def open_items(path: Path, manifest: dict, index_dir: Path) -> dict:
    """The items table of an index with absolute paths: columnar (version 4) read lazily, CSV (versions 1-3)
    read whole."""
    if path.suffix == ".csv":
        return absolute_items(read_items(path), manifest, index_dir)
    from clip_mini.retrieval.items import ItemsFormatError, read_items as read_columnar

    try:
        return read_columnar(path, items_root(manifest, index_dir))
    except ItemsFormatError as e:
        raise EmbeddingIndexError(str(e)) from None


def read_items(path: Path) -> dict:
    """Read an items file into columns as stored (paths as written): a CSV whole, into lists (stdlib csv: the
    search path does not import pandas); a columnar ``.cols`` file lazily (``clip_mini.retrieval.items``)."""
    if Path(path).suffix != ".csv":
        from clip_mini.retrieval.items import ItemsFormatError, read_items as read_columnar

        try:
            return read_columnar(path)
        except ItemsFormatError as e:
            raise EmbeddingIndexError(str(e)) from None
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            names = tuple(header or ())
            if names not in (ITEM_COLUMNS, ITEM_COLUMNS + WDS_COLUMNS):
                raise EmbeddingIndexError(f"{path}: expected columns {','.join(ITEM_COLUMNS)}, got {header}")
            rows = list(reader)
    except UnicodeDecodeError as e:
        raise EmbeddingIndexError(f"{path} is corrupt: not UTF-8 ({e})") from None
    for i, row in enumerate(rows, start=2):
        if len(row) != len(names):
            raise EmbeddingIndexError(f"{path}: line {i}: {len(row)} fields, expected {len(names)}")
    columns = list(zip(*rows)) if rows else [()] * len(names)
    cols: dict[str, list] = {c: list(v) for c, v in zip(names, columns)}
    for c in ("size", "mtime_ns", "offset", "length"):
        if c in cols:
            cols[c] = [int(v) for v in cols[c]]
    return cols


def items_csv(items: dict[str, list]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    names = ITEM_COLUMNS + WDS_COLUMNS if "shard" in items else ITEM_COLUMNS
    writer.writerow(names)
    writer.writerows(zip(*(items[c] for c in names)))
    return buf.getvalue()


def item_columns(items: dict) -> tuple[str, ...]:
    """The columns a commit writes for ``items``: the item columns, WebDataset's where rows come from shards, and
    the capture dates where the build recorded them."""
    return (ITEM_COLUMNS + (WDS_COLUMNS if "shard" in items else ())
            + (TAKEN_COLUMNS if all(c in items for c in TAKEN_COLUMNS) else ()))


def current_generation(path: Path) -> int:
    return read_manifest(path)["generation"] if (path / "manifest.json").is_file() else 0


def commit(path: Path, generation: int, items: dict[str, list], meta: dict, faiss_kind: Optional[str] = None,
           progress: bool = True, recall_target: Optional[float] = None) -> dict:
    """Publish generation ``generation``: ``embeddings-<gen>.npy`` must already be written (atomically).

    Writes the items file, the optional faiss index (its search parameter tuned to ``recall_target``, see
    ``faiss_auto``) and, from ``search.codes.MIN_ROWS`` rows, the rows' int8 codes beside them (the int8 exact
    kernel's sidecar, ``search.codes``), then atomically replaces the manifest; finally removes
    data files older than the previous generation. Must run under ``writer_lock``. Returns the new manifest.
    """
    from clip_mini.version import __version__

    from clip_mini.retrieval.items import write_items

    emb_name, items_name = f"embeddings-{generation}.npy", f"items-{generation}.cols"
    items, root = relative_items(items, path)
    write_items(path / items_name, items, item_columns(items))
    files = {"embeddings": emb_name, "items": items_name}
    faiss_params = None
    if faiss_kind:
        from clip_mini.retrieval import faiss_auto, search as S

        emb = wrap(np.load(path / emb_name, mmap_mode="r"))
        files["faiss"] = f"faiss-{generation}.index"
        index = S.build_faiss(emb, faiss_kind, progress=progress)
        faiss_params = faiss_auto.tune(index, faiss_kind, emb, recall_target or faiss_auto.RECALL_TARGET)
        S.save_faiss(index, path / files["faiss"])
    previous = current_generation(path)
    emb = wrap(np.load(path / emb_name, mmap_mode="r"))
    from clip_mini.retrieval.search import codes as int8_codes

    if len(emb) >= int8_codes.MIN_ROWS:   # before the manifest: a server opening the generation finds them
        int8_codes.write_beside(path / emb_name)
    manifest = {
        "format_version": COLUMNAR_FORMAT_VERSION,
        "generation": generation, "files": files,
        "checksums": {name: sha256_file(path / name) for name in files.values()},
        "count": int(emb.shape[0]), "dim": int(emb.shape[1]), "dtype": storage_dtype(emb), "faiss_kind": faiss_kind,
        "faiss_params": faiss_params,
        "root": root,
        "clip_mini_version": __version__, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta,
    }
    del emb
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    atomic_write_json(path / "manifest.json", manifest)
    _remove_old_generations(path, keep={generation, previous})
    return manifest


def _remove_old_generations(path: Path, keep: set[int]) -> None:
    for p in path.iterdir():
        m = _DATA_FILE.match(p.name)
        if m and int(m.group(2)) not in keep:
            p.unlink(missing_ok=True)


@contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Hold ``path/.lock`` exclusively; a second writer fails at once instead of interleaving generations.

    ``filelock`` takes an OS lock (flock on POSIX, msvcrt on Windows), so a killed writer releases it.
    """
    from filelock import FileLock, Timeout

    if path.exists() and not path.is_dir():
        raise EmbeddingIndexError(f"index {path} is a file, not a directory: choose a folder for the index (a new "
                                  "one, or an index to update)")
    path.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path / ".lock", timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise EmbeddingIndexError(f"index {path} is being written by another process; wait for it to "
                                  "finish (a killed writer releases the lock automatically)") from None
    try:
        for p in path.glob(".*.tmp*"):   # temporaries of a writer that was killed mid-write
            p.unlink(missing_ok=True)
        yield
    finally:
        lock.release()


# -- sharded builds: shard i of n indexes the files with crc32(path) % n == i, into path/shards/i-of-n ---------
def parse_shard(text: str) -> tuple[int, int]:
    """``"1/4"`` -> (1, 4): shard 1 of 4 (0-based)."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise EmbeddingIndexError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise EmbeddingIndexError(f"--shard {text}: need 0 <= i < n")
    return i, n


def shard_dir(path: str | Path, shard: tuple[int, int]) -> Path:
    return Path(path) / "shards" / f"{shard[0]}-of-{shard[1]}"


def in_shard(path: str, shard: tuple[int, int]) -> bool:
    # crc32 of the path: a file stays in its shard however the folder grows, and shards stay balanced.
    return zlib.crc32(path.encode("utf-8", "surrogateescape")) % shard[1] == shard[0]
