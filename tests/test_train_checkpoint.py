"""Checkpoints: weights_only round trip, RNG state, rotation, checksums, truncated and corrupt files."""
import json
import random

import numpy as np
import pytest
import torch

from clip_mini.train.checkpoint import (INDEX, CheckpointError, find_latest, load_checkpoint, read_index,
                                        resolve_resume, rng_state, save_checkpoint, set_rng_state)


def _state(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"step": step, "epoch": 0, "pos": step, "best": None, "bad_steps": 0, "epoch_loss": [1.5, 2],
            "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(),
            "config": {"train": {"lr": 1e-3, "betas": (0.9, 0.98)}}, "total_steps": 10}


def test_round_trip_loads_with_weights_only(tmp_path):
    state = _state(3)
    path = save_checkpoint(tmp_path, state, keep=2)
    assert path.name == "ckpt-3.pt"
    raw = torch.load(path, map_location="cpu", weights_only=True)   # no pickle of arbitrary objects
    assert raw["step"] == 3
    loaded = load_checkpoint(path)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert loaded["optimizer"]["state"][0]["exp_avg"].shape == (3, 4)
    assert loaded["config"]["train"]["betas"] == (0.9, 0.98)


def test_rng_state_restores_every_generator():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    saved = rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    set_rng_state(saved)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_rotation_keeps_the_newest_k_and_the_index_lists_them(tmp_path):
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, _state(step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-6.pt", "ckpt-8.pt"]
    index = read_index(tmp_path)
    assert index["latest"] == "ckpt-8.pt" and set(index["files"]) == {"ckpt-6.pt", "ckpt-8.pt"}
    assert find_latest(tmp_path).name == "ckpt-8.pt"
    assert not list(tmp_path.glob("*.tmp"))


def test_corrupt_checkpoint_is_refused_by_checksum(tmp_path):
    path = save_checkpoint(tmp_path, _state(5), keep=2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)


def test_truncated_checkpoint_gives_a_clear_error(tmp_path):
    path = save_checkpoint(tmp_path, _state(5), keep=2)
    (tmp_path / INDEX).unlink()   # no checksum to compare with: the loader itself must notice
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="ckpt-5.pt.*not a readable checkpoint"):
        load_checkpoint(path)


def test_foreign_file_is_not_taken_for_a_checkpoint(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="not a clip_mini training checkpoint"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_auto_resume_skips_a_damaged_newest_checkpoint(tmp_path):
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(ckpts, _state(2), keep=3)
    newest = save_checkpoint(ckpts, _state(4), keep=3)
    newest.write_bytes(newest.read_bytes()[:-10])
    with pytest.warns(RuntimeWarning, match="ckpt-4.pt"):
        assert resolve_resume("auto", tmp_path).name == "ckpt-2.pt"
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path / "elsewhere") is None   # nothing yet: a fresh start
    with pytest.raises(CheckpointError, match="not found"):
        resolve_resume(str(tmp_path / "nope.pt"), tmp_path)


def test_bad_index_is_reported(tmp_path):
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="latest.json"):
        read_index(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="not a clip_mini checkpoint index"):
        read_index(tmp_path)
