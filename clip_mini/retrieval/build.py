"""Building an index: incremental, resumable, streaming, shardable.

``sync_index`` makes an index directory hold exactly a list of images (or adds to it):

1. stat every file; rows whose path, size and mtime are unchanged keep their stored embedding;
2. hash (sha256) the rest; content already embedded (a copy, a moved file, an unchanged file that was touched)
   reuses that embedding, and identical new files are embedded once;
3. embed what is left in batches, appending chunks of float16 rows to ``.work/`` as they finish, so a build
   killed at any point resumes from its last chunk (chunks are keyed by content hash, model fingerprint and
   flip averaging);
4. stream old rows and new chunks into a new ``embeddings-<gen>.npy``, float16 or bfloat16 rows (a memory map:
   memory stays bounded by one block however large the index), then commit the generation (see
   ``clip_mini.retrieval.index``).

Rows are sorted by path, so incremental, resumed and sharded builds give the same index as one pass.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from clip_mini.features.image_files import iter_image_features
from clip_mini.fileio.bounded_read import inspect_regular_files, sha256_regular_files
from clip_mini.fileio.atomic import atomic_path, atomic_write_json, atomic_write_text
from clip_mini.retrieval.format import (EmbeddingIndexError, commit, current_generation, in_shard, shard_dir,
                                        writer_lock)
from clip_mini.model.onnx_export import export_if_missing
from clip_mini.retrieval.reader import IndexReader
from clip_mini.retrieval.rows import DTYPES, BF16Rows, encode, numpy_dtype, storage_dtype
from clip_mini.retrieval.taken import TAKEN_COLUMNS, exif_seconds, taken

_BLOCK = 16384   # rows copied per step when writing a generation


def work_key(fingerprint: str, flip_average: bool) -> str:
    """What unfinished work (``.work/``) is keyed by: the model, and whether its rows are flip-averaged."""
    return fingerprint + (":flip" if flip_average else "")


class _Work:
    """``.work/``: chunks of embeddings computed by this (or an interrupted earlier) build, keyed by content hash."""

    def __init__(self, index_dir: Path, fingerprint: str):
        self.dir = index_dir / ".work"
        if self.dir.is_dir() and read_work_json(self.dir / "work.json").get("fingerprint") != fingerprint:
            shutil.rmtree(self.dir)   # left by another model (or damaged): useless
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.dir / "work.json", {"fingerprint": fingerprint})
        self.rows: dict[str, tuple[int, int]] = {}   # sha256 -> (chunk number, row)
        self.bad: dict[str, str] = {}                # sha256 -> reason
        self.chunks: list[np.ndarray] = []
        self._next = 0
        for j in sorted(self.dir.glob("chunk-*.json")):   # the .json is written last: present = chunk complete
            self._next = max(self._next, int(j.stem.split("-")[1]) + 1)
            rec = read_work_json(j)
            try:
                emb = np.load(j.with_suffix(".npy"), mmap_mode="r", allow_pickle=False)
                self._register(rec["hashes"], rec["bad"], emb)
            except (KeyError, ValueError, OSError):
                continue   # damaged chunk: its images are simply embedded again

    def _register(self, hashes: list[str], bad: dict[str, str], emb: np.ndarray) -> None:
        if len(hashes) != len(emb):
            raise ValueError("chunk rows do not match its hashes")
        n = len(self.chunks)
        self.chunks.append(emb)
        self.rows.update((h, (n, r)) for r, h in enumerate(hashes))
        self.bad.update(bad)

    def append(self, hashes: list[str], feats: np.ndarray, bad: dict[str, str]) -> None:
        name = f"chunk-{self._next:06d}"
        self._next += 1
        emb = feats.astype(np.float16)
        with atomic_path(self.dir / f"{name}.npy", suffix=".npy") as tmp:
            np.save(tmp, emb, allow_pickle=False)
        atomic_write_json(self.dir / f"{name}.json", {"hashes": hashes, "bad": bad})
        self._register(hashes, bad, emb)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def read_work_json(path: Path) -> dict:
    """A work record of an unfinished build, or {} when it is missing or damaged (its work is then redone)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stat(paths: Sequence[str]) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    stats, missing = {}, {}
    for p in paths:
        try:
            st = os.stat(p)
            stats[p] = (st.st_size, st.st_mtime_ns)
        except OSError as e:
            missing[p] = "missing file" if isinstance(e, FileNotFoundError) else f"cannot stat: {e.strerror}"
    return stats, missing


