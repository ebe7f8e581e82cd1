"""Image queries in their own bounded pool, so uploads never hold up text search.

A text query costs milliseconds; an image query decodes an upload first, which costs far more (a large PNG
decodes in full before it can be reduced). When both shared one pool, a few uploads in flight made every text
query wait behind their decodes. Image queries now run on their own threads (``threads``), at most ``capacity``
of them admitted at once (running or waiting for a thread); one more is refused at once with 503 and a
``Retry-After`` estimated from recent image queries, instead of queueing without bound, holding its body in
memory and delaying everyone behind it.

``Retry-After`` says when the calls admitted now have likely all finished, from what is measured: the running mean
of finished calls, and how long the running ones have been at it: a mean that moves only when a call finishes
would still say 2 s while one slow call has held the only thread for a minute.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


class Busy(Exception):
    """The image pool is full; ``retry_after`` is whole seconds until a slot is likely free."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class BoundedPool:
    """Run blocking calls on ``threads`` threads with at most ``capacity`` admitted at once.

    Admission is counted on the event loop's thread (``run`` is a coroutine), so it needs no lock.
    """

    def __init__(self, threads: int, capacity: int, name: str, clock: Callable[[], float] = time.monotonic):
        if threads < 1 or capacity < threads:
            raise ValueError(f"need 1 <= threads <= capacity, got threads={threads}, capacity={capacity}")
        self.threads, self.capacity, self.name = threads, capacity, name
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"clip-mini-{name}")
        self._clock = clock
        self.admitted = 0
        self.refused = 0
        self._mean_s = 1.0   # running mean of a call's seconds on its thread (a first guess until one has run)
        self._started: dict[int, float] = {}   # worker thread -> when its current call started
        self._lock = threading.Lock()   # workers write ``_started``, the event loop reads it

    def retry_after(self) -> int:
        """Seconds until the calls admitted now have likely finished, spread over the pool's threads.

        A waiting call is expected to take a typical call's time: the running mean of finished calls, or longer if
        a running call has already run longer. A running call is expected to need the rest of the mean, or, once
        past it, as long again as it has run so far (nothing better is known about a call that overran).
        """
        now = self._clock()
        with self._lock:
            elapsed = [now - start for start in self._started.values()]
        typical = max([self._mean_s, *elapsed])
        waiting = max(0, self.admitted - len(elapsed))
        work = sum(max(self._mean_s - e, e) for e in elapsed) + waiting * typical
        return max(1, math.ceil(work / self.threads))

    async def run(self, fn: Callable, *args):
        if self.admitted >= self.capacity:
            self.refused += 1
            wait = self.retry_after()
            raise Busy(f"the server is busy: {self.admitted} {self.name} queries are in flight (the limit); "
                       f"retry in {wait} s", wait)
        self.admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, fn, args)
        finally:
            self.admitted -= 1

    def _timed(self, fn: Callable, args: tuple):
        start = self._clock()
        with self._lock:
            self._started[threading.get_ident()] = start
        try:
            return fn(*args)
        finally:
            with self._lock:
                del self._started[threading.get_ident()]
                self._mean_s = 0.8 * self._mean_s + 0.2 * (self._clock() - start)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
