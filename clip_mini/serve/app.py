"""The FastAPI application: search API, pictures by row id, the search page.

    GET  /api/search?q=TEXT&without=TEXT&k=K   text -> images; ``without`` (repeatable): terms to search away from
    POST /api/search/image?k=K&without=TEXT    image -> images (multipart field ``file``, or JSON ``{"image": base64}``)
         both also take the search filters ``under`` (a folder relative to the index's image folder), ``glob``,
         ``after``, ``before`` (``clip_mini.retrieval.filters``; JSON uploads may carry them as fields too): the
         top-k of the images that pass, exact
    GET  /thumb/ID?gen=G             JPEG thumbnail of row ID of generation G (default: the current one)
    GET  /image/ID?gen=G             the original file of that row
    GET  /api/attention/ID?gen=G     PNG of the ViT's CLS attention over that image
    GET  /api/explain/ID?q=TEXT&gen=G   "why this match": PNG of that image at its thumbnail's size with the match
                                     map of the caption TEXT over it (``Embedder.explain``, drawn as ``clip-mini
                                     search --explain`` draws a hit); cached in memory
    GET  /healthz, /api/info         liveness; model fingerprint, index size, generation, back end, towers
    GET  /                           the search page (``static/``: one HTML, one JS, one CSS file, nothing remote)
    GET  /login, POST /login         the page's login form, when the server has a token (``guards.TokenAuth``)

Files are reachable only through a row id of the loaded index, and only when they lie under its image root
(``Generation.image_file``): no parameter is ever used as a path, and paths in answers are relative to that root.
Every error is JSON ``{"error": message}`` with a 4xx status (503 when the image pool is full); the model, both
query towers and the index are loaded in ``Service``, the torch model (attention and match maps) in the background
once the app starts. Text queries, image queries and match maps run on separate threads (``admission``), so uploads
and maps never hold up text search.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from clip_mini.data.images import ImageError
from clip_mini.errors import FilterError, InputError
from clip_mini.retrieval.engine import QueryEngine
from clip_mini.retrieval.format import EmbeddingIndexError
from clip_mini.features.terms import QueryError, Term, parse_term, single_caption
from clip_mini.retrieval.cutoff import Cutoff, resolve_cutoff, split_hits
from clip_mini.retrieval.filters import SearchFilter
from clip_mini.retrieval import search as S
from clip_mini.serve.admission import BoundedPool, Busy
from clip_mini.serve.batching import SearchBatcher
from clip_mini.serve.generations import FLOAT32_MAX_ROWS, Generation, IndexWatcher, NotServed, uses_faiss
from clip_mini.serve.guards import SESSION_COOKIE, HostCheck, SecurityHeaders, TokenAuth, session_value, \
    token_matches
from clip_mini.serve.limits import BodyTooLarge, LimitBody
from clip_mini.serve.pictures import (UPLOAD_MAX_PIXELS, MapRenderer, PictureCache, decode_upload, file_version,
                                      original, thumbnail_jpeg)

log = logging.getLogger("clip_mini.serve")

STATIC = Path(__file__).parent / "static"
MAX_WITHOUT = 8   # "without" terms a request may hold: each is a text-tower pass
FILTER_FIELDS = ("under", "glob", "after", "before")   # search filters a request may carry
# The page may load only what this server serves: proof that nothing comes from a CDN, and no injected script runs.
PAGE_CSP = "default-src 'self'; img-src 'self' blob: data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"


@dataclass
class ServeConfig:
    """What ``create_app`` serves and its limits on requests."""

    index: str
    model: Optional[str] = None             # default: the model directory the index records
    poll_s: float = 1.0                     # seconds between checks for a new index generation
    verify: bool = True                     # sha256 of index files on every (re)load
    max_query_chars: int = 1000             # captions are truncated to a few dozen tokens anyway
    max_k: int = 100
    max_upload_bytes: int = 10 << 20        # the image itself; a base64 JSON body may be 4/3 of this
    max_upload_pixels: int = UPLOAD_MAX_PIXELS
    float32_cache_bytes: int = 2 << 30      # float32 copy of the rows for exact search up to this size ...
    float32_max_rows: int = FLOAT32_MAX_ROWS   # ... and fewer rows than this (more: the shared memory map)
    device: str = "auto"                    # the torch model (attention maps); queries run in onnxruntime on the CPU
    encode_threads: int = 2                 # threads embedding text queries (onnxruntime releases the GIL)
    image_threads: int = 1                  # threads decoding and embedding image queries: one core at most
    image_queue: int = 4                    # image queries admitted at once (running or waiting); more get 503
    explain_threads: int = 1                # threads drawing match maps (a forward and a backward pass each)
    explain_queue: int = 32                 # match maps admitted at once (running or waiting); more get 503
    explain_cache_bytes: int = 64 << 20     # match-map PNGs kept in memory (least recently used out first)
    allowed_hosts: list[str] = field(default_factory=lambda: ["*"])
    token: Optional[str] = None             # when set, every route but /healthz and /login needs it
    preload_attention: bool = True          # load the torch model (attention, match maps) in the background at start


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


_UNREAD = object()


class Upload(NamedTuple):
    """An image query as received: the image bytes (multipart), or the raw JSON body still to be parsed."""

    data: bytes
    name: str
    k: int
    is_json: bool = False
    without: tuple = ()     # "without" terms: as received, then parsed (``Service.query_terms``)
    where: tuple = ()       # search filters from the query string: (name, value) pairs (``Service.where``)


class Service:
    """The loaded model and index, and the operations behind the routes (plain methods: testable without HTTP)."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        index_dir = Path(cfg.index)
        # A bad index or model fails here, before the server binds, with the library's own message.
        from clip_mini.retrieval.format import read_manifest

        manifest = read_manifest(index_dir)
        model_dir = cfg.model or manifest.get("model_dir")
        if not model_dir:
            raise EmbeddingIndexError(f"index {index_dir} does not record its model: pass --model DIR")
        self.model_dir = str(model_dir)
        # image queries made as the index's rows were (an index from before the option has no key: plain)
        self.engine = QueryEngine.load(self.model_dir, flip_average=bool(manifest.get("flip_average", False)))
        # Both towers load and checksum now, not on the first query of each kind.
        self.engine.encode_text(["warm up"])
        self.engine.encode_image([np.zeros((8, 8, 3), np.uint8)])
        self.image_size = self.engine.image_input_size()
        # A model that squashes the whole image to a square lets an upload shrink along each axis on its own.
        self.keep_aspect = self.engine._image_encoder().preprocess.get("resize_mode", "squash") != "squash"
        self.watcher = IndexWatcher(index_dir, self.engine.fingerprint, cfg.poll_s, cfg.verify,
                                    cfg.float32_cache_bytes, cfg.float32_max_rows, self.engine.flip_average)
        self.batcher = SearchBatcher(lambda: self.watcher.current, self._search_generation)
        self._text_pool = ThreadPoolExecutor(cfg.encode_threads, thread_name_prefix="clip-mini-text")
        self.image_pool = BoundedPool(cfg.image_threads, cfg.image_queue, "image")
        self.maps = MapRenderer(self.model_dir, cfg.device)
        self.explain_pool = BoundedPool(cfg.explain_threads, cfg.explain_queue, "explain")
        self.explain_cache = PictureCache(cfg.explain_cache_bytes)
        self._explaining: dict[tuple, asyncio.Future] = {}   # maps being drawn, by cache key (event loop only)
        self._refused: set[str] = set()   # files already logged as not served
        self._auto_cutoff = _UNREAD   # the model's calibrated cut-off (``min_score``)

    # -- search ---------------------------------------------------------------------------------------------
    def check_k(self, k: int) -> int:
        if not 1 <= k <= self.cfg.max_k:
            # a 5,000-digit k is not even printable (Python refuses str() of ints over 4,300 digits)
            shown = k if abs(k) < 10 ** 12 else f"a number of about {int(abs(k).bit_length() * 0.30103)} digits"
            raise ApiError(400, f"k must be between 1 and {self.cfg.max_k}, got {shown}")
        return k

    def query_terms(self, q: Optional[str], without: Sequence[str] = ()) -> list[Term]:
        """A request's text terms: ``q`` (weighted as on the command line: "2:a dog") and each non-blank ``without``
        term, negated; parsed by the command line's parser, but never as a path to read."""
        without = [t for t in without if t.strip()]
        if len(without) > MAX_WITHOUT:
            raise ApiError(400, f"{len(without)} 'without' terms; the limit is {MAX_WITHOUT}")
        for text in [q or "", *without]:
            if len(text) > self.cfg.max_query_chars:
                raise ApiError(400, f"the query term {text[:40]!r}... is {len(text)} characters long; the limit is "
                                    f"{self.cfg.max_query_chars}")
        signed = ([(q, 1.0)] if q else []) + [(t, -1.0) for t in without]
        try:
            return [parse_term(t, sign, paths=False) for t, sign in signed]
        except QueryError as e:
            raise ApiError(400, str(e)) from None

    def where(self, under: Optional[str] = None, glob: Optional[str] = None, after: Optional[str] = None,
              before: Optional[str] = None) -> Optional[SearchFilter]:
        """A request's search filters (None when it has none), checked against the index now: a bad date, a folder
        outside the index's or an index without dates is a 400 before any query is embedded. ``under`` is relative
        to the index's image folder (an absolute path would name the server's disk); messages name no server
        path."""
        gen = self.watcher.current
        try:
            for name, value in (("under", under), ("glob", glob), ("after", after), ("before", before)):
                if value is not None and not isinstance(value, str):
                    raise ApiError(400, f"{name} must be a string, got {type(value).__name__}")
                if value is not None and len(value) > self.cfg.max_query_chars:
                    raise ApiError(400, f"{name} is {len(value)} characters long; the limit is "
                                        f"{self.cfg.max_query_chars}")
            if under and (under.startswith(("/", "\\", "~")) or Path(under).is_absolute()):
                raise ApiError(400, f"under {under!r}: give a folder relative to the index's image folder "
                                    "(e.g. 2024/trip), as result paths are")
            flt = SearchFilter.of(under=under, glob=glob, after=after, before=before)
            if not flt.active:
                return None
            flt.rows(gen.index)   # cached: the search itself finds them again for free
            return flt
        except FilterError as e:
            raise ApiError(400, _public(str(e), gen)) from None

    def _search_generation(self, gen: Generation, queries: np.ndarray, k: int,
                           where: Optional[SearchFilter] = None) -> tuple[np.ndarray, np.ndarray]:
        try:
            return gen.search(queries, k, where)
        except FilterError as e:   # a generation loaded after the request was checked
            raise ApiError(400, _public(str(e), gen)) from None

    async def search_text(self, q: Optional[str], k: int, without: Sequence[str] = (),
                          where: Optional[SearchFilter] = None, floor: Optional[Cutoff] = None) -> dict:
        if q is None or not q.strip():
            raise ApiError(400, "the query q is empty: type some words describing the image")
        terms = self.query_terms(q, without)
        self.check_k(k)
        start = time.perf_counter()
        # A fixed pool of encoder threads, not one thread per waiting request (anyio's pool has 40): more threads
        # than cores only contend for them and for the GIL. The batcher is told a query is coming: a batch that
        # starts meanwhile may wait a moment for it (``SearchBatcher.expect``).
        self.batcher.expect()
        try:
            features = await asyncio.get_running_loop().run_in_executor(self._text_pool, self._encode_terms, terms)
        except BaseException:
            self.batcher.expect(-1)
            raise
        head = {"query": q, **({"without": [str(t) for t in terms[1:]]} if len(terms) > 1 else {}),
                "explainable": single_caption(terms) is not None}   # /api/explain draws maps for this query
        return await self._results(features, k, start, head, where, floor, expected=True)

    async def search_image(self, upload: Upload, floor: Optional[Cutoff] = None) -> dict:
        """Parse, decode and embed an upload on the image pool (503 when it is full), then search."""
        if not upload.is_json:
            self.check_k(upload.k)
        where = self.where(**dict(upload.where))
        upload = upload._replace(without=tuple(self.query_terms(None, upload.without)))
        start = time.perf_counter()
        try:
            features, k, name, fields = await self.image_pool.run(self._encode_upload, upload)
        except Busy as e:
            raise ApiError(503, str(e), {"Retry-After": str(e.retry_after)}) from None
        if fields:   # a JSON body's filter fields (which win over the query string's)
            where = self.where(**{**dict(upload.where), **fields})
        return await self._results(features, k, start, {"query": None, "image": name, "explainable": False,
                                                        **({"without": [str(t) for t in upload.without]}
                                                           if upload.without else {})}, where, floor)

    def _encode_upload(self, upload: Upload) -> tuple[np.ndarray, int, str, dict]:
        data, name, k, fields = _parse_json_upload(upload.data, upload.k) if upload.is_json else (*upload[:3], {})
        self.check_k(k)
        if fields:
            self.where(**{**dict(upload.where), **fields})   # a bad filter fails before the image is decoded
        if len(data) > self.cfg.max_upload_bytes:
            raise ApiError(413, f"the image is {len(data)} bytes; the limit is {self.cfg.max_upload_bytes}")
        return self._encode_image(data, name, upload.without), k, name, fields

    def _encode_terms(self, terms: list[Term]) -> np.ndarray:
        try:
            return self.engine.encode_query(terms)[None]
        except InputError as e:
            raise ApiError(400, str(e)) from None

    def _encode_image(self, data: bytes, name: str, without: Sequence[Term] = ()) -> np.ndarray:
        try:
            pixels = decode_upload(data, name, min_size=self.image_size, max_pixels=self.cfg.max_upload_pixels,
                                   keep_aspect=self.keep_aspect)
            return self.engine.encode_query([Term(pixels, 1.0, True), *without])[None]
        except ImageError as e:
            status = 413 if "pixels" in e.reason else 415 if e.reason.startswith("not an image") else 422
            raise ApiError(status, str(e)) from None
        except QueryError as e:   # the terms cancel out
            raise ApiError(400, str(e)) from None
        except InputError as e:
            raise ApiError(422, str(e)) from None
        except MemoryError:   # the limits should prevent it; if not, this upload fails and the server goes on
            raise ApiError(413, f"{name}: decoding this image needs more memory than the server has free; send a "
                                f"smaller image") from None

    def min_score(self, cutoff: Optional[str], min_score: Optional[float]) -> Optional[Cutoff]:
        """The rule hits must pass (``clip_mini.retrieval.cutoff``, the one ``clip-mini search`` uses):
        ``min_score`` for every hit, else the model's calibrated cut-off with ``cutoff=auto`` (the default), none
        with ``cutoff=none``."""
        if min_score is not None and not np.isfinite(min_score):
            raise ApiError(400, f"min_score {min_score!r} is not a finite number")
        # the model's own rule: read once, as the model is (read per request, its config took ~0.7 ms of the event
        # loop's time a search with 8 clients over 1M rows)
        if min_score is None and cutoff in (None, "auto"):
            if getattr(self, "_auto_cutoff", _UNREAD) is _UNREAD:
                self._auto_cutoff = resolve_cutoff("auto", None, self.model_dir)
            return self._auto_cutoff
        try:
            return resolve_cutoff("auto" if cutoff is None else cutoff, min_score, self.model_dir)
        except QueryError as e:
            raise ApiError(400, str(e)) from None

    async def _results(self, features: np.ndarray, k: int, start: float, head: dict,
                       where: Optional[SearchFilter] = None, floor: Optional[Cutoff] = None,
                       expected: bool = False) -> dict:
        # One generation for the whole answer: ids, paths and scores agree (the batcher searched that one).
        gen, scores, ids = await asyncio.wrap_future(self.batcher.submit(features, k, where, expected))
        if where is not None:
            head = {**head, "filters": where.describe(), "passing": len(where.rows(gen.index))}
        index = gen.index
        found = [(int(i), float(s)) for i, s in zip(ids, scores) if i >= 0]
        passes = split_hits([s for _, s in found], floor)
        passing = [f for f, ok in zip(found, passes) if ok]
        below = [s for (_, s), ok in zip(found, passes) if not ok]
        head = {**head, "min_score": None if floor is None else floor.hit,
                "min_best": None if floor is None else floor.best, "below": len(below),
                **({"best_below": round(below[0], 6)} if below else {})}
        results = []
        for rank, (i, s) in enumerate(passing, 1):
            hit = {"rank": rank, "id": i, "path": gen.shown_path(i), "score": round(s, 6)}
            if index.items["caption"][i]:
                hit["caption"] = index.items["caption"][i]
            links = f"{i}?gen={gen.number}"
            hit.update(thumb=f"/thumb/{links}", image=f"/image/{links}", attention=f"/api/attention/{links}")
            results.append(hit)
        return {**head, "k": k, "results": results, "generation": gen.number,
                "took_ms": round(1000 * (time.perf_counter() - start), 3)}

    # -- pictures by row id ---------------------------------------------------------------------------------
    def row_path(self, row: int, gen: Optional[int]) -> str:
        return self._row(row, gen)[1]

    def _row(self, row: int, gen: Optional[int]) -> tuple[Generation, str]:
        """The generation a row id belongs to (``gen``, or the current one) and its image file."""
        generation: Optional[Generation] = self.watcher.generation(gen)
        if generation is None:
            raise ApiError(410, f"index generation {gen} is not loaded (this server keeps the last two; now serving "
                                f"{self.watcher.current.number}): search again")
        n = len(generation.index)
        if not 0 <= row < n:
            raise ApiError(404, f"no image with id {row} in generation {generation.number} (ids are 0..{n - 1})")
        try:
            return generation, generation.image_file(row)
        except NotServed as e:   # the reason names server paths: the log gets it, the client does not
            if str(e) not in self._refused and len(self._refused) < 10_000:
                self._refused.add(str(e))
                log.warning("not serving image %d of generation %d: %s", row, generation.number, e)
            raise ApiError(404, f"image {row} is not available") from None

    def picture(self, kind: str, row: int, gen: Optional[int]) -> Response:
        path = self.row_path(row, gen)
        try:
            if kind == "thumb":
                return Response(thumbnail_jpeg(path), media_type="image/jpeg", headers=_CACHE)
            if kind == "image":
                data, media_type = original(path)
                return Response(data, media_type=media_type, headers=_CACHE)
            reason = self.maps.unavailable()
            if reason:
                raise ApiError(409, reason)
            return Response(self.maps.png(path), media_type="image/png", headers=_CACHE)
        except ImageError as e:   # the file changed or vanished since it was indexed
            raise ApiError(404, f"image {row} cannot be read now: {e.reason}") from None

    # -- "why this match" -----------------------------------------------------------------------------------
    def explain_text(self, q: Optional[str]) -> str:
        """The caption a match map is drawn for: ``q`` as one text term of weight 1, the queries ``clip-mini search
        --explain`` explains (``single_caption``); empty, too long or weighted is a 400 before any work."""
        if q is None or not q.strip():
            raise ApiError(400, "the query q is empty: a match map shows where a caption matches an image; give "
                                "one (q=a red car)")
        caption = single_caption(self.query_terms(q))   # the search's length limit and term syntax
        if caption is None:
            raise ApiError(400, f"q={q[:40]!r} is weighted: a match map shows where one caption matches, as "
                                "`clip-mini search --explain` does; give the words alone")
        return caption

    async def explain(self, row: int, q: Optional[str], gen: Optional[int]) -> Response:
        """PNG of row ``row``'s image with the match map of ``q`` over it, from the cache when it was drawn before
        (keyed by generation, row, caption, model and the file's version); concurrent requests for one picture
        share one drawing. Drawn on the explain pool (503 when it is full)."""
        text = self.explain_text(q)
        generation, path = self._row(row, gen)
        try:
            version = file_version(path)
        except OSError as e:
            raise ApiError(404, f"image {row} cannot be read now: {e.strerror or e}") from None
        key = (generation.number, row, text, self.engine.fingerprint, version)
        png = self.explain_cache.get(key)
        if png is None:
            drawing = self._explaining.get(key)
            if drawing is None:
                drawing = self._explaining[key] = asyncio.ensure_future(self._draw_explained(key, row, path, text))
                drawing.add_done_callback(lambda done: (self._explaining.pop(key, None),
                                                        done.cancelled() or done.exception()))
            png = await asyncio.shield(drawing)   # a client that leaves does not cancel the others' drawing
        return Response(png, media_type="image/png", headers=_CACHE)

    async def _draw_explained(self, key: tuple, row: int, path: str, text: str) -> bytes:
        try:
            png = await self.explain_pool.run(self._explained_png, row, path, text)
        except Busy as e:
            raise ApiError(503, str(e), {"Retry-After": str(e.retry_after)}) from None
        self.explain_cache.put(key, png)
        return png

    def _explained_png(self, row: int, path: str, text: str) -> bytes:
        reason = self.maps.explain_unavailable()   # loads the torch model on first use
        if reason:
            raise ApiError(501, f"this server cannot draw match maps: {reason}")
        try:
            return self.maps.explain_png(path, text)
        except ImageError as e:   # the file changed or vanished since it was indexed
            raise ApiError(404, f"image {row} cannot be read now: {e.reason}") from None
        except InputError as e:
            raise ApiError(400, str(e)) from None

    def info(self) -> dict:
        """What is served and how, naming no absolute path (directories by name only)."""
        gen = self.watcher.current
        reload_error = self.watcher.reload_error
        if reload_error:
            reload_error = reload_error.replace(str(Path(self.cfg.index).resolve()), Path(self.cfg.index).name)
        return {"model": Path(self.model_dir).name, "model_fingerprint": self.engine.fingerprint,
                "index": Path(self.cfg.index).resolve().name, "index_size": len(gen.index), "dim": gen.index.dim,
                "generation": gen.number, "loaded_at": gen.loaded_at, "index_open_s": round(gen.open_s, 3),
                "reload_error": reload_error,
                "towers": {"text": "loaded", "image": "loaded", "attention": self.maps.state},
                "backend": {"query_encoder": self.engine.runtime(), "attention": "torch",
                            "search": "faiss" if uses_faiss(gen.index) else "exact",
                            "float32_rows_in_memory": gen.rows32 is not None,
                            "float32_rows_bytes": 0 if gen.rows32 is None else int(gen.rows32.nbytes),
                            "batches": self.batcher.batches, "batched_queries": self.batcher.queries,
                            "batch_wait_s": round(self.batcher.waited_s, 3),
                            "exact_kernels": dict(S.searches),   # exact searches per kernel (this process)
                            "image_queries_in_flight": self.image_pool.admitted,
                            "image_queries_refused": self.image_pool.refused,
                            "match_maps_in_flight": self.explain_pool.admitted,
                            "match_maps_refused": self.explain_pool.refused,
                            "match_map_cache": self.explain_cache.stats()},
                "limits": {"max_k": self.cfg.max_k, "max_query_chars": self.cfg.max_query_chars,
                           "max_upload_bytes": self.cfg.max_upload_bytes,
                           "max_upload_pixels": self.cfg.max_upload_pixels,
                           "image_threads": self.cfg.image_threads, "image_queue": self.cfg.image_queue,
                           "explain_threads": self.cfg.explain_threads, "explain_queue": self.cfg.explain_queue,
                           "explain_cache_bytes": self.cfg.explain_cache_bytes},
                "auth": "token" if self.cfg.token else "none"}


