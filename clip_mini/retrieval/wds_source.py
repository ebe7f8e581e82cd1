"""Indexing WebDataset shards: every image in the shards becomes a row that records its shard, key and offset.

``index_shards`` mirrors ``build.sync_index`` for tar shards. The unit of work is a shard: its rows are kept while
the shard file is unchanged (same size and mtime), so adding shards re-embeds only the new ones, and a build that
is killed resumes after the last finished shard (``.work/part-*``, keyed by the model fingerprint and flip
averaging). Rows are sorted by ``path`` = ``"<shard>#<key>"``, so one pass, a resumed pass and a Ray pass give the
same index.
``read_image`` reads one row's image back from its shard by offset (search grids, the server).

The embedding pass is pluggable: ``embed_local`` (this process) or ``ray_index.embed_with_ray``; both call
``embed_images`` on the same decode + transform + model, and hand finished parts to ``Parts.write``.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import numpy as np

from clip_mini.data.readers import DataError
from clip_mini.data.webdataset import SkipLog, decode_image, iter_shard, read_member, shard_identity_of
from clip_mini.fileio.atomic import atomic_path, atomic_write_json
from clip_mini.retrieval.build import _write_skipped, faiss_kind, read_work_json, work_key, write_embeddings
from clip_mini.retrieval.format import EmbeddingIndexError, commit, current_generation, writer_lock
from clip_mini.retrieval.reader import IndexReader
from clip_mini.retrieval.rows import storage_dtype

if TYPE_CHECKING:   # the query path imports this module and must not pull in torch
    from clip_mini.model.clip import ImageForward

ROW_FIELDS = ("shard", "size", "mtime_ns", "key", "caption", "offset", "length", "sha256")


class Parts:
    """``.work/part-*``: finished embeddings with their rows, and the shards they complete (resumable builds)."""

    def __init__(self, index_dir: Path, fingerprint: str):
        self.dir = index_dir / ".work"
        meta = read_work_json(self.dir / "work.json")
        if self.dir.is_dir() and meta.get("fingerprint") != fingerprint:
            import shutil

            shutil.rmtree(self.dir)   # another model's (or damaged) work: useless
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.dir / "work.json", {"fingerprint": fingerprint})
        self.rows: list[dict] = []          # one dict of ROW_FIELDS lists per part
        self.arrays: list[np.ndarray] = []
        self.complete: set[tuple] = set()   # (shard, size, mtime_ns) fully embedded
        self.skipped: dict[str, str] = {}   # "shard#key" -> reason
        self._next = 0
        for j in sorted(self.dir.glob("part-*.json")):   # the .json is written last: present = part complete
            self._next = max(self._next, int(j.stem.split("-")[1]) + 1)
            rec = read_work_json(j)
            try:
                self._register(rec, np.load(j.with_suffix(".npy"), mmap_mode="r", allow_pickle=False))
            except (KeyError, ValueError, OSError):
                continue   # damaged part: its shards are embedded again

    def _register(self, rec: dict, emb: np.ndarray) -> None:
        if len(emb) != len(rec["rows"]["key"]):
            raise ValueError("part rows do not match its embeddings")
        self.rows.append(rec["rows"])
        self.arrays.append(emb)
        self.complete.update(tuple(c) for c in rec["complete"])
        self.skipped.update(rec["skipped"])

    def write(self, rows: dict[str, list], feats: np.ndarray, complete: Sequence[tuple], skipped: dict[str, str]
              ) -> None:
        """Store one part: rows (ROW_FIELDS lists), their (n, d) features, shards it completes, skipped samples."""
        name = f"part-{self._next:06d}"
        self._next += 1
        emb = np.asarray(feats, dtype=np.float16)
        emb = emb.reshape(len(rows["key"]), emb.shape[-1] if emb.ndim == 2 else 0)
        with atomic_path(self.dir / f"{name}.npy", suffix=".npy") as tmp:
            np.save(tmp, emb, allow_pickle=False)
        rec = {"rows": rows, "complete": [list(c) for c in complete], "skipped": skipped}
        atomic_write_json(self.dir / f"{name}.json", rec)
        self._register(rec, emb)

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def empty_rows() -> dict[str, list]:
    return {f: [] for f in ROW_FIELDS}


def embed_images(embedder, blobs: Sequence[bytes], names: Sequence[str], forward: ImageForward
                 ) -> tuple[np.ndarray, dict[int, str]]:
    """Decode, transform and embed image bytes: ``(features (k, d) float32 of the decodable ones, {i: reason})``.

    ``forward`` is the folder path's own (``model.ImageForward``), so shards and folders store the same rows.
    """
    import torch

    from clip_mini.data.images import ImageError

    pixels, bad = [], {}
    for i, (blob, name) in enumerate(zip(blobs, names)):
        try:
            pixels.append(embedder.transform(decode_image(blob, name)))
        except ImageError as e:
            bad[i] = e.reason
    if not pixels:
        return np.zeros((0, embedder.dim), np.float32), bad
    return forward(torch.stack(pixels)).cpu().numpy(), bad


def embed_local(embedder, shards: Sequence[str], parts: Parts, batch_size: int, precision: str,
                progress: bool, flip_average: bool = False) -> None:
    """Embed each shard in this process; one part per shard (a kill loses at most the shard being read)."""
    from tqdm import tqdm

    from clip_mini.model.clip import ImageForward

    forward = ImageForward(embedder.model, precision, embedder.device, flip_average)
    for url in tqdm(shards, desc="embedding shards", unit="shard", disable=not progress):
        size, mtime = shard_identity_of(url)
        log = SkipLog("index", show=5 if progress else 0)
        rows, feats, batch = empty_rows(), [], []

        def flush() -> None:
            f, bad = embed_images(embedder, [s.image for s in batch], [f"{url}:{s.key}" for s in batch], forward)
            for i, s in enumerate(batch):
                if i in bad:
                    log(url, s.key, bad[i])
                    continue
                for k, v in zip(ROW_FIELDS, (url, size, mtime, s.key, s.caption, s.offset, len(s.image),
                                             hashlib.sha256(s.image).hexdigest())):
                    rows[k].append(v)
            feats.append(f)
            batch.clear()

        for sample in iter_shard(url, log):
            batch.append(sample)
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
        emb = np.concatenate(feats) if feats else np.zeros((0, embedder.dim), np.float32)
        parts.write(rows, emb, [(url, size, mtime)], {f"{s}#{k}": r for s, k, r in log.rows})


Embedder = Callable[[Sequence[str], Parts], None]


def index_shards(path: str | Path, embedder, shards: Sequence[str], batch_size: int = 64, precision: str = "fp32",
                 faiss: str = "auto", source: Optional[str] = None, model_dir: Optional[str] = None,
                 progress: bool = True, embed: Optional[Embedder] = None, dtype: Optional[str] = None,
                 flip_average: bool = False) -> IndexReader:
    """Make the index at ``path`` hold every usable image of ``shards`` (a mirror: other rows are dropped).

    Args:
        shards: shard URLs (``clip_mini.data.webdataset.expand_shards``).
        embed: the embedding pass ``embed(pending_shards, parts)``; default ``embed_local`` in this process. A
            pass of its own must embed as ``flip_average`` says (``ray_index.ray_embedder`` takes it too).
        dtype: row storage, "float16" or "bfloat16"; None keeps an existing index's (float16 for a new one).
        Others as ``build.sync_index``.

    Raises:
        EmbeddingIndexError: no shards, no usable sample, another model's (or ``flip_average``'s) index, a busy
            index.
    """
    path = Path(path)
    if not shards:
        raise EmbeddingIndexError("no shards to index")
    if embedder.fingerprint is None:
        raise EmbeddingIndexError("the embedder has no model fingerprint: load it from a saved model directory")
    with writer_lock(path):
        old = IndexReader.load(path) if (path / "manifest.json").is_file() else None
        if old is not None:
            old.check_model(embedder.fingerprint, "the model used for indexing")
            old.check_flip_average(flip_average)
        ids = {u: (u, *shard_identity_of(u)) for u in dict.fromkeys(shards)}
        kept = _old_rows(old, ids)   # shards whose file is unchanged keep their rows
        parts = Parts(path, work_key(embedder.fingerprint, flip_average))
        pending = [u for u, ident in ids.items() if ident not in kept and ident not in parts.complete]
        if pending:
            (embed or (lambda todo, p: embed_local(embedder, todo, p, batch_size, precision, progress,
                                                   flip_average)))(pending, parts)
        if model_dir and hasattr(embedder, "model"):   # as sync_index: queries on this index then run without torch
            from clip_mini.model.onnx_export import export_if_missing

            export_if_missing(embedder.model, model_dir)
        rows, plan, skipped = _assemble(old, kept, parts, ids)
        _write_skipped(path, skipped)
        if not rows["path"]:
            raise EmbeddingIndexError(f"none of the samples in {len(ids)} shards could be embedded "
                                      f"(see {path}/skipped.csv)")
        if progress and skipped:
            print(f"index: skipped {len(skipped)} unusable samples (see {path / 'skipped.csv'})")
        sources = [old.embeddings if old is not None else np.zeros((0, embedder.dim), np.float16)] + parts.arrays
        generation = current_generation(path) + 1
        write_embeddings(path / f"embeddings-{generation}.npy", sources, plan, embedder.dim,
                         dtype or (storage_dtype(old.embeddings) if old is not None else "float16"))
        meta = {"model_fingerprint": embedder.fingerprint, "source": source, "shard": None,
                "model_dir": str(Path(model_dir).resolve()) if model_dir else None, "flip_average": bool(flip_average)}
        commit(path, generation, rows, meta, faiss_kind(faiss, old, len(plan), embedder.dim), progress)
        parts.remove()
    return IndexReader.load(path, verify=False)


def _old_rows(old: Optional[IndexReader], ids: dict[str, tuple]) -> dict[tuple, list[int]]:
    """{shard identity: old row numbers} for the shards an existing WebDataset index already holds unchanged."""
    if old is None or "shard" not in old.items:
        return {}
    want = {ident for ident in ids.values() if ident[1] >= 0}
    kept: dict[tuple, list[int]] = {}
    it = old.items
    for r, ident in enumerate(zip(it["shard"], it["size"], it["mtime_ns"])):
        if ident in want:
            kept.setdefault(ident, []).append(r)
    return kept


def _assemble(old, kept: dict[tuple, list[int]], parts: Parts, ids: dict[str, tuple]
              ) -> tuple[dict[str, list], list[tuple[int, int]], dict[str, str]]:
    """Rows (sorted by path, each (shard, key) once) and their (source, row) plan: source 0 = old, k = part k-1."""
    wanted = set(ids.values())
    entries: dict[str, tuple] = {}   # path -> (source, row, fields)
    for ident, rs in kept.items():
        for r in rs:
            it = old.items
            fields = (it["shard"][r], it["size"][r], it["mtime_ns"][r], it["key"][r], it["caption"][r],
                      it["offset"][r], it["length"][r], it["sha256"][r])
            entries.setdefault(f"{fields[0]}#{fields[3]}", (0, r, fields))
    skipped = {}
    for k, rows in enumerate(parts.rows):
        for r, fields in enumerate(zip(*(rows[f] for f in ROW_FIELDS))):
            if tuple(fields[:3]) in wanted and tuple(fields[:3]) not in kept:
                entries.setdefault(f"{fields[0]}#{fields[3]}", (k + 1, r, fields))   # a re-run block: first wins
    for name, reason in parts.skipped.items():
        if name not in entries:
            skipped[name] = reason
    out: dict[str, list] = {c: [] for c in ("path", "size", "mtime_ns", "sha256", "caption",
                                            "shard", "key", "offset", "length")}
    plan = []
    for p in sorted(entries):
        src, r, (shard, size, mtime, key, caption, offset, length, sha) = entries[p]
        for c, v in zip(out, (p, size, mtime, sha, caption, shard, key, offset, length)):
            out[c].append(v)
        plan.append((src, r))
    return out, plan, skipped


def read_image(items: dict[str, list], row: int) -> bytes:
    """The image bytes of one row of a WebDataset index, read from its shard by offset."""
    if "shard" not in items:
        raise EmbeddingIndexError("this index was not built from WebDataset shards: its rows are image files")
    return read_member(items["shard"][row], int(items["offset"][row]), int(items["length"][row]))




@contextmanager
def hit_image_files(items: dict[str, list], rows: Sequence[int]) -> Iterator[list[str]]:
    """Image files for result rows: the files themselves, or (WebDataset rows) copies read from the shards by
    offset into a temporary folder that lives as long as the ``with`` block."""
    if "shard" not in items:
        yield [items["path"][r] for r in rows]
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="clip-mini-hits-") as tmp:
        files = []
        for n, r in enumerate(rows):
            name = Path(tmp) / f"hit{n:03d}"   # the loader tells the format by content
            try:
                name.write_bytes(read_image(items, r))
            except (DataError, OSError):
                pass   # the grid draws a missing file as an "unreadable" tile
            files.append(str(name))
        yield files


def image_file(items: dict[str, list], row: int) -> str:
    """A file holding row ``row``'s image: the row's own path, or (a shard row) a copy read from its shard by offset
    into a per-user temporary folder, named by the row's sha256, so readers that open files (``clip-mini serve``'s
    pictures and attention maps) work unchanged."""
    if "shard" not in items:
        return items["path"][row]
    import re
    import tempfile

    name = items["sha256"][row]
    if not re.fullmatch(r"[0-9a-f]{64}", name):   # it names the copy: an edited items file must not pick the path
        raise DataError(f"row {row}: sha256 {name[:80]!r} is not a hex digest")
    folder = Path(tempfile.gettempdir()) / f"clip-mini-shard-images-{os.getuid()}"
    out = folder / name
    if not out.is_file():
        folder.mkdir(mode=0o700, exist_ok=True)
        with atomic_path(out) as tmp:
            Path(tmp).write_bytes(read_image(items, row))
    return str(out)
