"""The learning-rate schedule: linear warm-up, then a cosine to ``min_lr_ratio`` at the last step.

Without a budget the schedule is a pure function of the step and the config (``lr_factor``). A budget changes the
run's length while it runs, so the schedule carries anchors: at each re-fit the cosine continues from the point
it has reached (its progress at the current step) and spreads the rest over the new length, so no step's learning
rate jumps, and the last step still runs at the minimum. A warm-up longer than a share of the fitted run is cut to
that share, the ramp going on from the factor it has reached. The anchors are the schedule's whole state; every
checkpoint stores them, so a resumed run continues the schedule it had.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

WARMUP_SHARE = 0.25   # a fitted run warms up for at most this share of its steps


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based) of a fixed-length run: linear warm-up reaching
    1.0 on step ``warmup_steps - 1``, then a cosine down to ``min_ratio`` at ``total_steps - 1``."""
    return Schedule(total=total_steps, warmup=warmup_steps, min_ratio=min_ratio).factor(step)


@dataclass
class Schedule:
    """Warm-up + cosine with anchors (all steps 0-based).

    ``warm_step`` / ``warm_factor``: the warm-up ramp runs from ``warm_factor`` (the factor step ``warm_step - 1``
    ran at) to 1.0 on step ``warmup - 1``. ``cos_step`` / ``cos_progress``: the cosine's progress is
    ``cos_progress`` at ``cos_step`` and 1 at ``total - 1``.
    """

    total: int
    warmup: int
    min_ratio: float = 0.0
    warm_step: int = 0
    warm_factor: float = 0.0
    cos_step: int = -1          # -1: at the end of the warm-up
    cos_progress: float = 0.0

    def __post_init__(self):
        self.warmup = max(0, int(self.warmup))
        if self.cos_step < 0:
            self.cos_step = self.warmup

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return self.warm_factor + (1.0 - self.warm_factor) * (step + 1 - self.warm_step) / (
                self.warmup - self.warm_step)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * self.progress(step)))

    def progress(self, step: int) -> float:
        """The cosine's progress (0 at its start, 1 from the last step on) at ``step`` >= the warm-up."""
        span = max(1, self.total - 1 - self.cos_step)
        return min(1.0, self.cos_progress + (1.0 - self.cos_progress) * max(0, step - self.cos_step) / span)

    def refit(self, step: int, total: int) -> None:
        """The run now ends after ``total`` steps, and ``step`` steps are done (the next to run is ``step``).

        The cosine goes on from the progress of the step that last ran. A warm-up still running is capped at ``WARMUP_SHARE`` of
        ``total``: its ramp goes on from the factor the last step ran at, or, already past the cap, the cosine
        starts now from that factor."""
        if total - 1 <= step:   # one step left: it runs at the minimum, as every run's last step does
            self.warmup = min(self.warmup, step)
            self.cos_step, self.cos_progress = step, 1.0
        elif step < self.warmup:
            reached = self.factor(step - 1) if step > 0 else 0.0
            cap = math.ceil(WARMUP_SHARE * total)
            if cap <= step:   # warmed up for longer than its share already: the cosine starts at the level reached
                self.warmup = step
                self.cos_step, self.cos_progress = step, self._progress_at(reached)
            else:
                if cap < self.warmup:   # a shorter ramp, going on from the level reached
                    self.warm_step, self.warm_factor, self.warmup = step, reached, cap
                self.cos_step, self.cos_progress = self.warmup, 0.0
        else:   # from the progress of the step that last ran (``step`` itself was to be the last of a plan ending now)
            anchor = max(step - 1, self.warmup)
            self.cos_step, self.cos_progress = anchor, self.progress(anchor)
        self.total = total

    def _progress_at(self, factor: float) -> float:
        """The cosine's progress at which it gives ``factor`` (0 at or above the peak, 1 at or below the minimum)."""
        level = (factor - self.min_ratio) / (1.0 - self.min_ratio) if self.min_ratio < 1.0 else 1.0
        return math.acos(min(1.0, max(-1.0, 2.0 * level - 1.0))) / math.pi

    @property
    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "Schedule":
        return cls(**state)
