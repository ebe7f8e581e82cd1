"""train.eval_every: the budget's fit charges an evaluation only to the epoch ends that have one (every N-th and the
run's last, cut short or not) and the others their checkpoint; a run evaluates just those epochs, keeps best/ from
one of them, and a paused run resumes to the weights and rows of an unpaused one."""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from clip_mini.config import Config, ConfigError, TrainConfig, load_config
from clip_mini.train import train
from clip_mini.train.budget import EXIT_S, EXIT_SHARE, Budget, epoch_ends, fit_epochs, fit_schedule, fit_steps
from clip_mini.train.clock import RunClock
from clip_mini.train.pace import Pace
from clip_mini.train.schedule import Schedule
from conftest import NARROW, tiny_sets

TINY = tiny_sets(NARROW) + [
    "model.text.vocab_size=120", "data.val=40", "data.scale_min=0.9", "train.batch_size=16", "train.lr=2e-3",
    "train.warmup_steps=2", "train.log_every=1", "train.threads=1", "train.eval_batch_size=64", "train.device=cpu"]
# 160 train images, 16 a step: 10 steps an epoch; three epochs, evaluated after 2 and 3 (the last)
EVERY_2 = ["train.epochs=3", "train.eval_every=2", "train.keep_checkpoints=10", "model.text.dropout=0.1"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=200, seed=0, size=32)


@pytest.fixture(scope="module")
def uninterrupted(shapes, tmp_path_factory):
    """A run of ``EVERY_2`` from start to end: its directory and result."""
    run = tmp_path_factory.mktemp("every2") / "run"
    return run, train(_cfg(shapes, run, *EVERY_2))


def _cfg(shapes, out, *extra):
    return load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}",
                                     f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}", *extra])


def _rows(run) -> list[dict]:
    """``metrics.jsonl`` without its timings (they differ between runs)."""
    drop = ("pairs_per_s", "data_wait", "time_s", "eval_s")
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def _trained(run, d: str) -> dict:
    return json.loads((Path(run) / d / "config.json").read_text())["trained"]


