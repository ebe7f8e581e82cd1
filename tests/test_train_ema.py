"""train.ema: the moving average of the weights is what a run evaluates and saves, it equals the average computed by
hand from the per-step weights, locked towers stay exact, and a paused run resumes it bit for bit."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clip_mini.config import ConfigError, load_config
from clip_mini.train import train
from clip_mini.train.checkpoint import load_checkpoint
from clip_mini.train.ema import averaged_keys, build_ema, ema_state, load_ema_state
from conftest import NARROW, tiny_sets

TINY = tiny_sets(NARROW) + [
    "model.text.vocab_size=120", "data.val=40", "data.scale_min=0.9", "train.batch_size=16", "train.lr=2e-3",
    "train.warmup_steps=2", "train.log_every=1", "train.threads=1", "train.eval_batch_size=64", "train.device=cpu"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=200, seed=0, size=32)


def _cfg(shapes, out, *extra):
    return load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}",
                                     f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}", *extra])


def _weights(run, d="final") -> dict:
    return load_file(str(Path(run) / d / "model.safetensors"))


def _rows(run) -> list[dict]:
    drop = ("pairs_per_s", "data_wait", "time_s", "eval_s")
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_final_model_is_the_average_of_the_step_weights_and_locked_towers_stay_exact(shapes, tmp_path):
    run, decay, steps = tmp_path / "run", 0.7, 4
    train(_cfg(shapes, run, "train.epochs=1", f"train.max_steps={steps}", f"train.ema={decay}",
               "train.checkpoint_every=1", "train.keep_checkpoints=10", "model.vision.trainable=false"))
    raw = [load_checkpoint(run / "checkpoints" / f"ckpt-{n}.pt") for n in range(1, steps + 1)]
    trained = list(raw[0]["ema"])
    assert trained and not any(k.startswith("visual.") for k in trained)   # a locked tower is not averaged
    # by hand: the first step's weights, then the running mean until the decay caps it (n=2: 1/2, n=3: 2/3, then 0.7)
    ema = {k: raw[0]["model"][k].clone() for k in trained}
    for n in range(2, steps + 1):
        d = min(decay, (n - 1) / n)
        for k in trained:
            ema[k] = torch.lerp(ema[k], raw[n - 1]["model"][k], 1 - d)
    final, last = _weights(run), raw[-1]["model"]
    assert final.keys() == last.keys()
    for k in trained:
        torch.testing.assert_close(final[k], ema[k], rtol=1e-6, atol=1e-7)
        assert torch.equal(raw[-1]["ema"][k], final[k]), k   # the checkpoint holds the same average
    assert any(not torch.equal(final[k], last[k]) for k in trained)   # not the last raw weights
    for k in final.keys() - set(trained):
        assert torch.equal(final[k], last[k]), k   # the locked image tower (and int buffers): exactly the model's
    epochs = [r for r in _rows(run) if r["kind"] == "epoch"]
    assert [r["ema"] for r in epochs] == [decay, decay]
    assert json.loads((run / "summary.json").read_text())["ema"] == decay
    assert json.loads((run / "final" / "config.json").read_text())["trained"]["ema"] == decay


def test_pause_and_resume_with_ema_is_bitwise_equal_to_an_uninterrupted_run(shapes, tmp_path):
    extra = ["train.epochs=2", "train.ema=0.9", "train.checkpoint_every=4", "model.text.dropout=0.1"]
    ref = train(_cfg(shapes, tmp_path / "ref", *extra))
    assert ref["step"] == 20 and ref["ema"] == 0.9   # 160 train images / 16 per step, two epochs
    run = tmp_path / "paused"
    assert train(_cfg(shapes, run, *extra), stop_after=3)["stopped"]                  # mid-epoch, off the grid
    assert train(_cfg(shapes, run, *extra), resume="auto", stop_after=13)["stopped"]   # into epoch 2
    train(_cfg(shapes, run, *extra), resume="auto")
    for d in ("final", "best"):
        a, b = _weights(tmp_path / "ref", d), _weights(run, d)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (d, k)   # bitwise
    assert _rows(run) == _rows(tmp_path / "ref")
    raw = load_checkpoint(run / "checkpoints" / "ckpt-20.pt")["model"]
    assert any(not torch.equal(_weights(run)[k], raw[k]) for k in raw)   # final/ is the average, not the model


def test_ema_state_round_trip_and_refusals():
    assert build_ema(torch.nn.Linear(2, 2), None) is None and build_ema(torch.nn.Linear(2, 2), 0.0) is None
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    assert averaged_keys(model) == ["1.weight", "1.bias", "1.running_mean", "1.running_var", "2.weight", "2.bias"]
    ema = build_ema(model, 0.5)
    with torch.no_grad():
        model[2].weight.add_(1.0)
    ema.update(model, step=2)   # decay min(0.5, 1/2): halfway
    torch.testing.assert_close(ema.module[2].weight, model[2].weight - 0.5)
    fresh = build_ema(model, 0.5)
    load_ema_state(fresh, model, ema_state(ema, model))
    assert torch.equal(fresh.module[2].weight, ema.module[2].weight)
    with pytest.raises(KeyError, match="2.bias"):
        load_ema_state(fresh, model, {k: v for k, v in ema_state(ema, model).items() if k != "2.bias"})


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "nan", "true", "fast"])
def test_ema_config_is_validated(value):
    with pytest.raises(ConfigError, match="train.ema"):
        load_config(None, [f"train.ema={value}"])
    assert load_config(None, ["train.ema=0.998"]).train.ema == 0.998
    assert load_config(None, ["train.ema=0"]).train.ema == 0.0 and load_config(None, []).train.ema is None