def _hash_all(paths: list[str], progress: bool
              ) -> tuple[dict[str, str], dict[str, Optional[int]], dict[str, str]]:
    """Each file's sha256, its EXIF capture time (``taken.exif_seconds`` on the descriptor just hashed: a header
    read, no second open) and the files that could not be read, with why."""
    from tqdm import tqdm

    hashes, exif, failed = {}, {}, {}
    # read ahead on one helper thread, each file under a time bound: a pipe, /dev/zero named *.jpg or a stalled
    # mount must not hang the build
    with tqdm(total=len(paths), desc="hashing new files", unit="file",
              disable=not progress or len(paths) < 1000) as bar:
        for p, value in sha256_regular_files(paths, inspect=exif_seconds):
            if isinstance(value, OSError):
                failed[p] = f"cannot read: {value.strerror or value}"
            else:
                hashes[p], exif[p] = value
            bar.update()
    return hashes, exif, failed


def _read_exif(paths: list[str], progress: bool) -> dict[str, Optional[int]]:
    """EXIF capture times of files not hashed by this build (rows kept from an index that recorded no dates): a
    header read each; a file that cannot be read has none (its row keeps its stored mtime)."""
    from tqdm import tqdm

    out: dict[str, Optional[int]] = {}
    with tqdm(total=len(paths), desc="reading capture dates", unit="file",
              disable=not progress or len(paths) < 1000) as bar:
        for p, value in inspect_regular_files(paths, exif_seconds):
            out[p] = None if isinstance(value, OSError) else value
            bar.update()
    return out


