"""Image queries in their own bounded pool, so uploads never hold up text search.

A text query costs milliseconds; an image query decodes an upload first, which costs far more (a large PNG
decodes in full before it can be reduced). When both shared one pool, a few uploads in flight made every text
query wait behind their decodes. Image queries now run on their own threads (``threads``), at most ``capacity``
of them admitted at once (running or waiting for a thread); one more is refused at once with 503 and a
``Retry-After`` estimated from recent image queries, instead of queueing without bound, holding its body in
memory and delaying everyone behind it.
"""
from __future__ import annotations

import asyncio
import math
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

    def __init__(self, threads: int, capacity: int, name: str):
        if threads < 1 or capacity < threads:
            raise ValueError(f"need 1 <= threads <= capacity, got threads={threads}, capacity={capacity}")
        self.threads, self.capacity, self.name = threads, capacity, name
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"clip-mini-{name}")
        self.admitted = 0
        self.refused = 0
        self._mean_s = 1.0   # running mean of a call's seconds on its thread (a first guess until one has run)

    def retry_after(self) -> int:
        """Seconds until the queue ahead of a newcomer has likely drained."""
        return max(1, math.ceil(self._mean_s * self.admitted / self.threads))

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
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:   # one float store: a race between threads only loses a sample
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - start)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
