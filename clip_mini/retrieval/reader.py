"""IndexReader: one generation of an index directory, opened read-only, searched exactly or with faiss.

What index builds need to read an index (``build``, ``shards``) without importing the public
``EmbeddingIndex`` on top of them. The directory layout is described in ``clip_mini.retrieval.index``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from clip_mini.features.unit import unit_rows
from clip_mini.fileio.checksums import known_sha256
from clip_mini.retrieval.format import EmbeddingIndexError, open_items, read_manifest
from clip_mini.retrieval.rows import DTYPES, numpy_dtype, wrap

_OPEN_RETRIES = 5


class IndexReader:
    """One generation of an index directory, opened read-only (embeddings are memory-mapped).

    Build or update with ``EmbeddingIndex.build`` / ``add`` / ``merge``; open with ``EmbeddingIndex.load``;
    query with ``search`` (arrays of scores and row ids; ``paths[ids]`` names the files).
    """

    def __init__(self, path: Path, manifest: dict, embeddings: np.ndarray, items: dict):
        # items: {column: sequence}; lists for an index with an items CSV, lazily read columns for a columnar one
        self.path, self.manifest, self.embeddings, self.items = Path(path), manifest, embeddings, items
        self._faiss = None
        self._paths = None
        self.changes: Optional[dict[str, int]] = None   # set by the build that returned it: rows added, dropped

    @property
    def paths(self) -> np.ndarray:
        """Every row's path as an object array (``paths[ids]`` names search results); built on first use, which
        on a large index reads the whole path column: ``items["path"][i]`` reads one row."""
        if self._paths is None:
            self._paths = np.array(list(self.items["path"]), dtype=object)
        return self._paths

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, count={len(self)}, dim={self.dim}, model={self.fingerprint})"

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def fingerprint(self) -> str:
        return self.manifest["model_fingerprint"]

    # -- opening --------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> "IndexReader":
        """Open the current generation of an index directory.

        Args:
            path: index directory.
            verify: check the sha256 of every data file against the manifest (each file is hashed once while it
                is unchanged: ``clip_mini.fileio.checksums``).

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
    def _open(cls, path: Path, manifest: dict, verify: bool) -> "IndexReader":
        files = manifest["files"]
        if verify:
            for name in (files["embeddings"], files["items"]):
                if known_sha256(path / name) != manifest["checksums"][name]:   # hashed once while unchanged
                    raise EmbeddingIndexError(f"{path / name} is corrupt: its sha256 does not match manifest.json")
        emb_path = path / files["embeddings"]
        try:
            embeddings = np.load(emb_path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise
        except (ValueError, OSError) as e:
            raise EmbeddingIndexError(f"{emb_path} is corrupt: {e}") from None
        want = (int(manifest["count"]), int(manifest["dim"]))
        dtype = manifest.get("dtype", "float16")
        if dtype not in DTYPES:
            raise EmbeddingIndexError(f"{path / 'manifest.json'} says the rows are {dtype!r}; clip_mini reads "
                                      f"{', '.join(DTYPES)}")
        if embeddings.dtype != numpy_dtype(dtype) or embeddings.shape != want:
            raise EmbeddingIndexError(f"{emb_path} holds {embeddings.dtype} {embeddings.shape}, manifest.json says "
                                      f"{dtype} {want}")
        embeddings = wrap(embeddings)   # bfloat16 bits: a view that reads as float32
        items = open_items(path / files["items"], manifest, path)
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

    @property
    def flip_average(self) -> bool:
        """Whether the rows average each image with its mirror (``model.clip.ImageForward``); False for an index
        built before the option."""
        return bool(self.manifest.get("flip_average", False))

    def check_flip_average(self, flip_average: bool, what: str = "this build") -> None:
        """Refuse to mix rows made with and without flip averaging, as ``check_model`` refuses another model's."""
        if bool(flip_average) != self.flip_average:
            said = {True: "with", False: "without"}
            raise EmbeddingIndexError(
                f"index {self.path} was built {said[self.flip_average]} flip averaging, and {what} "
                f"{said[bool(flip_average)]} it: the rows would not be comparable; give the index's setting "
                f"({'--flip-average' if self.flip_average else 'no --flip-average'}), or build a new index to "
                "change it")

    # -- searching ------------------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int = 10, backend: str = "auto") -> tuple[np.ndarray, np.ndarray]:
        """Top-K rows by cosine similarity.

        Args:
            queries: (Q, dim) or (dim,) query features (text or image, same model); rows are L2-normalised here,
                so scores are cosines whatever the caller passes.
            k: results per query (clipped to the index size).
            backend: "exact", "faiss", or "auto" (faiss when a faiss index is stored and the index has at least
                ``search.FAISS_THRESHOLD`` rows, else exact).

        Returns:
            ``scores`` (Q, k) float32 best first and ``ids`` (Q, k) int64 rows (-1 where faiss found fewer).
        """
        from clip_mini.retrieval import search as S

        if backend not in ("auto", "exact", "faiss"):
            raise EmbeddingIndexError(f"unknown search backend {backend!r} (use auto, exact or faiss)")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise EmbeddingIndexError(f"k must be a positive integer, got {k!r}")
        queries = _unit_queries(queries, self.dim)
        has_file = "faiss" in self.manifest["files"]
        if backend == "auto":
            backend = "faiss" if has_file and len(self) >= S.FAISS_THRESHOLD and S.faiss_available() else "exact"
        try:
            if backend == "exact":
                return S.exact_search(self.embeddings, queries, k)
            pq = self.manifest.get("faiss_kind") == "ivfpq"   # PQ scores are coarse: re-rank from the rows
            return S.faiss_search(self.faiss_index(), queries, k, self.dim, rerank=self.embeddings if pq else None)
        except ValueError as e:
            raise EmbeddingIndexError(f"search in {self.path}: {e}") from None

    def faiss_index(self, kind: str = "hnsw"):
        """The stored faiss index (checksum-verified), or one built in memory over these rows if none is stored."""
        from clip_mini.retrieval import search as S

        if self._faiss is None:
            name = self.manifest["files"].get("faiss")
            if name is None:
                self._faiss = S.build_faiss(self.embeddings, kind)
            else:
                if known_sha256(self.path / name) != self.manifest["checksums"][name]:
                    raise EmbeddingIndexError(f"{self.path / name} is corrupt: its sha256 does not match manifest")
                self._faiss = S.load_faiss(self.path / name)
                from clip_mini.retrieval.faiss_auto import apply_params

                apply_params(self._faiss, self.manifest.get("faiss_kind"), self.manifest.get("faiss_params"))
        return self._faiss


def _unit_queries(queries, dim: int) -> np.ndarray:
    """Query rows scaled to unit length (a cosine above 1 is meaningless); a zero or non-finite row is refused."""
    q = np.asarray(queries, dtype=np.float32)
    if q.ndim not in (1, 2) or q.size == 0 or q.shape[-1] != dim:
        return q   # the back end names the expected shape
    norms = np.linalg.norm(q, axis=-1, keepdims=True)
    bad = ~np.isfinite(norms) | (norms == 0)
    if bad.any():
        row = int(np.flatnonzero(bad.reshape(-1))[0])
        raise EmbeddingIndexError(f"query row {row} is {'all zeros' if norms.reshape(-1)[row] == 0 else 'not finite'}:"
                                  " it has no direction to search for")
    return unit_rows(q)