def sync_index(path: str | Path, embedder, images: Sequence[str], captions: Optional[dict[str, str]] = None,
               prune: bool = True, batch_size: int = 64, workers: Optional[int] = None, precision: str = "fp32",
               faiss: str = "auto", shard: Optional[tuple[int, int]] = None, flush_every: int = 1024,
               source: Optional[str] = None, model_dir: Optional[str] = None, progress: bool = True,
               recall_target: Optional[float] = None, memory_budget: Optional[float] = None,
               dtype: Optional[str] = None, flip_average: bool = False) -> IndexReader:
    """Bring the index at ``path`` up to date with ``images``.

    Args:
        path: index directory (created if absent). With ``shard=(i, n)`` the shard's own index
            ``path/shards/i-of-n`` is built from the images that fall into shard i; merge them with
            ``shards.merge_indexes``.
        embedder: ``clip_mini.load(model_dir)``; its fingerprint must match an existing index's.
        images: image file paths (made absolute).
        captions: optional ``{path: caption}`` stored with the rows.
        prune: drop rows whose path is not in ``images`` (False: keep them, i.e. add). The returned reader's
            ``changes`` counts the rows added and dropped.
        batch_size, workers, precision: embedding batch size, DataLoader workers decoding images (None:
            ``devices.default_workers`` for the embedder's device), "fp32" or "bf16" autocast.
        faiss: "auto" (keep the index's faiss kind; build HNSW above ``search.FAISS_THRESHOLD`` rows when faiss is
            installed), "none", "hnsw" or "ivf".
        flush_every: images per resumable chunk (at most this much work is lost to a kill).
        source: folder or captions file the images came from (recorded in the manifest).
        model_dir: the model directory (recorded so ``clip-mini search`` finds the model by default).
        recall_target: recall@10 the faiss search parameter is tuned to (default ``faiss_auto.RECALL_TARGET``).
        memory_budget: bytes the faiss index may take in RAM, for ``faiss="auto"`` (see ``faiss_kind``).
        dtype: how the rows are stored, "float16" or "bfloat16" (``clip_mini.retrieval.rows``); None keeps an
            existing index's (float16 for a new one). A change rewrites every row.
        flip_average: each row averages the image with its left-right mirror (``model.clip.ImageForward``: twice
            the image pass); recorded in the manifest. Like the model, it cannot change on an existing index.

    Raises:
        EmbeddingIndexError: no images, no usable image, an index built with another model or another
            ``flip_average``, a busy index.
    """
    if recall_target is not None and not 0 < recall_target <= 1:
        raise EmbeddingIndexError(f"--recall-target must be in (0, 1], got {recall_target}")
    if dtype is not None and dtype not in DTYPES:
        raise EmbeddingIndexError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = Path(path) if shard is None else shard_dir(path, shard)
    images = sorted(set(os.path.abspath(p) for p in images))
    if shard is not None:
        images = [p for p in images if in_shard(p, shard)]
    if not images and shard is None:
        raise EmbeddingIndexError(f"no images to index{f' in {source}' if source else ''}")
    if embedder.fingerprint is None:
        raise EmbeddingIndexError("the embedder has no model fingerprint: load it from a saved model directory")
    captions = {os.path.abspath(k): v for k, v in (captions or {}).items()}
    with writer_lock(path):
        old = IndexReader.load(path) if (path / "manifest.json").is_file() else None
        if old is not None:
            old.check_model(embedder.fingerprint, "the model used for indexing")
            old.check_flip_average(flip_average)
        rows, todo, skipped = _plan(old, images, captions, prune, progress)
        work = _Work(path, work_key(embedder.fingerprint, flip_average))
        from clip_mini.runtime.devices import default_workers   # torch: only on the embedding path

        workers = default_workers(workers, embedder.device)
        _embed_missing(embedder, todo, work, batch_size, workers, precision, flush_every, progress, flip_average)
        if model_dir and hasattr(embedder, "model"):   # queries on this index then run without torch
            export_if_missing(embedder.model, model_dir)
        skipped.update({p: work.bad[h] for p, h in zip(rows["path"], rows["sha256"]) if h in work.bad})
        keep = [i for i, h in enumerate(rows["sha256"]) if h not in work.bad]
        rows = {c: [v[i] for i in keep] for c, v in rows.items()}
        _write_skipped(path, skipped)
        if not rows["path"] and shard is None:
            raise EmbeddingIndexError(f"none of the {len(images)} images could be embedded (see {path}/skipped.csv)")
        if progress and skipped:
            print(f"index: skipped {len(skipped)} unusable images (see {path / 'skipped.csv'})")
        changes = _changes(old, rows["path"])
        kind = faiss_kind(faiss, old, len(rows["path"]), embedder.dim, memory_budget)
        dtype = dtype or (storage_dtype(old.embeddings) if old is not None else "float16")
        if old is not None and _unchanged(old, rows, kind) and storage_dtype(old.embeddings) == dtype:
            work.remove()
            old.changes = changes
            return old
        meta = {"model_fingerprint": embedder.fingerprint, "source": source, "shard": list(shard) if shard else None,
                "model_dir": str(Path(model_dir).resolve()) if model_dir else None, "flip_average": bool(flip_average)}
        # one commit: the gone files' rows leave in the same atomic generation the new ones arrive in
        index = _publish(path, old, work, rows, embedder.dim, meta, kind, progress, recall_target, dtype)
        work.remove()
        index.changes = changes
        return index


def _changes(old: Optional[IndexReader], paths: list[str]) -> dict[str, int]:
    """Rows a build adds (paths new to the index) and drops (paths it held that the new generation does not: files
    gone, no longer listed, or now unreadable)."""
    before = set(old.items["path"]) if old is not None else set()
    after = set(paths)
    return {"added": len(after - before), "dropped": len(before - after)}