def _public(message: str, gen: Generation) -> str:
    """A filter's error message without the server's paths: the image folder and the index directory unnamed."""
    for path, word in ((gen.root, ""), (gen.real_root, ""), (str(gen.index.path.resolve()), gen.index.path.name),
                       (str(gen.index.path), gen.index.path.name)):
        if path and path != "/":
            message = message.replace(f" {path}", f" {word}" if word else "")
    return message


# Cache: safe, a (row, generation) pair never changes meaning. CORP: a page of another site cannot load the indexed
# pictures as an <img> (a server on 127.0.0.1 without a token would otherwise hand them to any page the user opens).
_CACHE = {"Cache-Control": "private, max-age=3600", "Cross-Origin-Resource-Policy": "same-origin"}


# -- the app ----------------------------------------------------------------------------------------------------
def create_app(cfg: ServeConfig, service: Optional[Service] = None) -> FastAPI:
    """Load the model and index (or use ``service``) and build the app; the watcher polls while the app runs."""
    from contextlib import asynccontextmanager

    svc = service or Service(cfg)

    @asynccontextmanager
    async def lifespan(app):
        svc.watcher.start()
        if cfg.preload_attention:
            svc.maps.load_in_background()
        try:
            yield
        finally:
            svc.watcher.stop()

    app = FastAPI(title="clip-mini", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = svc
    # Base64 JSON is 4/3 of the image; multipart adds a few headers. Added last = runs first: the headers wrap every
    # answer, then the Host check, the token, and only then is a body read.
    app.add_middleware(LimitBody, max_bytes=cfg.max_upload_bytes * 4 // 3 + (64 << 10))
    if cfg.token:
        app.add_middleware(TokenAuth, token=cfg.token)
    app.add_middleware(HostCheck, allowed=cfg.allowed_hosts)
    app.add_middleware(SecurityHeaders)
    _error_handlers(app)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    get = lambda path: app.api_route(path, methods=["GET", "HEAD"])   # noqa: E731 (FastAPI adds no HEAD itself)

    @get("/")
    def page():
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_CSP})

    @get("/login")
    def login_form():
        if not cfg.token:
            return RedirectResponse("/", status_code=303)
        return FileResponse(STATIC / "login.html", headers={"Content-Security-Policy": PAGE_CSP})

    @app.post("/login")
    async def login(request: Request):
        if not cfg.token:
            return RedirectResponse("/", status_code=303)
        form = await request.form(max_files=0, max_fields=4)
        given = form.get("token")
        if not isinstance(given, str) or not token_matches(given, cfg.token):
            page = (STATIC / "login.html").read_text(encoding="utf-8")
            page = page.replace('class="error" hidden>', 'class="error">')   # shows "not the server's token"
            return HTMLResponse(page, status_code=401, headers={"Content-Security-Policy": PAGE_CSP})
        answer = RedirectResponse("/", status_code=303)
        answer.set_cookie(SESSION_COOKIE, session_value(cfg.token), httponly=True, samesite="strict", path="/")
        return answer

    @get("/healthz")
    def healthz():
        return {"ok": True, "generation": svc.watcher.current.number}

    @get("/api/info")
    def info():
        return svc.info()

    @get("/api/search")
    async def search(q: Optional[str] = None, k: int = 10, without: list[str] = Query([]),
                     under: Optional[str] = None, glob: Optional[str] = None, after: Optional[str] = None,
                     before: Optional[str] = None, cutoff: Optional[str] = None, min_score: Optional[float] = None):
        where, floor = svc.where(under, glob, after, before), svc.min_score(cutoff, min_score)
        return JSONResponse(await svc.search_text(q, k, without, where, floor))   # plain JSON: no response model

    @app.post("/api/search/image")
    async def search_image(request: Request, k: int = 10, without: list[str] = Query([]),
                           under: Optional[str] = None, glob: Optional[str] = None, after: Optional[str] = None,
                           before: Optional[str] = None, cutoff: Optional[str] = None,
                           min_score: Optional[float] = None):
        where = tuple((n, v) for n, v in (("under", under), ("glob", glob), ("after", after), ("before", before))
                      if v is not None)
        floor = svc.min_score(cutoff, min_score)
        upload = (await _read_upload(request, k))._replace(without=tuple(without), where=where)
        return JSONResponse(await svc.search_image(upload, floor))

    @get("/thumb/{row}")
    def thumb(row: int, gen: Optional[int] = None):
        return svc.picture("thumb", row, gen)

    @get("/image/{row}")
    def image(row: int, gen: Optional[int] = None):
        return svc.picture("image", row, gen)

    @get("/api/attention/{row}")
    def attention(row: int, gen: Optional[int] = None):
        return svc.picture("attention", row, gen)

    @get("/api/explain/{row}")
    async def explain(row: int, q: Optional[str] = None, gen: Optional[int] = None):
        return await svc.explain(row, q, gen)

    return app


