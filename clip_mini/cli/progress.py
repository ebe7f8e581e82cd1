"""Progress bars for people and for logs: ``clip-mini`` runs every command inside ``console(quiet)``.

On a terminal tqdm redraws one line with carriage returns, which is what people want. In a log file (stderr not a
terminal) the same redraws pile up as one enormous line of ``\\r`` updates (a ``make demo`` log was hundreds of
kilobytes), so there each bar becomes a plain line at most every ``LOG_INTERVAL_S`` seconds, plus its final state.
``--quiet`` drops the bars altogether. Every bar in the package goes through ``sys.stderr``, so wrapping that one
stream covers the trainer's, the indexer's and the data pipeline's bars alike without touching them.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator, TextIO

LOG_INTERVAL_S = 30.0


class _BarLines:
    """A stderr stand-in: text without ``\\r`` passes through; tqdm's ``\\r`` redraws become rate-limited lines."""

    def __init__(self, stream: TextIO, quiet: bool, interval: float = LOG_INTERVAL_S):
        self._stream, self._quiet, self._interval = stream, quiet, interval
        self._pending = ""       # the newest redraw not yet written
        self._last_line = ""     # the last redraw written (never the same line twice)
        self._last_time = float("-inf")

    def write(self, s: str) -> int:
        if "\r" in s:
            draw = next((p.strip() for p in reversed(s.split("\r")) if p.strip()), "")
            self._pending = draw   # an all-blank draw is tqdm clearing a finished bar (leave=False): drop it
            now = time.monotonic()
            if draw and not self._quiet and now - self._last_time >= self._interval:
                self._emit(now)
            return len(s)
        if self._pending and s.startswith("\n"):   # a bar closed with leave=True: its final state
            if not self._quiet:
                self._emit(time.monotonic())
            self._pending = ""
            s = s[1:]
        return self._stream.write(s) if s else 0

    def _emit(self, now: float) -> None:
        if self._pending != self._last_line:
            self._stream.write(self._pending + "\n")
            self._last_line = self._pending
        self._last_time = now

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False   # tqdm then draws without cursor movement, one bar at a time

    def __getattr__(self, name: str):
        return getattr(self._stream, name)   # fileno, encoding, ... of the real stream


@contextmanager
def console(quiet: bool = False, interval: float = LOG_INTERVAL_S) -> Iterator[None]:
    """Within: progress bars are dropped (``quiet``), or written as periodic lines when stderr is not a terminal."""
    real = sys.stderr
    if not quiet and real.isatty():
        yield
        return
    sys.stderr = _BarLines(real, quiet, interval)
    try:
        yield
    finally:
        sys.stderr = real