def _publish(path: Path, old: Optional[IndexReader], work: "_Work", rows: dict[str, list], dim: int, meta: dict,
             kind: Optional[str], progress: bool, recall_target: Optional[float] = None,
             dtype: str = "float16") -> IndexReader:
    """Write the next generation from old rows and work chunks, then commit it."""
    sources = [old.embeddings if old is not None else np.zeros((0, dim), np.float16)] + work.chunks
    plan = [(0, r) if s == "old" else (1 + work.rows[h][0], work.rows[h][1])
            for (s, r), h in zip(rows.pop("source"), rows["sha256"])]
    generation = current_generation(path) + 1
    write_embeddings(path / f"embeddings-{generation}.npy", sources, plan, dim, dtype)
    commit(path, generation, rows, meta, kind, progress, recall_target)
    return IndexReader.load(path, verify=False)


def _plan(old: Optional[IndexReader], images: list[str], captions: dict[str, str], prune: bool,
          progress: bool) -> tuple[dict[str, list], dict[str, str], dict[str, str]]:
    """Decide each output row's source: ("old", row) or ("new", -1); returns rows, {sha: path} to embed, skipped."""
    stats, skipped = _stat(images)
    old_by_path = {p: i for i, p in enumerate(old.items["path"])} if old is not None else {}
    old_by_hash = {h: i for i, h in enumerate(old.items["sha256"])} if old is not None else {}
    if old is not None and not prune:   # adding: every old row stays unless its path is being re-indexed
        for p, i in old_by_path.items():
            if p not in stats and p not in skipped:
                stats[p] = (old.items["size"][i], old.items["mtime_ns"][i])
    unchanged = {p for p, st in stats.items() if p in old_by_path
                 and (old.items["size"][old_by_path[p]], old.items["mtime_ns"][old_by_path[p]]) == st}
    hashes, exif, failed = _hash_all(sorted(set(stats) - unchanged), progress)
    skipped.update(failed)
    old_taken = old is not None and all(c in old.items for c in TAKEN_COLUMNS)
    if not old_taken:   # rows kept from an index that records no dates: read them now (upgrading it)
        exif.update(_read_exif(sorted(unchanged), progress))
    rows: dict[str, list] = {c: [] for c in ("path", "size", "mtime_ns", "sha256", "caption", "source",
                                             *TAKEN_COLUMNS)}
    todo: dict[str, str] = {}
    for p in sorted(set(stats) - set(failed)):
        if p in unchanged:
            i = old_by_path[p]
            h, src = old.items["sha256"][i], ("old", i)
            when = (old.items["taken"][i], old.items["taken_from"][i]) if old_taken else taken(exif[p], stats[p][1])
        else:
            h = hashes[p]
            src = ("old", old_by_hash[h]) if h in old_by_hash else ("new", -1)
            if src[0] == "new":
                todo.setdefault(h, p)
            when = taken(exif[p], stats[p][1])
        default = old.items["caption"][old_by_path[p]] if p in old_by_path else ""
        for c, v in zip(rows, (p, stats[p][0], stats[p][1], h, captions.get(p, default), src, *when)):
            rows[c].append(v)
    return rows, todo, skipped


def _embed_missing(embedder, todo: dict[str, str], work: _Work, batch_size: int, workers: int, precision: str,
                   flush_every: int, progress: bool, flip_average: bool = False) -> None:
    pending = [(h, p) for h, p in sorted(todo.items(), key=lambda hp: hp[1])
               if h not in work.rows and h not in work.bad]
    if not pending:
        return
    if progress and len(pending) < len(todo):
        print(f"index: resuming, {len(todo) - len(pending)} of {len(todo)} new images already embedded")
    hashes, feats, bad = [], [], {}
    paths = [p for _, p in pending]
    for idx, f, failed in iter_image_features(embedder, paths, batch_size, workers, precision, progress,
                                              flip_average=flip_average):
        hashes += [pending[i][0] for i in idx]
        feats.append(f)
        bad.update({pending[i][0]: reason for i, reason in failed.items()})
        if len(hashes) + len(bad) >= flush_every:
            work.append(hashes, np.concatenate(feats), bad)
            hashes, feats, bad = [], [], {}
    if hashes or bad:
        work.append(hashes, np.concatenate(feats), bad)