async def _read_upload(request: Request, k: int) -> Upload:
    """The image of a multipart (field ``file``) request, or a JSON body (``{"image": base64, "k": K}``) left
    for the image pool to parse (``_parse_json_upload``): base64 of a large image is not decoded on the event loop.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=8)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "multipart upload needs a file field named 'file'")
        return Upload(await upload.read(), upload.filename or "upload", k)
    if ctype == "application/json":
        return Upload(await request.body(), "upload", k, is_json=True)
    raise ApiError(415, f"send the image as multipart/form-data (field 'file') or application/json, not "
                        f"{ctype or 'no content type'}")


def _parse_json_upload(raw: bytes, k: int) -> tuple[bytes, str, int, dict]:
    """The image bytes, name, k and search filters of a JSON upload ``{"image": base64 or a data URL, "k": K,
    "name": N, "under": ..., "glob": ..., "after": ..., "before": ...}`` (filters as given; checked by the caller)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply: send {\"image\": \"<base64 image>\", \"k\": K}") \
            from None
    except ValueError:   # Python reads no integer of over 4,300 digits (a guard against quadratic-time parsing)
        raise ApiError(400, "request body holds a number of over 4,300 digits (k must be a small integer)") from None
    if not isinstance(body, dict) or not isinstance(body.get("image"), str):
        raise ApiError(400, 'JSON body must be {"image": "<base64 image>", "k": K}')
    text = body["image"]
    if text.startswith("data:"):   # a data URL as FileReader.readAsDataURL gives it
        text = text.partition(",")[2]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"image is not valid base64: {e}") from None
    k = body.get("k", k)
    if isinstance(k, bool) or not isinstance(k, int):
        raise ApiError(400, f"k must be an integer, got {k!r}")
    fields = {f: body[f] for f in FILTER_FIELDS if body.get(f) is not None}
    return data, str(body.get("name") or "upload")[:200], k, fields


def _error_handlers(app: FastAPI) -> None:
    def error(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error(e.status, e.message, e.headers)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request, e: BodyTooLarge):
        return error(413, str(e))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request, e: ClientDisconnect):
        # Nobody is listening for the answer; one line instead of the traceback Starlette would log.
        log.info("client %s left before sending all of %s %s", request.client.host if request.client else "?",
                 request.method, request.url.path)
        return Response(status_code=400)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request, e: RequestValidationError):
        parts = [f"{'.'.join(str(x) for x in err.get('loc', ())[1:]) or 'request'}: {err.get('msg')}"
                 for err in e.errors()]
        return error(400, "; ".join(parts))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error(e.status_code, str(e.detail))

    @app.exception_handler(EmbeddingIndexError)
    async def index_error(request, e: EmbeddingIndexError):
        return error(400, str(e))

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):
        # A bug, still answered as JSON like every other error; Starlette logs the traceback.
        return error(500, f"internal error ({type(e).__name__}); the server log has the details")
