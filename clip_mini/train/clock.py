"""The run's one clock: where its seconds go, stage by stage, and how long each training step took.

Every timed stage (the cache fill, the frozen-feature pass, the text pass, evaluations, checkpoints, model saves)
runs inside ``clock(stage)``. A step's time (``lap``) is the wall time since the previous step ended less the
stages timed in between, so an evaluation or a checkpoint inside the step loop never counts as a slow step. The
budget (``train/budget.py``) reads its durations here instead of timing anything itself; ``breakdown`` is the
``time_breakdown`` of ``train()``'s result and ``summary.json``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional


class RunClock:
    """Seconds by stage since ``started`` (``time.time()`` scale: the process start, for a budget), the latest
    duration of each stage, and step laps."""

    def __init__(self, started: Optional[float] = None):
        self.started = time.time() if started is None else started
        self.seconds: dict[str, float] = {}
        self.latest: dict[str, float] = {}
        self._in_stages = 0.0                     # seconds inside timed stages so far
        self._lap_from: Optional[tuple[float, float]] = None

    def elapsed(self) -> float:
        """Seconds since the run's clock started."""
        return time.time() - self.started

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        """Time a stage: its total, and its latest duration (what the budget plans the next one with)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.add(stage, took)
            self.latest[stage] = took
            self._in_stages += took

    def last(self, stage: str, default: float = 0.0) -> float:
        return self.latest.get(stage, default)

    def start_laps(self) -> None:
        """The step loop (re)starts: the next lap begins now."""
        self._lap_from = (time.perf_counter(), self._in_stages)

    def lap(self) -> Optional[float]:
        """A step ended: its seconds since the previous one (or ``start_laps``), timed stages left out."""
        if self._lap_from is None:
            return None
        now, since = time.perf_counter(), self._in_stages
        took = (now - self._lap_from[0]) - (since - self._lap_from[1])
        self._lap_from = (now, since)
        return took

    def breakdown(self, total_s: float) -> dict[str, float]:
        """Stages plus ``other`` (set-up, data loading before the first step, logging) summing to ``total_s``."""
        out = {f"{k}_s": v for k, v in self.seconds.items()}
        out["other_s"] = total_s - sum(self.seconds.values())
        out["total_s"] = total_s
        return out
