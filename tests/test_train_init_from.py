"""train.init_from: a run starts from a saved model directory (weights, tokenizer, preprocessing) and trains on
new captions; its epoch-0 validation equals that model's ``clip-mini eval`` of the same split."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clip_mini.config import ConfigError, load_config
from clip_mini.eval.scoring import evaluate_retrieval
from clip_mini.train import train
from conftest import tiny_sets

MODEL = tiny_sets() + ["model.text.vocab_size=120"]
TRAIN = ["data.val=40", "data.workers=0", "train.batch_size=16", "train.lr=2e-3", "train.warmup_steps=3",
         "train.log_every=5", "train.threads=1", "train.eval_batch_size=64"]
KEYS = ("t2i_r1", "t2i_r5", "t2i_r10", "i2t_r1", "i2t_r5", "i2t_r10", "t2i_medr", "i2t_medr", "rsum")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from clip_mini.data import generate

    root = tmp_path_factory.mktemp("data")
    # the first model's data, and other images with other captions to fine-tune on
    return generate(root / "first", n=200, seed=0, size=32), generate(root / "new", n=200, seed=5, size=32)


@pytest.fixture(scope="module")
def start(data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "first"
    train(load_config(None, MODEL + TRAIN + [f"data.captions={data[0] / 'captions.csv'}",
                                             f"data.cache_dir={data[0].parent / 'cache'}", f"train.out_dir={run}",
                                             "train.epochs=2"]))
    return run / "final"


def _sets(data_dir: Path, run: Path, start: Path, *extra) -> list[str]:
    return TRAIN + [f"data.captions={data_dir / 'captions.csv'}", f"data.cache_dir={data_dir.parent / 'cache'}",
                    f"train.out_dir={run}", f"train.init_from={start}", *extra]


def test_epoch0_equals_the_eval_of_the_model_it_starts_from_then_it_trains(data, start, tmp_path):
    run = tmp_path / "tuned"
    cfg = load_config(None, _sets(data[1], run, start, "train.epochs=1"))   # no model section: the directory's
    assert cfg.model.vision.width == 64 and cfg.model.text.vocab_size == 120
    train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epoch0 = next(r for r in rows if r["kind"] == "epoch" and r["epoch"] == 0)
    want = evaluate_retrieval(start, run / "config.yaml", split="val", progress=False)   # clip-mini eval's numbers
    for k in KEYS:
        assert epoch0[f"val_{k}"] == pytest.approx(want[k], abs=1e-9), k
    assert epoch0["val_loss"] == pytest.approx(want["loss"], rel=1e-5)
    # its tokenizer and preprocessing are the starting model's, its weights moved on from them
    from clip_mini.model.text import load_tokenizer

    assert load_tokenizer(run / "tokenizer").get_vocab() == load_tokenizer(start).get_vocab()
    assert json.loads((run / "final" / "preprocess.json").read_text()) == \
        json.loads((start / "preprocess.json").read_text())
    a, b = load_file(str(start / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)


def test_model_section_must_match_the_directory(data, start, tmp_path):
    sets = _sets(data[1], tmp_path / "x", start)
    cfg = load_config(None, MODEL + sets)   # the same section: fine
    assert cfg.model == load_config(None, sets).model
    assert load_config(None, sets + ["model.text.dropout=0.1"]).model.text.dropout == 0.1   # a training setting
    with pytest.raises(ConfigError, match=r"model\.vision\.width is 128 here but 64 in train.init_from"):
        load_config(None, MODEL + sets + ["model.vision.width=128"])
    with pytest.raises(ConfigError, match=r"model\.embed_dim"):
        load_config(None, sets + ["model.embed_dim=16"])
    with pytest.raises(ConfigError, match="train.init_from: .* is not a model directory"):
        load_config(None, _sets(data[1], tmp_path / "x", tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="resize_mode"):
        train(load_config(None, sets + ["data.resize_mode=center_crop"]))
