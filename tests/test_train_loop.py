"""End-to-end training on generated shapes: it learns, writes a complete run directory, resumes bit-exactly
(after a pause or a SIGKILL at a random point), and never applies a non-finite update."""
import json
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
from clip_mini.config import load_config
from clip_mini.model import read_manifest
from clip_mini.train import TrainError, train
from clip_mini.train.checkpoint import load_checkpoint, read_index

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.vision.image_size=32", "model.vision.patch_size=8", "model.vision.width=48", "model.vision.depth=1",
        "model.vision.heads=2", "model.text.dim=32", "model.text.n_layers=1", "model.text.n_heads=2",
        "model.text.hidden_dim=64", "model.text.vocab_size=120", "model.text.max_length=16", "model.embed_dim=32",
        "data.val=40", "data.scale_min=0.9", "train.batch_size=16", "train.lr=2e-3", "train.warmup_steps=3",
        "train.log_every=1", "train.threads=1", "train.eval_batch_size=64"]


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
    result = train(_cfg(shapes, run, "train.epochs=6", "train.keep_checkpoints=2"))
    epochs = [r for r in _rows(run) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(7))   # epoch 0 = the untrained model
    untrained, best = epochs[0], max(epochs[1:], key=lambda r: r["val_t2i_r1"])
    assert best["val_rsum"] > untrained["val_rsum"] + 0.5
    assert best["val_t2i_r1"] > untrained["val_t2i_r1"] and epochs[-1]["val_loss"] < untrained["val_loss"]
    steps = [r for r in _rows(run) if r["kind"] == "step"]
    assert {"loss", "lr", "logit_scale", "pairs_per_s", "data_wait"} <= steps[0].keys()
    assert result["best_value"] == pytest.approx(best["val_t2i_r1"]) and not result["stopped"]
    for name in ("config.yaml", "curves.png", "tokenizer/tokenizer.json"):
        assert (run / name).is_file(), name
    assert load_config(run / "config.yaml") == _cfg(shapes, run, "train.epochs=6", "train.keep_checkpoints=2")
    assert len(list((run / "checkpoints").glob("ckpt-*.pt"))) == 2
    for d in ("best", "final"):
        read_manifest(run / d, verify=True)
        emb = clip_mini.load(run / d)
        feats = emb.encode_text(["a red circle", "a blue square"])
        assert feats.shape == (2, 32)
    cfg_json = json.loads((run / "best" / "config.json").read_text())
    assert cfg_json["trained"]["val"]["t2i_r1"] == pytest.approx(best["val_t2i_r1"])


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
    strip = [{k: v for k, v in r.items() if k not in ("pairs_per_s", "data_wait", "time_s")} for r in _rows(run)]
    assert strip == [{k: v for k, v in r.items() if k not in ("pairs_per_s", "data_wait", "time_s")}
                     for r in _rows(tmp_path / "ref")]


def test_fresh_run_refuses_a_folder_with_checkpoints(shapes, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes, run, "train.epochs=1", "train.max_steps=2"), stop_after=1)
    with pytest.raises(TrainError, match="--resume auto"):
        train(_cfg(shapes, run, "train.epochs=1", "train.max_steps=2"))


def test_non_finite_steps_are_skipped_then_training_stops(shapes, tmp_path, monkeypatch):
    import clip_mini.loss as loss_mod

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
    for trial in range(2):
        run = tmp_path / f"killed{trial}"
        proc = subprocess.Popen(_cli(shapes, run, extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while not (run / "checkpoints" / "latest.json").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))   # somewhere in the steps, evaluations and checkpoint writes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Whatever the kill interrupted, everything that looks complete is complete.
        index = read_index(run / "checkpoints")
        for name in index["files"]:
            load_checkpoint(run / "checkpoints" / name)
        for d in ("best", "final"):
            if (run / d).exists():
                read_manifest(run / d, verify=True)
        done = subprocess.run(_cli(shapes, run, extra, resume=True), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        _assert_same_weights(ref, _weights(run))


@pytest.mark.slow
def test_torchrun_two_processes_trains_and_only_rank0_writes(shapes, tmp_path):
    run = tmp_path / "ddp"
    cmd = _cli(shapes, run, ["train.epochs=1", "train.batch_size=8"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + cmd[1:]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout and done.stdout.count("train: ") == 1   # rank 0 alone prints
    rows = _rows(run)
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [0, 1]
    # 160 train images, 8 per process and step, 2 processes: 10 steps, each logged once.
    assert [r["step"] for r in rows if r["kind"] == "step"] == list(range(1, 11))
    read_manifest(run / "final", verify=True)
