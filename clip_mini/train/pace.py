"""How long the run is and the learning rate of each step: the config's fixed length, or a budget's fit.

The training loop asks a ``Pace`` for the step count (``total``), the learning-rate factor of a step, and, after
each step and epoch, whether the plan changes or the run must stop; it never touches the budget itself. Every
decision that changes the plan is agreed by all ranks (the smallest fit; a re-fit or a stop when any rank asks).
"""
from __future__ import annotations

import math
from typing import Optional

from tqdm import tqdm

from clip_mini.config import Config
from clip_mini.train.budget import Budget
from clip_mini.train.clock import RunClock
from clip_mini.train.distributed import all_max, all_min
from clip_mini.train.schedule import Schedule


class Pace:
    """The run's length and schedule; with ``train.budget``, fitted to the time left and re-fitted as it runs."""

    def __init__(self, schedule: Schedule, steps_per_epoch: int, epochs: int, budget: Optional[Budget], device,
                 main: bool = True, eval_every: int = 1):
        self.schedule, self.spe, self.epochs_cfg = schedule, steps_per_epoch, epochs
        self.budget, self.device, self.main, self.eval_every = budget, device, main, eval_every
        self._agreed = False   # the ranks' measured times agreed since the last evaluation

    @classmethod
    def build(cls, cfg: Config, steps_per_epoch: int, clock: RunClock, ckpt: Optional[dict], device,
              main: bool = True) -> "Pace":
        """The config's length; a budget's plan and schedule when ``train.budget`` is set (a resumed, fitted plan
        is kept as the checkpoint has it)."""
        t = cfg.train
        total = min(t.epochs * steps_per_epoch, t.max_steps or math.inf)
        schedule = Schedule(total=total, warmup=t.warmup_steps, min_ratio=t.min_lr_ratio)
        budget = None
        if t.budget is not None:
            budget = Budget(float(t.budget), clock, t.warmup_steps, steps_per_epoch, t.checkpoint_every,
                            t.eval_every)
            kept = budget.resume((ckpt or {}).get("budget"))
            if kept is not None:
                saved = ckpt.get("schedule")
                schedule = Schedule.from_state(saved) if saved else Schedule(kept, t.warmup_steps, t.min_lr_ratio)
        return cls(schedule, steps_per_epoch, t.epochs, budget, device, main, t.eval_every)

    @staticmethod
    def deadline(cfg: Config, clock: RunClock, ckpt: Optional[dict]) -> Optional[float]:
        """The budget's end (``time.time()`` scale) that one-time work checks its projection against; None without
        a budget, or for a resumed run whose plan is fitted already (it runs to its end as fitted)."""
        if cfg.train.budget is None or (ckpt and (ckpt.get("budget") or {}).get("fitted")):
            return None
        return clock.started + float(cfg.train.budget)

    @property
    def fitting(self) -> bool:
        """A budget whose plan is still fitted as the run goes (not a resumed, kept one)."""
        return self.budget is not None and self.budget.fitting

    def summary(self, step: int) -> Optional[str]:
        """The budget's closing line (None without one)."""
        if self.budget is None:
            return None
        return (f"budget {self.budget.budget_s:.0f} s: {self.budget.clock.elapsed():.0f} s used since the process "
                f"started, {step} steps ({step / self.spe:.2f} epochs)\n")

    @property
    def total(self) -> int:
        return self.schedule.total

    def epochs(self) -> int:
        """Epochs the run has: the config's, or those the fitted steps reach into."""
        return math.ceil(self.total / self.spe) if self.budget else self.epochs_cfg

    def evaluates(self, epoch: int, step: int) -> bool:
        """Whether the end of ``epoch`` (counted from 1), reached at ``step``, is evaluated: every
        ``train.eval_every``-th epoch's, and the run's last (a budget's cut one too; ``final/`` records it). The last
        is the plan's, which a checkpoint stores: a resumed run decides as the paused one would have."""
        return epoch % self.eval_every == 0 or step >= self.total or epoch >= self.epochs()

    def factor(self, step: int) -> float:
        """The learning-rate factor of ``step``."""
        return self.schedule.factor(step)

    @property
    def state(self) -> dict:
        """What a checkpoint stores of the plan (nothing without a budget: the schedule is the config's)."""
        return {"budget": self.budget.state, "schedule": self.schedule.state} if self.budget else {}

    def describe(self) -> Optional[str]:
        return self.budget.describe() if self.budget else None

    # -- as the run goes ------------------------------------------------------------------------------------------
    def after_step(self, step: int, lap: Optional[float]) -> None:
        """``step`` steps are done, the last in ``lap`` seconds: fit once the first steps are timed, re-fit when off
        course, and make the next step the last when the deadline leaves only the run's end (the hard stop)."""
        b = self.budget
        if b is None or not b.fitting:   # a resumed, fitted plan runs to its end as fitted, as an unpaused run would
            return
        b.step_done(lap)
        if not self._agreed:
            self._agree_times()
        if not b.plan["fitted"]:
            if all_max(int(b.due()), self.device):
                self._refit(step, first=True)
        elif step < self.total and all_max(int(b.off_course(step, self.total)), self.device):
            self._refit(step, latest=True)
        if step + 1 < self.total and all_max(int(b.past_deadline()), self.device):
            self.schedule.refit(step, step + 1)   # the next step is the last, at the minimum
            b.plan["total"] = step + 1
            if self.main:
                tqdm.write(f"budget: stopped at step {step + 1}: the time left is what the run's end needs")

    def after_epoch(self, step: int) -> None:
        """An epoch ended (evaluated or not): fit again with the measured epoch end."""
        b = self.budget
        if b is not None and b.fitting:
            self._agree_times()
            if b.step_times and step < self.total:
                self._refit(step, first=not b.plan["fitted"])

    def _agree_times(self) -> None:
        """Rank 0 alone evaluates and writes: every rank plans with the times it measured (the largest of each)."""
        clock = self.budget.clock
        for stage in ("evaluation", "checkpoints", "model_save"):
            took = all_max(clock.last(stage, -1.0), self.device)
            if took >= 0:
                clock.latest[stage] = took
        self._agreed = True

    def _refit(self, step: int, first: bool = False, latest: bool = False) -> None:
        """Fit the step count to the time left (every rank takes the smallest fit); say so when it changes."""
        # at least one more step: the step just taken had its learning rate from the old plan, and the schedule's
        # last step must run at the minimum
        new = max(all_min(self.budget.fit(step, latest), self.device), step + 1)
        self.budget.plan["total"] = new
        old = self.total
        self.schedule.refit(step, new)
        self.budget.plan["warmup"] = self.schedule.warmup
        if self.main and (first or abs(new - old) > 0.05 * old):   # a small correction goes to the plan only
            tqdm.write(("budget: " + self.budget.describe()) if first else
                       f"budget: re-fitted at step {step}: {new} steps (was {old}), "
                       f"{self.budget.plan['step_s']:.3f} s/step")
