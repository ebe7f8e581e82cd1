"""train.budget: duration parsing, the fit, and budget runs on generated shapes: within the budget, the cosine at
its minimum on the last step, a paused run resuming to the weights of an unpaused one with the same plan."""
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clip_mini.config import ConfigError, load_config, parse_duration
from clip_mini.train import train
from clip_mini.train.budget import BudgetError, fit_epochs, fit_schedule, fit_steps, timed_steps
from clip_mini.train.checkpoint import load_checkpoint, resolve_resume
from conftest import tiny_sets

TINY = tiny_sets() + [
    "model.text.vocab_size=120", "data.val=60", "data.scale_min=0.9", "data.workers=0", "train.batch_size=32",
    "train.lr=2e-3", "train.min_lr_ratio=0.1", "train.log_every=10", "train.threads=1", "train.eval_batch_size=64"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=1200, seed=0, size=32)


def _cfg(shapes, out, *extra):
    return load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}",
                                     f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}", *extra])


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_durations_parse_and_bad_ones_name_the_field():
    assert parse_duration("30m") == 1800 and parse_duration("90s") == 90 and parse_duration("1.5h") == 5400
    assert parse_duration(45) == 45 and parse_duration("2 min") == 120
    assert load_config(None, ["train.budget=90s"]).train.budget == 90.0   # parsed once, at load: seconds
    for bad in ("ten", "", "-3m", "0s", "3d", "1.5.2h"):
        with pytest.raises(ConfigError, match="train.budget"):
            load_config(None, [f"train.budget={bad}"])


