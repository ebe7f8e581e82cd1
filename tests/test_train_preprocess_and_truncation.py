"""End to end through train(): model.vision.resize_mode reaches the saved preprocess.json and the image cache, and captions
cut by model.text.max_length are counted (result, epoch rows) and reported in one line each for train and eval."""
import json

import pytest
import yaml

from clip_mini.model import text as text_mod
from clip_mini.config import load_config
from clip_mini.train import train
from conftest import NARROW, tiny_sets

TINY = tiny_sets(NARROW) + ["model.text.vocab_size=120", "data.val=40", "train.batch_size=16", "train.threads=1",
                            "train.eval_batch_size=64", "train.epochs=2"]
TINY += ["train.device=cpu"]   # bit-exact checks are a CPU property: pinned there on a GPU host too


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=120, seed=0, size=32)


def test_resize_mode_and_truncation_flow_through_training(shapes, tmp_path, capsys, monkeypatch):
    import clip_mini

    monkeypatch.setattr(text_mod, "_reported", set())
    run, cache = tmp_path / "run", tmp_path / "cache"
    cfg = load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}", f"data.cache_dir={cache}",
                                    f"train.out_dir={run}", "model.vision.resize_mode=center_crop",
                                    "model.text.max_length=5"])
    result = train(cfg)
    out = capsys.readouterr().out

    # resize_mode: the saved model, the config and the cache folders (eval 32 px, training 64 px records)
    assert json.loads((run / "final" / "preprocess.json").read_text())["resize_mode"] == "center_crop"
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["vision"]["resize_mode"] == "center_crop"
    assert clip_mini.load(run / "final").transform.base == (32, "center_crop")
    assert sorted(p.name for p in cache.iterdir()) == ["images-center_crop-32-v2", "images-center_crop-64-v2"]

    # truncation: shapes captions ("a small red circle at the top left") are longer than 5 tokens
    train_lines = [line for line in out.splitlines() if "train captions are longer" in line]
    eval_lines = [line for line in out.splitlines() if "evaluation captions are longer" in line]
    assert len(train_lines) == 1 and len(eval_lines) == 1          # three evaluations, one line
    assert result["truncated_captions"] > 0 and f"text: {result['truncated_captions']} of " in train_lines[0]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert len(epochs) == 3 and all(r["val_truncated_captions"] > 0 for r in epochs)