def write_embeddings(out: Path, sources: list, plan: list[tuple[int, int]], dim: int,
                     dtype: str = "float16") -> None:
    """Stream rows ``sources[s][r]`` for each ``(s, r)`` in ``plan`` into a new .npy (atomically), stored as
    ``dtype`` (``rows.DTYPES``; a source may be stored in either)."""
    src = np.array([s for s, _ in plan], dtype=np.int64).reshape(-1)
    row = np.array([r for _, r in plan], dtype=np.int64).reshape(-1)
    same = all(storage_dtype(x) == dtype for x in sources)   # rows copied bit for bit, never re-rounded
    with atomic_path(out, suffix=".npy") as tmp:
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=numpy_dtype(dtype), shape=(len(plan), dim))
        for start in range(0, len(plan), _BLOCK):
            s, r = src[start:start + _BLOCK], row[start:start + _BLOCK]
            block = np.empty((len(s), dim), mm.dtype if same else np.float32)
            for k in np.unique(s):
                sel = s == k
                rows_k = sources[k]
                block[sel] = rows_k.bits[r[sel]] if same and isinstance(rows_k, BF16Rows) else rows_k[r[sel]]
            mm[start:start + len(s)] = block if same else encode(block, dtype)
        mm.flush()
        del mm


def _unchanged(old: IndexReader, rows: dict[str, list], kind: Optional[str]) -> bool:
    same_rows = [s for s in rows["source"]] == [("old", i) for i in range(len(old))]
    return same_rows and all(c in old.items and rows[c] == old.items[c]
                             for c in ("path", "size", "mtime_ns", "caption", *TAKEN_COLUMNS)) \
        and kind == old.manifest.get("faiss_kind")


def faiss_kind(faiss: str, old: Optional[IndexReader], count: int, dim: int = 256,
               memory_budget: Optional[float] = None) -> Optional[str]:
    """The faiss index to store for ``count`` rows of width ``dim``: the user's choice, or for "auto" the index's
    own kind, else none below ``search.FAISS_THRESHOLD`` rows, HNSW (fastest at a recall) while its float32 rows and
    graph fit ``memory_budget`` bytes (default: half the memory available now) and the rows are below
    ``search.IVFPQ_THRESHOLD`` (past that IVF-PQ is faster at a recall and HNSW builds slowly), else IVF-PQ, whose
    codes are a few percent of the rows (re-ranked exactly from the memory-mapped rows)."""
    from clip_mini.retrieval import search as S

    if faiss not in ("auto", "none", "hnsw", "ivf", "ivfpq"):
        raise EmbeddingIndexError(f"faiss must be auto, none, hnsw, ivf or ivfpq, got {faiss!r}")
    if memory_budget is not None and not memory_budget > 0:
        raise EmbeddingIndexError(f"--memory-budget must be positive, got {memory_budget}")
    if faiss == "none":
        return None
    if faiss != "auto":
        if not S.faiss_available():
            raise EmbeddingIndexError("faiss is not installed: pip install 'clip-mini[faiss]' (or --faiss none)")
        return faiss
    if old is not None and old.manifest.get("faiss_kind"):
        return old.manifest["faiss_kind"]
    if count < S.FAISS_THRESHOLD or not S.faiss_available():
        return None
    budget = available_memory() / 2 if memory_budget is None else memory_budget
    if count < S.IVFPQ_THRESHOLD and S.faiss_memory("hnsw", count, dim) <= budget:
        return "hnsw"
    need = S.faiss_memory("ivfpq", count, dim)
    if need > budget:
        raise EmbeddingIndexError(f"no faiss index of {count:,} rows fits the memory budget of {budget / 2**30:.2f} "
                                  f"GiB (IVF-PQ needs ~{need / 2**30:.2f} GiB): raise --memory-budget or use "
                                  "--faiss none (exact search reads the rows from disk)")
    return "ivfpq"


def available_memory() -> int:
    """Bytes of memory available now (Linux MemAvailable; else total physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _write_skipped(path: Path, skipped: dict[str, str]) -> None:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["path", "reason"])
    w.writerows(sorted(skipped.items()))
    atomic_write_text(path / "skipped.csv", buf.getvalue())
