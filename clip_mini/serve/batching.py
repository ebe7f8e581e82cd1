"""Concurrent queries searched as one batch: one pass over the rows answers every query waiting for it.

Exact search costs about the same for 1 query as for 32 (it is bound by reading and converting the stored rows,
``benchmarks/results/speed/search.json``), so a server answering requests one by one spends almost all its time
re-reading the same matrix. ``SearchBatcher`` runs searches in one thread: it takes every query queued while the
previous batch ran, searches them together against one generation, and hands each request its own rows. Top-k for a
smaller k is the prefix of the batch's top-k (results are sorted best first, ties by row id).

A lone query is never delayed. But requests whose queries are still being embedded when a batch starts (announced
with ``expect``), or still on their way in, would otherwise make the next batch: under steady load the clients
split into groups that take turns, each waiting for the others' passes as well as its own. So a batch waits for
queries announced and not yet queued, and for as many queries as the last batch had, for at most ``WAIT_SHARE`` of
the last search's time (``MAX_WAIT_S`` at most): one pass instead of two (``benchmarks/speed/bench_serve.py --arm
1m``: 8 clients over 1M rows).
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import numpy as np

from clip_mini.retrieval.filters import SearchFilter
from clip_mini.serve.generations import Generation

MAX_BATCH = 64
WAIT_SHARE = 0.5    # a batch waits for announced queries up to this share of the last search's time ...
MAX_WAIT_S = 0.02   # ... and never longer than this


class SearchBatcher:
    """Search queries from many threads in batches.

    Args:
        current: returns the generation to search (called once per batch, so a batch never mixes generations).
        search: ``search(generation, queries (Q, d), k) -> (scores (Q, k), ids (Q, k))``; filtered queries are
            searched as ``search(generation, queries, k, where)``, one call per distinct filter in a batch.
    """

    def __init__(self, current: Callable[[], Generation],
                 search: Callable[[Generation, np.ndarray, int], tuple[np.ndarray, np.ndarray]]):
        self._current, self._search = current, search
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0   # counters for /api/info: how much batching happened
        self.queries = 0
        self.waited_s = 0.0   # time batches spent waiting for announced queries
        self._expected = 0    # queries announced (being embedded) and not yet queued
        self._expected_lock = threading.Lock()
        self._last_search_s = 0.0
        self._last_size = 1   # queries the last batch answered

    def expect(self, n: int = 1) -> None:
        """Announce ``n`` queries being embedded now (``submit(..., expected=True)`` takes each back when it queues
        it; ``expect(-1)`` for one that never comes)."""
        with self._expected_lock:
            self._expected += n

    def submit(self, features: np.ndarray, k: int, where: Optional[SearchFilter] = None,
               expected: bool = False) -> Future:
        """Queue one query row (1, d), optionally filtered (``where``: queries with equal filters are searched
        together); the future gives the generation searched, scores (k,) and row ids (k,) (fewer when fewer rows
        pass the filter). ``expected``: the query was announced (``expect``)."""
        self._ensure_thread()
        future: Future = Future()
        where = where if where is not None and where.active else None
        self._queue.put((np.asarray(features, np.float32).reshape(1, -1), k, where, future))
        if expected:   # after the put: the batch thread never sees it neither announced nor queued
            self.expect(-1)
        return future

    def search(self, features: np.ndarray, k: int, where: Optional[SearchFilter] = None
               ) -> tuple[Generation, np.ndarray, np.ndarray]:
        """``submit`` and wait."""
        return self.submit(features, k, where).result()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="clip-mini-search", daemon=True)
                    self._thread.start()

    def _take(self, batch: list) -> None:
        """Add what is queued (up to ``MAX_BATCH``), then, while queries are announced (or fewer than the last
        batch's have come) and the wait allows, those that arrive."""
        deadline = None
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            if self._expected <= 0 and len(batch) >= self._last_size:
                return
            if deadline is None:
                deadline = time.perf_counter() + min(MAX_WAIT_S, WAIT_SHARE * self._last_search_s)
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            start = time.perf_counter()
            try:
                batch.append(self._queue.get(timeout=min(left, 0.002)))
            except queue.Empty:
                pass
            self.waited_s += time.perf_counter() - start

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            self._take(batch)
            started = time.perf_counter()
            try:
                gen = self._current()
            except BaseException as e:
                for *_, future in batch:
                    future.set_exception(e)
                continue
            groups: dict = {}   # one search per distinct filter (most batches: one group, unfiltered)
            for item in batch:
                groups.setdefault(item[2], []).append(item)
            for where, group in groups.items():
                try:
                    queries, k = np.concatenate([q for q, *_ in group]), max(k for _, k, _, _ in group)
                    scores, ids = (self._search(gen, queries, k) if where is None
                                   else self._search(gen, queries, k, where))
                except BaseException as e:   # every waiting request gets the error, and the thread keeps serving
                    for *_, future in group:
                        future.set_exception(e)
                    continue
                for row, (_, k, _, future) in enumerate(group):
                    future.set_result((gen, scores[row, :k], ids[row, :k]))
            self._last_search_s = time.perf_counter() - started
            self._last_size = len(batch)
            self.batches += 1
            self.queries += len(batch)
