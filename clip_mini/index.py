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
is slower than two commits it finds a file gone, re-reads the manifest and tries again. The file format lives in
``index_format``, building in ``index_build`` / ``index_shards``, the search back ends in ``search``.

    from clip_mini import EmbeddingIndex
    index = EmbeddingIndex.build("indexes/photos", "runs/tiny/best", "photos/")    # or .load("indexes/photos")
    index.search_text("a dog running on grass", k=5)          # [(path, score), ...]
    scores, ids = index.search(query_features, k=10)           # arrays, for any (Q, d) features
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from clip_mini.index_format import EmbeddingIndexError, read_items, read_manifest
from clip_mini.io import sha256_file

_OPEN_RETRIES = 5
ImagesArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


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
            what = ("is not an index (no manifest.json)" if path.is_dir()
                    else "is a file, not an index directory" if path.exists() else "does not exist")
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

    # -- convenience: queries by text or image, results as (path, score) -------------------------------------
    def search_text(self, text: str, k: int = 10, model_dir: Optional[str | Path] = None, backend: str = "auto"
                    ) -> list[tuple[str, float]]:
        """Ranked ``(path, score)`` for a text query, embedded by the index's model (torch-free, see ``query``)."""
        from clip_mini.query import NumpyTextEncoder

        encoder = NumpyTextEncoder.load(self._model_dir(model_dir))
        self.check_model(encoder.fingerprint, f"model {self._model_dir(model_dir)}")
        return self._hits(*self.search(encoder.encode_text([text]), k, backend))

    def search_image(self, image: Any, k: int = 10, model_dir: Optional[str | Path] = None, backend: str = "auto"
                     ) -> list[tuple[str, float]]:
        """Ranked ``(path, score)`` for an image query (a path, PIL image or array)."""
        import clip_mini

        embedder = clip_mini.load(self._model_dir(model_dir))
        self.check_model(embedder.fingerprint, f"model {self._model_dir(model_dir)}")
        return self._hits(*self.search(embedder.encode_image([image]), k, backend))

    def _model_dir(self, model_dir: Optional[str | Path]) -> Path:
        model_dir = model_dir or self.manifest.get("model_dir")
        if not model_dir:
            raise EmbeddingIndexError(f"index {self.path} does not record its model: pass model_dir")
        return Path(model_dir)

    def _hits(self, scores: np.ndarray, ids: np.ndarray) -> list[tuple[str, float]]:
        return [(self.items["path"][i], float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    # -- writing (see index_build and index_shards) ---------------------------------------------------------
    @classmethod
    def build(cls, path: str | Path, model, images: ImagesArg, captions: Optional[dict] = None,
              **kwargs) -> "EmbeddingIndex":
        """Make the index at ``path`` hold exactly ``images``: incremental and resumable.

        Args:
            path: index directory.
            model: a model directory, or an ``Embedder`` from ``clip_mini.load``.
            images: a folder (searched recursively) or a list of image files.
            captions: optional ``{path: caption}`` stored with the rows.
            **kwargs: see ``index_build.sync_index`` (batch_size, workers, precision, faiss, shard, ...).
        """
        from clip_mini.index_build import sync_index

        embedder, kwargs = _embedder(model, kwargs)
        return sync_index(path, embedder, _image_list(images), captions=captions, prune=True, **kwargs)

    def add(self, model, images: ImagesArg, captions: Optional[dict] = None, **kwargs) -> "EmbeddingIndex":
        """Embed new or changed ``images`` and commit them beside the existing rows; returns the updated index."""
        from clip_mini.index_build import sync_index

        embedder, kwargs = _embedder(model, kwargs)
        return sync_index(self.path, embedder, _image_list(images), captions=captions, prune=False, **kwargs)

    @classmethod
    def merge(cls, path: str | Path, sources: Optional[Sequence[str | Path]] = None, **kwargs) -> "EmbeddingIndex":
        """Merge shard indexes (default: all of ``path/shards/``) into ``path``; see ``index_shards.merge_indexes``."""
        from clip_mini.index_shards import merge_indexes

        return merge_indexes(path, sources, **kwargs)


def _embedder(model, kwargs: dict):
    if isinstance(model, (str, os.PathLike)):
        import clip_mini

        return clip_mini.load(model, batch_size=kwargs.get("batch_size", 64)), {"model_dir": str(model), **kwargs}
    return model, kwargs


def _image_list(images: ImagesArg) -> list[str]:
    if isinstance(images, (str, os.PathLike)):
        from clip_mini.image_files import scan_images

        found = scan_images(images)
        if not found:
            raise EmbeddingIndexError(f"no images found under {images} (looked for .jpg, .png, .webp, ...)")
        return found
    return [os.fspath(p) for p in images]
