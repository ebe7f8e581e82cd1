"""Train to a wall-clock budget (``train.budget``): one-time work first, then a schedule fitted to the time left.

The run's clock starts when the process does (``python train.py`` / ``clip-mini train`` pass their start time).

1. One-time work counts against the budget: the image cache is filled before the first step (``fill_cache``; the
   first epoch would decode every image anyway, and done first the timed steps run at the speed of the later
   epochs), and the frozen-feature pass runs as usual. Each checks its own projection after its first batches and
   stops the run, before any training, when that work alone would not fit (``BudgetError``: the estimate and
   what to change).
2. The first steps are timed (``Budget.step_done``), together with the untrained model's evaluation and one
   checkpoint write; then ``fit_steps`` gives the number of steps whose training, epoch-end evaluations and
   writes, and final save end within the budget (the last epoch may be cut short; it is evaluated like the
   others). With ``train.eval_every: N`` only every N-th epoch end and the last are evaluated (and may write
   best/); the others cost their checkpoint alone, and the time this frees goes to steps. The fit happens inside
   the warmup where it can, whose learning rate does not depend on the schedule length, so the cosine is set once
   before it starts.
3. The step time drifts (a shared CPU, a warm page cache), so the fit is redone at every epoch end from the
   recent steps and the measured evaluations, and at once when a check after every step finds the run heading
   past its budget. Each re-fit continues the cosine from where it stands (``train/schedule.py``): no step's
   learning rate jumps, and the last step still runs at the minimum. A warm-up longer than a quarter of the
   fitted run is cut to that.
4. A hard stop bounds the overrun: once one more step would leave less time than the run's end needs (this
   epoch's evaluation and saves, the final save, the exit, at their latest measured times), that step is the
   last, run at the minimum learning rate. A run then overruns its budget only by how much longer its last step
   and its end take than they last did.

The plan and the schedule's anchors are stored in every checkpoint. A resumed run keeps them: it finishes the
fitted schedule without fitting again, so a paused run resumes to the weights of one that was not paused.

``fit_steps`` / ``fit_epochs`` / ``fit_schedule`` are also what ``benchmarks/quality_flickr8k.py`` and its
open_clip peer fit with.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from typing import Callable, Optional

from clip_mini.errors import BudgetError

TARGET = 0.97         # share of the time left that a fit plans for: process exit and timing noise take the rest
TIMED_STEPS = 50      # at most this many steps are timed before the first fit (fewer inside a shorter warmup)
MIN_TIMED = 5         # ... and at least this many
TIMED_SHARE = 0.05    # ... unless they take this share of the budget first (slow steps: fit sooner)
SKIP = 2              # the first steps after a (re)start are not timed: loader workers start, caches warm
RECENT = 100          # steps whose mean time a re-fit uses
EXIT_S = 4.0          # the process's exit after train() returns (loader workers, interpreter teardown), at most
EXIT_SHARE = 0.04     # ... or this share of the budget, when smaller
LATEST = 5            # steps whose mean time the check against the deadline uses (it reacts to a slowdown)


# -- fitting (pure functions) ---------------------------------------------------------------------------------
def epoch_ends(total: int, steps_per_epoch: int, done: int, eval_every: int = 1) -> tuple[int, int]:
    """The epoch ends a run of ``total`` steps still has after ``done``: ``(evaluated, not evaluated)``. Every
    ``eval_every``-th epoch end is evaluated, and so is the run's last (the epoch ``total`` reaches into, cut short
    or not): ``final/`` records its evaluation."""
    first, last = done // steps_per_epoch, math.ceil(total / steps_per_epoch)
    if last <= first:
        return 0, 0
    evaluated = (last - 1) // eval_every - first // eval_every + 1
    return evaluated, last - first - evaluated


def _rest_cost(total: int, done: int, step_s: float, eval_s: float, save_s: float, steps_per_epoch: int,
               eval_every: int) -> float:
    """Seconds from step ``done`` to ``total``: the steps, the evaluated epoch ends and the others."""
    evaluated, plain = epoch_ends(total, steps_per_epoch, done, eval_every)
    return (total - done) * step_s + evaluated * eval_s + plain * save_s


def _dearest_end(eval_s: float, save_s: float, eval_every: int) -> float:
    """An epoch end's cost at most: the closed forms' bound (exact when every epoch end is evaluated)."""
    return eval_s if eval_every == 1 else max(eval_s, save_s)


def fit_steps(time_left: float, step_s: float, eval_s: float, steps_per_epoch: int, done: int,
              target: float = TARGET, eval_every: int = 1, save_s: float = 0.0) -> int:
    """Steps (in all) whose remaining steps and epoch ends fit ``target * time_left`` seconds, the last epoch
    possibly cut short. ``eval_s``: an evaluated epoch end (every ``eval_every``-th, and the last, cut or not);
    ``save_s``: any other epoch end (its checkpoint). At least ``done + 1``."""
    left = target * time_left

    def cost(total: int) -> float:
        return _rest_cost(total, done, step_s, eval_s, save_s, steps_per_epoch, eval_every)

    per_epoch = steps_per_epoch * step_s + _dearest_end(eval_s, save_s, eval_every)
    # whole epochs first (a closed form at the dearest epoch end, then epoch by epoch), then step by step through
    # the last one
    epochs_done = done // steps_per_epoch
    total = done
    if per_epoch > 0:
        whole = int((left + (done - epochs_done * steps_per_epoch) * step_s) // per_epoch) - 1
        if whole > 0:
            total = max(done, (epochs_done + whole) * steps_per_epoch)
        while cost((total // steps_per_epoch + 1) * steps_per_epoch) <= left:
            total = (total // steps_per_epoch + 1) * steps_per_epoch
    while True:
        nxt = total + 1
        if cost(nxt) > left:
            return max(total, done + 1)
        total = nxt


def fit_epochs(time_left: float, step_s: float, eval_s: float, steps_per_epoch: int, done: int,
               target: float = TARGET, eval_every: int = 1, save_s: float = 0.0) -> int:
    """Epochs (in all) whose remaining steps and epoch ends (``eval_s`` evaluated, ``save_s`` not: see
    ``fit_steps``) fit ``target * time_left`` seconds."""
    left = target * time_left
    dear = _dearest_end(eval_s, save_s, eval_every)
    epochs_done = done // steps_per_epoch
    fit = (left + done * step_s + epochs_done * dear) // (steps_per_epoch * step_s + dear)
    epochs = max(1, math.ceil(done / steps_per_epoch), int(fit))
    if eval_every > 1:   # the closed form charged every epoch end as an evaluated one: add what the others free
        while _rest_cost((epochs + 1) * steps_per_epoch, done, step_s, eval_s, save_s, steps_per_epoch,
                         eval_every) <= left:
            epochs += 1
    return epochs


def fit_schedule(fit: str, time_left: float, step_s: float, eval_s: float, steps_per_epoch: int,
                 done: int, eval_every: int = 1, save_s: float = 0.0) -> tuple[int, Optional[int]]:
    """``(train.epochs, train.max_steps)``: whole epochs (``fit="epochs"``, max_steps None) or steps; the epoch ends
    as ``fit_steps`` counts them."""
    if fit == "epochs":
        return fit_epochs(time_left, step_s, eval_s, steps_per_epoch, done, eval_every=eval_every,
                          save_s=save_s), None
    steps = fit_steps(time_left, step_s, eval_s, steps_per_epoch, done, eval_every=eval_every, save_s=save_s)
    return math.ceil(steps / steps_per_epoch), steps


def timed_steps(warmup_steps: int) -> int:
    """Steps timed before the first fit: inside the warmup when it is long enough (see the module docstring)."""
    return max(MIN_TIMED + SKIP, min(TIMED_STEPS, warmup_steps))


# -- one-time work ----------------------------------------------------------------------------------------------
def _check_projection(what: str, done: int, total: int, seconds: float, deadline: float, budget_s: float,
                      change: str) -> None:
    """Raise ``BudgetError`` when ``total`` items at the rate of the first ``done`` cannot end before ``deadline``."""
    rate = done / max(seconds, 1e-9)
    projected = (total - done) / rate
    if time.time() + projected > deadline:
        raise BudgetError(f"train.budget {_fmt(budget_s)}: {what} alone would take about {_fmt(seconds + projected)} "
                          f"({total} images at {rate:.1f}/s on this machine), more than the budget leaves "
                          f"({_fmt(max(0.0, deadline - time.time() + seconds))}); {change}, or raise train.budget")


def fill_cache(cache, paths: list[str], pre, deadline: float, budget_s: float, progress: bool = True) -> dict:
    """Decode every image of ``paths`` into ``cache`` (records the training and eval transforms read), checking
    after the first batches that the rest fits before ``deadline``. Never draws from the global RNG."""
    import torch
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from clip_mini.data import ImageDataset, build_eval_transform

    start, before = time.time(), len(cache)
    workers = min(2, os.cpu_count() or 1)
    loader = DataLoader(ImageDataset(paths, build_eval_transform(pre), cache), batch_size=64, num_workers=workers,
                        generator=torch.Generator())
    done = 0
    for i, batch in enumerate(tqdm(loader, desc="budget: filling the image cache", unit="batch",
                                   disable=not progress, dynamic_ncols=True)):
        done += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)
        if i == 2 * workers:   # every worker has delivered: a settled rate
            _check_projection("filling the image cache", done, len(paths), time.time() - start, deadline, budget_s,
                              "use data.cache: false (decode every step) or fewer images")
    return {"images": len(paths), "decoded": len(cache) - before, "s": round(time.time() - start, 1)}


def feature_pass_check(deadline: float, budget_s: float) -> Callable[[int, int, float], None]:
    """A ``check(done, total, seconds)`` for the frozen-feature pass (``frozen.prepare``): called after its first
    batches with the images done, the images of the whole pass and the seconds so far."""
    def check(done: int, total: int, seconds: float) -> None:
        _check_projection("the frozen-feature pass", done, total, seconds, deadline, budget_s,
                          "use fewer views (train.frozen_features) or a lower resolution (model.vision.image_size, "
                          "model.vision.concat_size)")
    return check


# -- the run's plan ---------------------------------------------------------------------------------------------
class Budget:
    """The run's wall-clock budget, an observer of the run's clock (``train/clock.py``): it keeps the recent step
    times, reads the latest evaluation and save times there, and fits the step count to the time left.

    ``state`` (stored in every checkpoint) is the plan; ``resume`` restores a fitted one, which is then kept.
    """

    def __init__(self, budget_s: float, clock, warmup_steps: int, steps_per_epoch: int, checkpoint_every: int = 0,
                 eval_every: int = 1):
        self.budget_s, self.clock = budget_s, clock
        self.deadline = clock.started + budget_s
        self.spe, self.checkpoint_every, self.eval_every = steps_per_epoch, checkpoint_every, eval_every
        self.one_time_s = clock.elapsed()   # set-up and one-time work before the first step
        self.fit_at = timed_steps(warmup_steps)
        self.step_times: deque[float] = deque(maxlen=RECENT)
        self.since_start = 0     # steps this process has run (the first SKIP are not timed)
        self.plan: dict = {"budget_s": budget_s, "fitted": False, "total": None, "fits": []}
        self.kept = False        # a resumed, fitted plan: no more fitting

    def resume(self, state: Optional[dict]) -> Optional[int]:
        """Take a checkpoint's plan; returns its total steps when it was fitted (and is then kept), else None."""
        if state and state.get("fitted"):
            self.plan, self.kept = dict(state), True
            return int(state["total"])
        return None

    @property
    def fitting(self) -> bool:
        return not self.kept

    @property
    def state(self) -> dict:
        return dict(self.plan)

    def step_s(self) -> float:
        return sum(self.step_times) / len(self.step_times)

    def step_done(self, lap: Optional[float]) -> None:
        """A step ended, ``lap`` seconds after the previous one (``RunClock.lap``: evaluations and writes left out)."""
        self.since_start += 1
        if lap is not None and self.since_start > SKIP:
            self.step_times.append(lap)

    # -- the clock's latest measurements ----------------------------------------------------------------------
    def _eval_s(self) -> float:
        return self.clock.last("evaluation")

    def _save_s(self) -> float:
        return self.clock.last("checkpoints")

    def _model_save_s(self) -> float:
        """One model directory (best/ at an improving epoch; final/ at the end); a checkpoint's time until then."""
        return self.clock.last("model_save", self._save_s())

    def _exit_s(self) -> float:
        return min(EXIT_S, EXIT_SHARE * self.budget_s)

    # -- fitting ----------------------------------------------------------------------------------------------
    def per_epoch_s(self) -> float:
        """An evaluated epoch end: the evaluation, the checkpoint, and best/ (written at every improving evaluation:
        counted always, so a run that keeps improving still fits)."""
        return self._eval_s() + self._save_s() + self._model_save_s()

    def plain_end_s(self) -> float:
        """An epoch end without an evaluation (``train.eval_every``): its checkpoint alone."""
        return self._save_s()

    def time_left(self) -> float:
        """Seconds left for steps and epoch ends: the budget less what has run, the final save and the exit."""
        return self.deadline - time.time() - self._model_save_s() - self._exit_s()

    def fit(self, step: int, latest: bool = False) -> int:
        """The total number of steps that ends the run within the budget, from ``step`` (the epoch ends up to
        ``step`` done and timed); recorded in the plan. ``latest``: at the slower of the recent mean step time and
        the latest steps' (a re-fit for a slowdown)."""
        step_s = self.step_s()
        if latest:
            recent = list(self.step_times)[-LATEST:]
            step_s = max(step_s, sum(recent) / len(recent))
        if self.checkpoint_every:   # the periodic checkpoints' time, spread over the steps
            step_s += self._save_s() / self.checkpoint_every
        total = fit_steps(self.time_left(), step_s, self.per_epoch_s(), self.spe, step, eval_every=self.eval_every,
                          save_s=self.plain_end_s())
        self.plan.update(fitted=True, total=total, step_s=round(step_s, 4), eval_s=round(self._eval_s(), 2),
                         save_s=round(self._save_s(), 2), model_save_s=round(self._model_save_s(), 2),
                         epochs=round(total / self.spe, 2), steps_per_epoch=self.spe,
                         one_time_s=round(self.one_time_s, 1))
        self.plan["fits"] = self.plan["fits"][-20:] + [{"at_step": step, "at_s": round(self.clock.elapsed(), 1),
                                                         "step_s": round(step_s, 4), "total": total}]
        return total

    def due(self) -> bool:
        """The first fit is due: the timed steps are done, or at least ``MIN_TIMED`` of them took
        ``TIMED_SHARE`` of the budget."""
        if self.kept or self.plan["fitted"]:
            return False
        return self.since_start >= self.fit_at or (len(self.step_times) >= MIN_TIMED
                                                   and sum(self.step_times) >= TIMED_SHARE * self.budget_s)

    def _rest_s(self, step: int, total: int) -> float:
        """The epoch ends still due from ``step`` to ``total`` (evaluated or not), the final save and the exit."""
        evaluated, plain = epoch_ends(total, self.spe, step, self.eval_every)
        return evaluated * self.per_epoch_s() + plain * self.plain_end_s() + self._model_save_s() + self._exit_s()

    def off_course(self, step: int, total: int) -> bool:
        """A fitted run whose projected end passes its deadline (at the time of the latest steps, so that a
        slowdown is caught at once), or comes more than 8% of the budget early (at the recent mean): re-fit now
        rather than at the epoch end."""
        if self.kept or not self.plan["fitted"] or not self.step_times:
            return False
        latest = list(self.step_times)[-LATEST:]
        rest = self._rest_s(step, total)
        late = time.time() + (total - step) * max(self.step_s(), sum(latest) / len(latest)) + rest
        early = time.time() + (total - step) * self.step_s() + rest
        return late > self.deadline or early < self.deadline - 0.08 * self.budget_s

    def past_deadline(self) -> bool:
        """The hard stop: one more step, at the latest steps' time, would leave less time than the run's end needs
        (this epoch's evaluation and saves, the final save, the exit) at their latest measured times. The epoch that
        step ends is the run's last, so it is evaluated whatever ``train.eval_every`` says."""
        latest = list(self.step_times)[-LATEST:]
        next_step = sum(latest) / len(latest) if latest else 0.0
        return time.time() + next_step + self.per_epoch_s() + self._model_save_s() + self._exit_s() > self.deadline

    def describe(self) -> str:
        p = self.plan
        return (f"budget {_fmt(self.budget_s)}: {p['total']} steps ({p['epochs']:g} epochs of {self.spe}) at "
                f"{p['step_s']:.3f} s/step, {self._ends()}; {_fmt(self.clock.elapsed())} used so far")

    def _ends(self) -> str:
        """What ``describe`` says of the epoch ends."""
        evaluated = f"{self.per_epoch_s():.1f} s per epoch end (evaluation and saves)"
        if self.eval_every == 1:
            return evaluated
        return (f"{evaluated} every {self.eval_every} epochs and at the last, {self.plain_end_s():.1f} s "
                f"(the checkpoint) at the others")


def process_start_time() -> Optional[float]:
    """When this process started (``time.time()`` scale), so a budget counts the interpreter's start and the
    imports too; None where ``/proc`` does not say (the caller then starts the clock itself)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: start time in clock ticks since boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _fmt(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 600 else f"{seconds:.0f} s"
