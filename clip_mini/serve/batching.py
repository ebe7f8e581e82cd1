"""Concurrent queries searched as one batch: one pass over the rows answers every query waiting for it.

Exact search costs about the same for 1 query as for 32 (it is bound by reading and converting the stored rows,
``benchmarks/results/speed/search.json``), so a server answering requests one by one spends almost all its time
re-reading the same matrix. ``SearchBatcher`` runs searches in one thread: it takes every query queued while the
previous batch ran (no waiting window, so a lone query is not delayed), searches them together against one generation,
and hands each request its own rows. Top-k for a smaller k is the prefix of the batch's top-k (results are sorted best
first, ties by row id).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

import numpy as np

from clip_mini.serve.generations import Generation

MAX_BATCH = 64


class SearchBatcher:
    """Search queries from many threads in batches.

    Args:
        current: returns the generation to search (called once per batch, so a batch never mixes generations).
        search: ``search(generation, queries (Q, d), k) -> (scores (Q, k), ids (Q, k))``.
    """

    def __init__(self, current: Callable[[], Generation],
                 search: Callable[[Generation, np.ndarray, int], tuple[np.ndarray, np.ndarray]]):
        self._current, self._search = current, search
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0   # counters for /api/info: how much batching happened
        self.queries = 0

    def submit(self, features: np.ndarray, k: int) -> Future:
        """Queue one query row (1, d); the future gives the generation searched, scores (k,) and row ids (k,)."""
        self._ensure_thread()
        future: Future = Future()
        self._queue.put((np.asarray(features, np.float32).reshape(1, -1), k, future))
        return future

    def search(self, features: np.ndarray, k: int) -> tuple[Generation, np.ndarray, np.ndarray]:
        """``submit`` and wait."""
        return self.submit(features, k).result()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="clip-mini-search", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                gen = self._current()
                scores, ids = self._search(gen, np.concatenate([q for q, _, _ in batch]), max(k for _, k, _ in batch))
            except BaseException as e:   # every waiting request gets the error, and the thread keeps serving
                for _, _, future in batch:
                    future.set_exception(e)
                continue
            self.batches += 1
            self.queries += len(batch)
            for row, (_, k, future) in enumerate(batch):
                future.set_result((gen, scores[row, :k], ids[row, :k]))
