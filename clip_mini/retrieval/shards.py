"""Sharded index builds: each process indexes the files of its shard, then the shards are merged into one index.

    clip-mini index --model M --images F --out IDX --shard 0/2     # on machine / process 0
    clip-mini index --model M --images F --out IDX --shard 1/2     # on machine / process 1
    clip-mini index --out IDX --merge                              # IDX/shards/*-of-2 -> IDX

A file's shard is ``crc32(path) % n`` (``format.in_shard``): stable as the folder grows, so each shard index stays incremental. Under
``torchrun`` the rank and world size pick the shard and rank 0 merges (see ``clip_mini.cli.main``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from clip_mini.retrieval.build import faiss_kind, write_embeddings
from clip_mini.retrieval.format import EmbeddingIndexError, commit, current_generation, writer_lock
from clip_mini.retrieval.reader import IndexReader
from clip_mini.retrieval.rows import storage_dtype
from clip_mini.retrieval.taken import TAKEN_COLUMNS


def merge_indexes(path: str | Path, sources: Optional[Sequence[str | Path]] = None, faiss: str = "auto",
                  progress: bool = True, dtype: Optional[str] = None) -> IndexReader:
    """Merge indexes of one model (default: every ``path/shards/i-of-n``) into ``path``, sorted by path.

    The merged rows are stored as ``dtype`` ("float16" or "bfloat16"; default: the first shard's).

    Raises:
        EmbeddingIndexError: no sources, a missing shard of n, different models (or flip averaging), or one path
            with two contents.
    """
    path = Path(path)
    if sources is None:
        sources = sorted((path / "shards").glob("*-of-*"), key=lambda p: int(p.name.split("-")[0]))
        counts = {int(p.name.split("-of-")[1]) for p in sources}
        if not sources or len(counts) != 1 or len(sources) != counts.pop():
            raise EmbeddingIndexError(f"{path / 'shards'}: need every shard i-of-n of one n to merge, found "
                                      f"{[p.name for p in sources]}")
    parts = [IndexReader.load(s) for s in sources]
    if not parts:
        raise EmbeddingIndexError("nothing to merge")
    for p in parts[1:]:
        p.check_model(parts[0].fingerprint, f"shard {p.path}")
        p.check_flip_average(parts[0].flip_average, f"shard {parts[0].path}")
    entries = sorted((p_path, k, r) for k, part in enumerate(parts) for r, p_path in enumerate(part.items["path"]))
    dated = all(c in part.items for part in parts for c in TAKEN_COLUMNS)   # else the merge records no dates
    rows: dict[str, list] = {c: [] for c in ("path", "size", "mtime_ns", "sha256", "caption",
                                             *(TAKEN_COLUMNS if dated else ()))}
    plan = []
    for p_path, k, r in entries:
        if rows["path"] and rows["path"][-1] == p_path:
            if rows["sha256"][-1] != parts[k].items["sha256"][r]:
                raise EmbeddingIndexError(f"{p_path} is in two shards with different contents")
            continue
        for c in rows:
            rows[c].append(parts[k].items[c][r])
        plan.append((k, r))
    with writer_lock(path):
        if (path / "manifest.json").is_file():
            target = IndexReader.load(path, verify=False)
            target.check_model(parts[0].fingerprint, "the shards' model")
            target.check_flip_average(parts[0].flip_average, "the merged shards")
        generation = current_generation(path) + 1
        write_embeddings(path / f"embeddings-{generation}.npy", [p.embeddings for p in parts], plan, parts[0].dim,
                         dtype or storage_dtype(parts[0].embeddings))
        m0 = parts[0].manifest
        meta = {"model_fingerprint": m0["model_fingerprint"], "model_dir": m0.get("model_dir"),
                "source": m0.get("source"), "shard": None, "flip_average": parts[0].flip_average}
        kind = faiss_kind(faiss, None, len(plan), parts[0].dim)
        commit(path, generation, rows, meta, kind, progress)
    return IndexReader.load(path, verify=False)