def test_fit_steps_cuts_the_last_epoch_short_to_use_the_budget():
    # 10 steps/epoch of 1 s, 5 s per evaluation, 6 steps done: 6 whole epochs (84 s) leave 13 s of the 97 usable;
    # steps 61-68 and their evaluation fit in them
    assert fit_steps(100, 1.0, 5.0, 10, 6) == 68
    assert fit_schedule("steps", 100, 1.0, 5.0, 10, 6) == (7, 68)
    assert fit_schedule("epochs", 100, 1.0, 5.0, 10, 6) == (6, None)
    for left in (20, 50, 100, 400, 5000):
        s = fit_steps(left, 1.0, 5.0, 10, 6)
        evals = -(-s // 10)   # every epoch that ends and the cut last one
        assert (s - 6) * 1.0 + evals * 5.0 <= 0.97 * left
        assert (s + 1 - 6) * 1.0 + -(-(s + 1) // 10) * 5.0 > 0.97 * left   # one step more would not fit
        assert s >= 10 * fit_epochs(left, 1.0, 5.0, 10, 6) or left < 20
    assert fit_steps(-30, 1.0, 5.0, 10, 6) == 7   # nothing fits: one step more, then stop
    assert fit_epochs(-30, 1.0, 5.0, 10, 25) == 3
    assert timed_steps(100) == 50 and timed_steps(20) == 20 and timed_steps(0) == 7


@pytest.mark.slow
def test_budget_run_ends_within_its_budget_with_the_cosine_at_its_minimum(shapes, tmp_path):
    # 20 s (was 30): the fit's margins (TARGET, EXIT_SHARE) scale with the budget, so a run ends the same share of it
    # early (~4%, measured: 19.2 s); the bounds below stay relative to the budget
    budget = 20.0
    run = tmp_path / "run"
    started = time.time()
    result = train(_cfg(shapes, run, "train.budget=20s", "train.warmup_steps=20"), started=started)
    wall = time.time() - started
    # On a machine busy with other work the step time moves under the fit (it follows, with a lag): the 10% bound
    # is checked when this run had the cores to itself, a coarser one otherwise
    quiet = os.getloadavg()[0] <= (os.cpu_count() or 1) + 0.5
    assert abs(wall - budget) <= (0.1 if quiet else 0.25) * budget, (wall, quiet, result["budget"])
    plan = result["budget"]
    assert plan["fitted"] and plan["total"] == result["step"] and plan["step_s"] > 0
    assert result["epoch"] == math.ceil(plan["total"] / plan["steps_per_epoch"])   # the cut last epoch ends too
    steps = [r for r in _rows(run) if r["kind"] == "step"]
    assert steps[-1]["step"] == plan["total"]
    # the learning rate the last step ran at is the schedule's minimum: min_lr_ratio x train.lr
    assert steps[-1]["lr"] == pytest.approx(0.1 * 2e-3, rel=1e-6)
    assert all(r["lr"] > 0.1 * 2e-3 * (1 + 1e-6) for r in steps[:-1])
    epochs = [r for r in _rows(run) if r["kind"] == "epoch"]
    assert epochs[-1]["step"] == plan["total"] and (run / "final" / "model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())["budget"]["total"] == plan["total"]


@pytest.mark.slow
def test_paused_budget_run_resumes_to_the_weights_of_an_unpaused_one(shapes, tmp_path):
    # The plan is fitted by step 10, inside the 10-step warmup. The learning rate of steps 0-10 does not depend on
    # the schedule's length (warmup, then the cosine's start), so fits up to then change nothing already applied;
    # the run pauses at 11, and the resumed run keeps the stored plan: it ends at the weights of a run given that
    # many steps from the start, with no budget. A fit before step 10 (TIMED_SHARE: slow first steps, e.g. when
    # this run fills the image cache) keeps that true only while the plan has at least 4 x 10 steps, else the
    # warm-up is cut to a quarter of the run (schedule.WARMUP_SHARE) and the reference's differs.
    # 15 s and a 10-step warmup (were 20 s and 20 steps, 43 s of test): plans of ~200-400 steps here, 40 needed;
    # 10 s with 20 steps was too tight (a cold cache left 70 steps, under the 80 needed).
    warmup = 10
    budget = ["train.budget=15s", f"train.warmup_steps={warmup}"]
    run = tmp_path / "paused"
    assert train(_cfg(shapes, run, *budget), stop_after=warmup + 1)["stopped"]
    plan = load_checkpoint(resolve_resume("auto", run))["budget"]
    assert plan["fitted"] and all(f["at_step"] <= warmup + 1 for f in plan["fits"]) and plan["total"] > warmup + 1
    time.sleep(2)   # a resume is not timed again: the plan stays as it was
    resumed = train(_cfg(shapes, run, *budget), resume="auto")
    assert resumed["step"] == plan["total"] and resumed["budget"]["fits"] == plan["fits"]
    ref = tmp_path / "ref"
    spe = plan["steps_per_epoch"]
    train(_cfg(shapes, ref, f"train.warmup_steps={warmup}", f"train.epochs={math.ceil(plan['total'] / spe)}",
               f"train.max_steps={plan['total']}"))
    a, b = (load_file(str(r / "final" / "model.safetensors")) for r in (run, ref))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_one_time_projection_decides_by_the_rate_not_by_a_deadline_already_past():
    from clip_mini.train.budget import _check_projection

    now = time.time()
    # 10 of 1000 images in 1 s: about 99 s more. A deadline 200 s away leaves room; one 50 s away does not.
    _check_projection("filling the image cache", 10, 1000, 1.0, now + 200, 300, "use data.cache: false")
    with pytest.raises(BudgetError, match=r"filling the image cache alone would take about 100 s .*1000 images at "
                                          r"10\.0/s.*use data.cache: false, or raise train.budget"):
        _check_projection("filling the image cache", 10, 1000, 1.0, now + 50, 300, "use data.cache: false")
    # at 100 images/s the same 1000 fit in 50 s
    _check_projection("filling the image cache", 100, 1000, 1.0, now + 50, 300, "use data.cache: false")


def test_one_time_work_over_the_budget_stops_before_training(shapes, tmp_path, monkeypatch):
    import clip_mini.train.budget as budget_mod
    from clip_mini.data import ImageDataset

    seen = []
    plain = budget_mod._check_projection

    def spy(what, done, total, seconds, deadline, *rest):
        seen.append((what, done, total, deadline - time.time()))
        return plain(what, done, total, seconds, deadline, *rest)
    monkeypatch.setattr(budget_mod, "_check_projection", spy)
    # decoding at a crawl (30 ms an image): 1200 images need far more than the budget leaves, though the deadline
    # is still ahead when the fill starts
    get = ImageDataset.__getitem__
    monkeypatch.setattr(ImageDataset, "__getitem__", lambda self, i: time.sleep(0.03) or get(self, i))
    run = tmp_path / "run"
    with pytest.raises(BudgetError, match=r"filling the image cache alone would take about .*raise train.budget"):
        train(_cfg(shapes, run, "train.budget=15s", f"data.cache_dir={tmp_path / 'cold-cache'}"),
              started=time.time())
    what, done, total, left = seen[0]
    assert what == "filling the image cache" and 0 < done < total == 1200 and left > 0
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("ckpt-*.pt"))


@pytest.mark.slow
def test_a_run_that_slows_down_stops_at_the_hard_deadline(shapes, tmp_path, monkeypatch, capsys):
    """Steps turn 0.25 s slower after the fit and the run never re-fits: without the hard stop it would overrun by
    about its remaining steps' extra time; with it, it ends within its budget plus the timing noise of its end."""
    import clip_mini.train.loop as loop
    from clip_mini.train.budget import Budget

    monkeypatch.setattr(Budget, "off_course", lambda self, step, total: False)
    plain = loop.forward_backward

    def slow_after_fit(*a, **k):
        if loop_state["fitted"]:
            time.sleep(0.25)
        return plain(*a, **k)
    loop_state = {"fitted": False}
    fit = Budget.fit
    monkeypatch.setattr(Budget, "fit", lambda self, *a, **k: loop_state.update(fitted=True) or fit(self, *a, **k))
    monkeypatch.setattr(loop, "forward_backward", slow_after_fit)
    started = time.time()
    # 12 s (was 20), in batches of 16: 71 steps an epoch, whose end (~17 s in when slowed) would re-fit to the slower
    # steps; the deadline comes first (the fit at step 10, ~1 s in, plans hundreds of steps), so only the hard stop
    # can end the run early
    result = train(_cfg(shapes, tmp_path / "run", "train.budget=12s", "train.warmup_steps=10", "train.batch_size=16"),
                   started=started)
    wall = time.time() - started
    assert "budget: stopped at step" in capsys.readouterr().out
    fitted_total = result["budget"]["fits"][0]["total"]
    # without the stop: about (fitted_total - step) x 0.25 s late. The end's own noise is the bound: 10% when the
    # run had the cores to itself, coarser on a busy machine (as the budget test above)
    quiet = os.getloadavg()[0] <= (os.cpu_count() or 1) + 0.5
    assert result["step"] < fitted_total and wall <= 12 * (1.1 if quiet else 1.25), (wall, result["step"],
                                                                                      fitted_total)
    rows = [r for r in _rows(tmp_path / "run") if r["kind"] == "step"]
    assert rows[-1]["step"] == result["step"]
    assert rows[-1]["lr"] == pytest.approx(0.1 * 2e-3, rel=1e-6)   # the step before the stop ran at the minimum


def test_budget_and_init_from_flags_set_the_config_keys(capsys):
    from clip_mini.cli.train import main

    assert main(["--config", "configs/tiny.yaml", "--budget", "90s", "--print-config"]) == 0
    assert "budget: 90.0" in capsys.readouterr().out   # parsed once, when the config is loaded: seconds
    assert main(["--config", "configs/tiny.yaml", "--budget", "soon", "--print-config"]) == 2
    assert "train.budget must be a duration" in capsys.readouterr().err
    assert main(["--config", "configs/tiny.yaml", "--init-from", "no/such/model", "--print-config"]) == 0
    assert "init_from: no/such/model" in capsys.readouterr().out   # the model section given: checked at start