# -- the fit (pure functions) -------------------------------------------------------------------------------------
def _ends_by_hand(total: int, spe: int, done: int, every: int) -> tuple[int, int]:
    """``epoch_ends`` by listing the epochs: those ending after ``done``, up to the one ``total`` reaches into."""
    due = range(done // spe + 1, math.ceil(total / spe) + 1)
    evaluated = [e for e in due if e % every == 0 or e == due[-1]]
    return len(evaluated), len(due) - len(evaluated)


def _cost(total, done, step_s, eval_s, save_s, spe, every) -> float:
    evaluated, plain = _ends_by_hand(total, spe, done, every)
    return (total - done) * step_s + evaluated * eval_s + plain * save_s


def _steps_by_search(left, step_s, eval_s, spe, done, every, save_s) -> int:
    """The most steps whose cost fits ``left``, at least ``done + 1``: every step count tried in turn."""
    best, total = done + 1, done + 1
    while (total - done) * step_s <= left:
        if _cost(total, done, step_s, eval_s, save_s, spe, every) <= left:
            best = total
        total += 1
    return best


def _epochs_by_search(left, step_s, eval_s, spe, done, every, save_s) -> int:
    epochs = max(1, math.ceil(done / spe))
    while _cost((epochs + 1) * spe, done, step_s, eval_s, save_s, spe, every) <= left:
        epochs += 1
    return epochs


def test_every_epoch_evaluated_fits_as_before():
    # test_train_budget's numbers: save_s is never charged when every epoch end is evaluated
    assert fit_steps(100, 1.0, 5.0, 10, 6, eval_every=1, save_s=2.0) == 68
    assert fit_schedule("steps", 100, 1.0, 5.0, 10, 6, eval_every=1, save_s=2.0) == (7, 68)
    assert fit_schedule("epochs", 100, 1.0, 5.0, 10, 6, eval_every=1, save_s=2.0) == (6, None)
    # 110 s, 106.7 usable: 72 steps (66 s) and the ends of epochs 1-8 (40 s); 7 whole epochs (64 + 35 s)
    assert fit_steps(110, 1.0, 5.0, 10, 6) == fit_steps(110, 1.0, 5.0, 10, 6, eval_every=1, save_s=1.0) == 72
    assert fit_epochs(110, 1.0, 5.0, 10, 6) == fit_epochs(110, 1.0, 5.0, 10, 6, eval_every=1, save_s=1.0) == 7


def test_fewer_evaluations_fit_more_steps_in_the_same_time():
    # 10 steps of 1 s an epoch, 6 done, 106.7 s usable (110 s at TARGET); 5 s an evaluated epoch end, 1 s another.
    # eval_every=2, 83 steps: 77 s of steps; epochs 1-9 end, 2, 4, 6, 8 and the cut 9th evaluated (25 s), 1, 3,
    # 5, 7 not (4 s): 106 s. Step 84 would add 1 s.
    assert epoch_ends(83, 10, 6, 2) == (5, 4)
    assert fit_steps(110, 1.0, 5.0, 10, 6, eval_every=2, save_s=1.0) == 83
    assert fit_schedule("steps", 110, 1.0, 5.0, 10, 6, eval_every=2, save_s=1.0) == (9, 83)
    # eval_every=3, 90 steps: 84 s of steps; 3, 6 and the last, 9, evaluated (15 s), the other six not (6 s): 105 s.
    # Step 91 opens epoch 10, itself evaluated as the last: 85 + 20 + 6 = 111 s
    assert epoch_ends(90, 10, 6, 3) == (3, 6) and epoch_ends(91, 10, 6, 3) == (4, 6)
    assert fit_steps(110, 1.0, 5.0, 10, 6, eval_every=3, save_s=1.0) == 90
    # whole epochs: 8 with eval_every=2 (74 s of steps, 2, 4, 6, 8 evaluated: 20 s, 4 s of the others: 98 s; a 9th
    # would be evaluated as the last: 84 + 25 + 4 = 113 s); 9 with eval_every=3 (84 + 15 + 6 = 105 s)
    assert fit_epochs(110, 1.0, 5.0, 10, 6, eval_every=2, save_s=1.0) == 8
    assert fit_schedule("epochs", 110, 1.0, 5.0, 10, 6, eval_every=2, save_s=1.0) == (8, None)
    assert fit_epochs(110, 1.0, 5.0, 10, 6, eval_every=3, save_s=1.0) == 9


def test_the_last_epoch_is_always_counted_as_evaluated():
    # 0 done, 81 steps, eval_every=2: epochs 2, 4, 6, 8 and the cut 9th evaluated; 1, 3, 5, 7 not
    assert epoch_ends(81, 10, 0, 2) == (5, 4)
    assert epoch_ends(80, 10, 0, 2) == (4, 4)      # the 8th is the last, evaluated either way
    assert epoch_ends(83, 10, 40, 2) == (3, 2)     # from the end of epoch 4: 6, 8, 9 evaluated, 5, 7 not
    assert epoch_ends(45, 10, 41, 4) == (1, 0)     # the epoch under way is the last: evaluated, though 5 % 4 != 0
    assert epoch_ends(40, 10, 40, 2) == (0, 0)     # nothing left
    # an eval_every longer than the run: the last epoch alone is evaluated, and the fit charges it
    assert epoch_ends(30, 10, 0, 5) == (1, 2)
    # 50 s usable at 1 s a step, 10 s an evaluation, no checkpoint time: 40 steps and the last epoch's evaluation
    # (4 epochs), not 50 steps with no evaluation
    assert fit_steps(50, 1.0, 10.0, 10, 0, target=1.0, eval_every=100) == 40


def test_the_fit_is_the_most_steps_that_fit():
    # random small cases on values a float holds exactly, against a search over every step count and epoch ends
    # listed by hand; eval_every=1 is the fit as it stood before eval_every (an evaluation at every epoch end)
    rng = random.Random(0)
    for _ in range(400):
        spe, done, every = rng.randint(1, 12), rng.randint(0, 40), rng.randint(1, 4)
        step_s, eval_s, save_s = rng.choice([0.25, 0.5, 1.0, 2.0]), rng.randint(0, 12) / 4, rng.randint(0, 8) / 4
        left = float(rng.randint(-5, 120))
        args = (left, step_s, eval_s, spe, done)
        assert fit_steps(*args, target=1.0, eval_every=every, save_s=save_s) == \
            _steps_by_search(left, step_s, eval_s, spe, done, every, save_s), (args, every, save_s)
        assert fit_epochs(*args, target=1.0, eval_every=every, save_s=save_s) == \
            _epochs_by_search(left, step_s, eval_s, spe, done, every, save_s), (args, every, save_s)
    for total in range(1, 60):
        for done in range(0, total):
            for every in (1, 2, 3, 5):
                assert epoch_ends(total, 7, done, every) == _ends_by_hand(total, 7, done, every), (total, done, every)


def test_the_budget_charges_a_plain_epoch_end_its_checkpoint_alone():
    clock = RunClock(started=time.time())
    clock.latest.update(evaluation=3.0, checkpoints=1.0, model_save=2.0)
    exit_s = min(EXIT_S, EXIT_SHARE * 1000.0)
    fits = {}
    for every in (1, 2):
        b = Budget(1000.0, clock, warmup_steps=10, steps_per_epoch=10, eval_every=every)
        assert b.per_epoch_s() == 6.0 and b.plain_end_s() == 1.0   # evaluation + checkpoint + best/; checkpoint
        b.step_times.extend([1.0] * 10)
        b.time_left = lambda: 110.0
        fits[every] = b.fit(6)
        if every == 2:
            # from step 6 to 83: epochs 1-9 end, 2, 4, 6, 8, 9 evaluated, 1, 3, 5, 7 not; the final save, the exit
            assert b._rest_s(6, 83) == 5 * 6.0 + 4 * 1.0 + 2.0 + exit_s
            assert "every 2 epochs and at the last" in b.describe()
    # 106.7 s usable: eval_every=1, 70 steps (64 s) and 7 ends of 6 s; eval_every=2, 80 steps (74 s), ends 2, 4, 6
    # and 8 evaluated (24 s), 1, 3, 5 and 7 not (4 s)
    assert fits == {1: 70, 2: 80}


def test_pace_evaluates_every_nth_epoch_and_the_last():
    pace = Pace(Schedule(total=25, warmup=0), steps_per_epoch=10, epochs=3, budget=None, device="cpu", eval_every=2)
    assert [pace.evaluates(e, s) for e, s in ((1, 10), (2, 20), (3, 25))] == [False, True, True]
    # a budget's plan: the epochs its steps reach into; a hard stop makes the epoch under way the last
    pace = Pace(Schedule(total=55, warmup=0), steps_per_epoch=10, epochs=99, budget=SimpleNamespace(), device="cpu",
                eval_every=3)
    assert [pace.evaluates(e, 10 * e) for e in range(1, 6)] == [False, False, True, False, False]
    assert pace.evaluates(6, 55)
    pace.schedule.refit(12, 13)
    assert pace.evaluates(2, 13)


# -- runs -----------------------------------------------------------------------------------------------------------
def test_a_run_evaluates_every_second_epoch_and_the_last(uninterrupted):
    run, result = uninterrupted
    assert result["step"] == 30 and result["epoch"] == 3
    epochs = [r for r in _rows(run) if r["kind"] == "epoch"]
    assert [(r["epoch"], r["step"]) for r in epochs] == [(0, 0), (2, 20), (3, 30)]
    # a checkpoint at every epoch end, evaluated or not
    assert all((run / "checkpoints" / f"ckpt-{n}.pt").is_file() for n in (10, 20, 30))
    # best/ is the better of epochs 2 and 3 (the earlier on a tie), final/ the last evaluation
    best = max(epochs[1:], key=lambda r: (r["val_t2i_r1"], -r["epoch"]))
    assert _trained(run, "best")["epoch"] == best["epoch"]
    assert _trained(run, "best")["val"]["t2i_r1"] == best["val_t2i_r1"] == result["best_value"]
    final = _trained(run, "final")
    assert final["epoch"] == 3 and final["val"] == {k[4:]: v for k, v in epochs[-1].items() if k.startswith("val_")}


def test_a_cut_last_epoch_is_evaluated(shapes, tmp_path):
    # max_steps ends the run 5 steps into epoch 3 of 4: that epoch is the last, evaluated though 3 % 2 != 0
    run = tmp_path / "run"
    train(_cfg(shapes, run, "train.epochs=4", "train.max_steps=25", "train.eval_every=2"))
    assert [(r["epoch"], r["step"]) for r in _rows(run) if r["kind"] == "epoch"] == [(0, 0), (2, 20), (3, 25)]
    assert _trained(run, "final")["epoch"] == 3


def test_pause_and_resume_with_eval_every_is_bitwise_equal_to_an_uninterrupted_run(shapes, tmp_path, uninterrupted):
    ref, _ = uninterrupted
    run = tmp_path / "paused"
    assert train(_cfg(shapes, run, *EVERY_2), stop_after=13)["stopped"]                  # past epoch 1's plain end
    assert train(_cfg(shapes, run, *EVERY_2), resume="auto", stop_after=20)["stopped"]   # before epoch 2's evaluation
    train(_cfg(shapes, run, *EVERY_2), resume="auto")
    for d in ("final", "best"):
        a, b = (load_file(str(r / d / "model.safetensors")) for r in (ref, run))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (d, k)   # bitwise
    assert _rows(run) == _rows(ref)


@pytest.mark.parametrize("value", ["0", "-1", "true", "1.5", "two"])
def test_eval_every_config_is_validated(value):
    with pytest.raises(ConfigError, match="train.eval_every"):
        load_config(None, [f"train.eval_every={value}"])


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_eval_every_range_check_names_the_field_with_an_example(value):
    with pytest.raises(ConfigError, match=r"train.eval_every .*must be an integer >= 1, e.g. 2, got"):
        Config(train=TrainConfig(eval_every=value)).validate()
    assert load_config(None, ["train.eval_every=3"]).train.eval_every == 3
    assert load_config(None, []).train.eval_every == 1
