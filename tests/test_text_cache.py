"""A locked text tower is run once per distinct caption (clip_mini.train.text_cache): training on the stored rows
is the same computation as running the tower at every step."""
from __future__ import annotations

import json

import pytest
import torch

from clip_mini.config import TextConfig
from clip_mini.model.clip import CLIPModel
from clip_mini.train import text_cache
from conftest import TINY, tiny_model_config, tiny_sets


def _model():
    torch.manual_seed(0)
    cfg = tiny_model_config(text={**TINY["text"], "dropout": 0.1, "trainable": False})   # dropout on in training
    from clip_mini.model.text import build_tokenizer

    caps = ["a red circle", "a big blue square on the left", "a green triangle", "a red circle"]
    tok = build_tokenizer(TextConfig(vocab_size=60), caps)
    return CLIPModel(cfg, vocab_size=len(tok), pad_token_id=tok.pad_token_id, tokenizer=tok), caps


def _locked_text_config(shapes, out_dir):
    """A tiny model with a locked from-scratch text tower, trained on generated shapes."""
    from clip_mini.config import load_config

    return load_config(None, tiny_sets() + [
        "model.text.trainable=false", "data.val=8", "train.device=cpu",
        "train.batch_size=8", "train.epochs=2", "train.threads=1", "train.log_every=1",
        "train.precision=fp32", f"data.captions={shapes / 'captions.csv'}", f"train.out_dir={out_dir}"])


def test_rows_are_the_eval_mode_tower_output_per_distinct_caption():
    model, caps = _model()
    model.train()   # dropout on: the rows must still be the eval-mode output, and training mode restored
    index, rows = text_cache.text_tower_rows(model, caps, 2, torch.device("cpu"), "fp32", progress=False)
    assert len(index) == 3 and rows.shape == (3, model.text.width) and model.text.training
    model.eval()
    tok = model.tokenize(caps)
    with torch.no_grad():
        want = model.text(tok["input_ids"], tok["attention_mask"])
    got = rows[[index[c] for c in caps]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_training_on_stored_rows_equals_running_the_tower(tmp_path, monkeypatch):
    from clip_mini.data import generate
    from clip_mini.train import train

    shapes = generate(tmp_path / "shapes", n=48, seed=0, size=32)

    def run(name):
        result = train(_locked_text_config(shapes, tmp_path / name))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return result, [r["loss"] for r in rows if r["kind"] == "step"]

    cached, cached_losses = run("cached")
    assert "text_pass_s" in cached["time_breakdown"]
    monkeypatch.setattr(text_cache, "wanted", lambda cfg: False)
    plain, plain_losses = run("plain")
    assert "text_pass_s" not in plain["time_breakdown"]
    assert len(cached_losses) == len(plain_losses) >= 8
    assert cached_losses == pytest.approx(plain_losses, abs=1e-5)


def test_rows_are_stored_and_read_back_under_a_key(tmp_path, monkeypatch):
    model, caps = _model()
    path = tmp_path / "frozen_features" / "text-tower.safetensors"
    cpu = torch.device("cpu")
    index, rows = text_cache.load_or_compute_rows(model, caps, 2, cpu, "fp32", path, progress=False)
    assert path.is_file()
    calls = []
    real = text_cache.text_tower_rows
    monkeypatch.setattr(text_cache, "text_tower_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    again_index, again = text_cache.load_or_compute_rows(model, caps, 2, cpu, "fp32", path, progress=False)
    assert calls == [] and again_index == index and torch.equal(again, rows)   # read, not recomputed

    # anything the rows depend on changed: computed again (and the file replaced)
    text_cache.load_or_compute_rows(model, caps + ["a new caption"], 2, cpu, "fp32", path, progress=False)
    assert len(calls) == 1
    text_cache.load_or_compute_rows(model, caps, 2, cpu, "bf16", path, progress=False)
    assert len(calls) == 2
    with torch.no_grad():
        next(model.text.parameters()).add_(1.0)
    _, changed = text_cache.load_or_compute_rows(model, caps, 2, cpu, "fp32", path, progress=False)
    assert len(calls) == 3 and not torch.equal(changed, rows)
    # a damaged file is a cache miss, never an error
    path.write_bytes(b"not a safetensors file")
    text_cache.load_or_compute_rows(model, caps, 2, cpu, "fp32", path, progress=False)
    assert len(calls) == 4
    _, read = text_cache.load_or_compute_rows(model, caps, 2, cpu, "fp32", path, progress=False)
    assert len(calls) == 4 and torch.equal(read, changed)


def test_a_resumed_run_reads_the_stored_rows(tmp_path, monkeypatch):
    from clip_mini.data import generate
    from clip_mini.train import train

    shapes = generate(tmp_path / "shapes", n=48, seed=0, size=32)
    cfg = _locked_text_config(shapes, tmp_path / "run")
    train(cfg, stop_after=3)
    assert (tmp_path / "run" / "frozen_features" / "text-tower.safetensors").is_file()

    def no_tower(*a, **k):
        raise AssertionError("the locked text tower ran again on resume")

    monkeypatch.setattr(text_cache, "text_tower_rows", no_tower)
    result = train(cfg, resume="auto")
    assert result["time_breakdown"]["text_pass_s"] < 5
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if r["kind"] == "step") > 3
