"""EmbeddingIndex: stored image embeddings plus their file table, searched exactly or with faiss.

Index directory (format version 1)::

    manifest.json           names the current generation's files; model fingerprint, dim, count, checksums
    embeddings-<gen>.npy    (count, dim) float16 (or bfloat16 bits as uint16: --dtype bfloat16, format version 3),
                            L2-normalised; row i belongs to items row i
    items-<gen>.cols        path, size, mtime_ns, sha256, caption (+ shard, key, offset, length for WebDataset
                            rows); sorted by path; columnar, read row by row (format version 4, ``items``;
                            versions 1-3 wrote items-<gen>.csv, still read)
    faiss-<gen>.index       optional approximate index over the same rows
    skipped.csv             images the last build could not embed, with the reason
    .work/                  embeddings of an unfinished build (what a resumed build reuses)
    .lock                   held by the one process allowed to write

Readers never see a mix of two generations: data files are never changed once written, a writer publishes a
generation by atomically replacing ``manifest.json``, and readers open exactly the files that manifest names.
The previous generation's files are kept, so a reader holding the old manifest can still open them; if a reader
is slower than two commits it finds a file gone, re-reads the manifest and tries again. The file format lives in
``format``, reading in ``reader``, building in ``build`` / ``shards``, the search back ends in ``search`` and
query embedding in ``engine`` (all in ``clip_mini.retrieval``).

    from clip_mini import EmbeddingIndex
    index = EmbeddingIndex.build("indexes/photos", "runs/tiny/best", "photos/")    # or .load("indexes/photos")
    index.search_text("a dog running on grass", k=5)          # [(path, score), ...]
    scores, ids = index.search(query_features, k=10)           # arrays, for any (Q, d) features
    scores, ids = index.search([("a dog", 1), ("grass", -1)])   # or weighted text and image terms (``terms``)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from clip_mini.retrieval.build import sync_index
from clip_mini.retrieval.cutoff import HitList, check_cutoff, resolve_cutoff, split_hits
from clip_mini.retrieval.engine import QueryEngine
from clip_mini.retrieval.filters import SearchFilter, merge as merge_filters, search as filtered_search
from clip_mini.retrieval.format import EmbeddingIndexError
from clip_mini.retrieval.reader import IndexReader
from clip_mini.retrieval.shards import merge_indexes
from clip_mini.features.terms import looks_like_terms

ImagesArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


class EmbeddingIndex(IndexReader):
    """An index directory: open with ``load``, build or update with ``build`` / ``add`` / ``merge``, query with
    ``search`` (arrays), ``search_text`` / ``search_image`` (ranked ``(path, score)``).
    """

    @classmethod
    def _wrap(cls, reader: IndexReader) -> "EmbeddingIndex":
        index = cls(reader.path, reader.manifest, reader.embeddings, reader.items)
        index.changes = reader.changes
        return index

    # -- convenience: queries by text or image, results as (path, score) -------------------------------------
    def search_text(self, text: str | Sequence[str], k: int = 10, model_dir: Optional[str | Path] = None,
                    backend: str = "auto", **filters) -> list:
        """Ranked ``(path, score)`` for a text query, or one such list per query for a list of queries.

        Queries are embedded by the index's model (torch-free, see ``engine``), loaded on the first call and
        kept on the index. ``under=``, ``glob=``, ``after=``, ``before=`` (or ``filters=``) restrict the results
        as ``search`` says.
        """
        single = isinstance(text, str)
        hits = self.hits(texts=[text] if single else list(text), k=k, model_dir=model_dir, backend=backend,
                         **filters)
        return [(h["path"], h["score"]) for h in hits[0]] if single else \
            [[(h["path"], h["score"]) for h in row] for row in hits]

    def search_image(self, image: Any, k: int = 10, model_dir: Optional[str | Path] = None, backend: str = "auto",
                     **filters) -> list:
        """Ranked ``(path, score)`` for an image query (a path, PIL image or array), or one list per image for a
        list of them; filters as ``search``."""
        single = not isinstance(image, (list, tuple))
        hits = self.hits(images=[image] if single else list(image), k=k, model_dir=model_dir, backend=backend,
                         **filters)
        return [(h["path"], h["score"]) for h in hits[0]] if single else \
            [[(h["path"], h["score"]) for h in row] for row in hits]

    def search(self, queries: Any, k: int = 10, backend: str = "auto", model_dir: Optional[str | Path] = None,
               device: str = "cpu", *, under: Any = None, glob: Optional[str] = None, after: Any = None,
               before: Any = None, filters: Optional[SearchFilter] = None):
        """Top-K rows for query feature rows (``IndexReader.search``), or for query terms: a caption, or a list of
        ``(caption or image, weight)`` pairs combined into one query (``terms``: a ``str`` is a caption, a
        ``pathlib.Path``, PIL image or array an image, a negative weight means "without"), embedded by the index's
        model (or ``model_dir``'s)::

            scores, ids = index.search([("a circle", 1.0), ("red", -1.0)], k=16)   # (1, k) each
            scores, ids = index.search("a dog", k=10, under="2024", glob="*.jpg", after="2024-06")

        Filters (``clip_mini.retrieval.filters``) keep only some rows, before the top-K: ``under`` a folder inside
        the index's folder (relative to it, or absolute), ``glob`` a pattern on the path relative to it (``*`` does
        not cross ``/``, ``**`` does; a pattern without ``/`` matches file names at any depth), ``after`` / ``before``
        a date (``"2024-06-30"``, ``"2024-06"``, ``"2024-06-30T18:30"``, a ``datetime.date``) compared with when each
        photo was taken (EXIF, else the file's mtime); or ``filters=SearchFilter.of(...)``. A filtered search is
        exact, and returns fewer than K results only when fewer rows pass.

        Returns:
            ``scores`` (Q, k) float32 best first and ``ids`` (Q, k) int64 rows; Q is 1 for terms.

        Raises:
            FilterError: a bad filter (a folder outside the index's, a date in no accepted format).
            DatesNotIndexedError: a date filter on an index built before dates were recorded (re-index it).
        """
        flt = merge_filters(filters, under, glob, after, before)
        if flt.active:
            flt.rows(self)   # a filter this index cannot apply fails before the model loads (the rows are cached)
        if looks_like_terms(queries):
            queries = self.engine(model_dir, device).encode_query(queries)[None]
        if flt.active:
            return filtered_search(self, queries, k, flt)
        return super().search(queries, k, backend)

    def hits(self, texts: Optional[Sequence[str]] = None, images: Optional[Sequence[Any]] = None, k: int = 10,
             model_dir: Optional[str | Path] = None, backend: str = "auto", device: str = "cpu",
             terms: Any = None, *, under: Any = None, glob: Optional[str] = None, after: Any = None,
             before: Any = None, filters: Optional[SearchFilter] = None, cutoff: Any = None,
             min_score: Optional[float] = None) -> list[HitList]:
        """One ranked list per query (texts, images or one query of ``terms``, exactly one of the three):
        ``{"rank", "score", "path", "caption", "row"}`` dicts, best first. What ``search_text`` / ``search_image``
        and ``clip-mini search`` return. Filters as ``search``: a list is shorter than ``k`` only when fewer rows
        pass.

        A cut-off (``clip_mini.retrieval.cutoff``, the one rule ``clip-mini search`` and ``clip-mini serve`` use):
        ``cutoff="auto"`` the model's own, calibrated on its val split when it was trained (none for a model
        without one): a list is empty unless its best hit reaches one cosine, and then holds the hits that reach
        another; ``min_score`` a cosine of your own that every hit must reach. Each list (a ``HitList``) counts
        the hits it dropped (``below``), keeps the best of them (``best_below``) and the cosines used
        (``min_score``, ``min_best``), so a caller can say "no good match" rather than print nothing.
        """
        if sum(x is not None for x in (texts, images, terms)) != 1:
            raise EmbeddingIndexError("hits needs texts, images or terms (exactly one)")
        flt = merge_filters(filters, under, glob, after, before)   # a bad filter fails before the model loads
        if flt.active:
            flt.rows(self)
        engine = self.engine(model_dir, device)
        if terms is not None:
            queries = engine.encode_query(terms)[None]
        else:
            queries = engine.encode_text(list(texts)) if texts is not None else engine.encode_image(list(images))
        check_cutoff(cutoff)   # a bad cut-off fails before the search
        if flt.active:
            scores, ids = filtered_search(self, queries, k, flt)
        else:
            scores, ids = super().search(queries, k, backend)
        rule = resolve_cutoff(cutoff, min_score, self._model_dir(model_dir))
        out = []
        for row_ids, row_scores in zip(ids, scores):
            found = [{"score": float(s), "path": self.items["path"][i], "caption": self.items["caption"][i],
                      "row": int(i)} for i, s in zip(row_ids, row_scores) if i >= 0]
            passes = split_hits([h["score"] for h in found], rule)
            kept = HitList({"rank": r + 1, **h} for r, h in enumerate(h for h, ok in zip(found, passes) if ok))
            kept.below = passes.count(False)
            kept.best_below = next((h for h, ok in zip(found, passes) if not ok), None)
            kept.min_score, kept.min_best = (None, None) if rule is None else (rule.hit, rule.best)
            out.append(kept)
        return out

    def engine(self, model_dir: Optional[str | Path] = None, device: str = "cpu") -> QueryEngine:
        """The query engine of ``model_dir`` (default: the index's model), loaded once and kept on the index.
        ``device`` is where an image query's tower runs (a text query runs torch-free)."""
        model_dir = self._model_dir(model_dir)
        engines = self.__dict__.setdefault("_engines", {})
        if (model_dir, device) not in engines:
            engine = QueryEngine.load(model_dir, device=device, flip_average=self.flip_average)
            engine.check_index(self)
            engines[(model_dir, device)] = engine
        return engines[(model_dir, device)]

    def _model_dir(self, model_dir: Optional[str | Path]) -> Path:
        if model_dir:
            from clip_mini.builtin.registry import is_builtin_name, resolve_model

            if is_builtin_name(model_dir):   # a built-in model's name: its directory in the user cache (torch-free)
                return resolve_model(model_dir)
            if not Path(model_dir).is_dir():
                raise EmbeddingIndexError(f"model directory {model_dir} not found")
            return Path(model_dir)
        model_dir = self.manifest.get("model_dir")
        if not model_dir:
            raise EmbeddingIndexError(f"index {self.path} does not record its model: pass a model directory "
                                      "(--model DIR)")
        if not Path(model_dir).is_dir():
            raise EmbeddingIndexError(f"model directory {model_dir} (used to build {self.path}) is gone: "
                                      "pass another model directory (--model DIR)")
        return Path(model_dir)

    # -- writing (see build and shards) ---------------------------------------------------------
    @classmethod
    def build(cls, path: str | Path, model, images: ImagesArg, captions: Optional[dict] = None,
              **kwargs) -> "EmbeddingIndex":
        """Make the index at ``path`` hold exactly ``images``: incremental and resumable.

        Args:
            path: index directory.
            model: a model directory, or an ``Embedder`` from ``clip_mini.load`` (its directory is recorded, so
                ``search_text`` and ``clip-mini search`` find the model later).
            images: a folder (searched recursively) or a list of image files.
            captions: optional ``{path: caption}`` stored with the rows.
            **kwargs: see ``build.sync_index`` (batch_size, workers, precision, faiss, shard, ...).
        """
        embedder, kwargs = _embedder(model, kwargs)
        return cls._wrap(sync_index(path, embedder, _image_list(images), captions=captions, prune=True, **kwargs))

    def add(self, model, images: ImagesArg, captions: Optional[dict] = None, **kwargs) -> "EmbeddingIndex":
        """Embed new or changed ``images`` and commit them beside the existing rows; returns the updated index."""
        embedder, kwargs = _embedder(model, kwargs)
        return self._wrap(sync_index(self.path, embedder, _image_list(images), captions=captions, prune=False,
                                      **kwargs))

    @classmethod
    def merge(cls, path: str | Path, sources: Optional[Sequence[str | Path]] = None, **kwargs) -> "EmbeddingIndex":
        """Merge shard indexes (default: all of ``path/shards/``) into ``path``; see ``shards.merge_indexes``."""
        return cls._wrap(merge_indexes(path, sources, **kwargs))


def _embedder(model, kwargs: dict):
    if isinstance(model, (str, os.PathLike)):
        from clip_mini.embed import load

        embedder = load(model, batch_size=kwargs.get("batch_size", 64))   # a built-in name: its cached directory
        return embedder, {"model_dir": embedder.model_dir, **kwargs}
    if getattr(model, "model_dir", None) is not None:   # a loaded Embedder knows where it came from
        kwargs = {"model_dir": model.model_dir, **kwargs}
    return model, kwargs


def _image_list(images: ImagesArg) -> list[str]:
    if isinstance(images, (str, os.PathLike)):
        from clip_mini.retrieval.files import scan_images

        found = scan_images(images)
        if not found:
            raise EmbeddingIndexError(f"no images found under {images} (looked for .jpg, .png, .webp, ...)")
        return found
    return [os.fspath(p) for p in images]
