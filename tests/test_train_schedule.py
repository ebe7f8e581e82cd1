"""The learning-rate schedule under a budget: re-fits continue the cosine (no jump), a warm-up longer than its
share of the fitted run is cut, the last step always runs at the minimum; the fixed schedule is unchanged."""
import math
import random

import pytest

from clip_mini.train.schedule import WARMUP_SHARE, Schedule, lr_factor


def _reference(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """The fixed-length schedule written out: linear warm-up, then a cosine to min_ratio at total - 1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def test_fixed_length_schedule_is_the_plain_warmup_and_cosine():
    for total in (1, 2, 7, 60, 400):
        for warmup in (0, 1, 5, 50):
            for step in range(total + 3):
                assert lr_factor(step, total, warmup, 0.1) == pytest.approx(_reference(step, total, warmup, 0.1))


def _run(total: int, warmup: int, refits: dict[int, int], min_ratio: float = 0.0) -> list[float]:
    """The factors a run takes step by step, re-fitted to ``refits[step]`` steps before ``step`` runs."""
    s, out, step = Schedule(total=total, warmup=warmup, min_ratio=min_ratio), [], 0
    while step < s.total:
        if step in refits:
            s.refit(step, max(step + 1, refits[step]))
        out.append(s.factor(step))
        step += 1
    return out


def test_a_refit_after_warmup_continues_the_cosine_without_a_jump():
    # the example: warm-up 100, at step 700 of 1,400 re-fitted to 1,050; before: 0.58 -> 0.33 in one step
    factors = _run(1400, 100, {700: 1050})
    assert len(factors) == 1050
    assert abs(factors[700] - factors[699]) < 0.005
    assert factors[-1] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_random_refits_never_change_the_lr_by_more_than_the_schedules_own_largest_step(seed):
    rng = random.Random(seed)
    warmup, total = rng.choice([(10, 400), (50, 900), (100, 1400)])
    # re-fits after the warm-up, to between 60% and 160% of the steps left, as a budget on a busy machine does
    refits, step = {}, warmup + rng.randint(1, 40)
    while step < 0.9 * total:
        refits[step] = step + int((total - step) * rng.uniform(0.6, 1.6))
        step += rng.randint(3, 80)
    factors = _run(total, warmup, refits, min_ratio=0.05)
    plain = [_reference(i, total, warmup, 0.05) for i in range(total)]
    own = max(abs(a - b) for a, b in zip(plain, plain[1:]))   # the warm-up's 1/warmup, or the cosine's steepest
    jumps = [abs(a - b) for a, b in zip(factors, factors[1:])]
    assert max(jumps) <= own + 1e-12, (max(jumps), own)
    assert factors[-1] == pytest.approx(0.05)


@pytest.mark.parametrize("fit_at, fitted", [(20, 60), (50, 51), (10, 100), (30, 31), (5, 8)])
def test_a_warmup_longer_than_its_share_of_the_fitted_run_is_cut_and_the_last_step_is_at_the_minimum(fit_at, fitted):
    factors = _run(1000, 100, {fit_at: fitted}, min_ratio=0.1)
    assert len(factors) == fitted
    assert factors[-1] == pytest.approx(0.1)                      # the minimum, however short the fitted run
    peak = max(range(len(factors)), key=factors.__getitem__)
    assert peak <= max(fit_at, math.ceil(WARMUP_SHARE * fitted))   # warmed up for at most its share (or until now)
    # the steps before the fit ran as they were: the plain ramp
    assert factors[:fit_at] == pytest.approx([(i + 1) / 100 for i in range(fit_at)])
    # no upward jump past the ramp's own next value when the ramp is cut short
    assert all(b - a <= max(1 / 100, (1 - factors[fit_at - 1]) / max(1, math.ceil(WARMUP_SHARE * fitted) - fit_at))
               + 1e-12 for a, b in zip(factors, factors[1:]))


def test_the_schedule_round_trips_through_a_checkpoint():
    s = Schedule(total=500, warmup=40, min_ratio=0.1)
    s.refit(20, 120)
    s.refit(80, 150)
    t = Schedule.from_state(s.state)
    assert [t.factor(i) for i in range(150)] == [s.factor(i) for i in range(150)]
