"""Precomputed locked-tower features (train.frozen_features): the stored rows are the tower's outputs, views are
reproducible and rotate by epoch, the store is reused or recomputed as its inputs say, and a run trained on
them learns and resumes bit-exactly."""
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clip_mini.config import ConfigError, load_config
from clip_mini.data import build_eval_transform, load_image
from clip_mini.train import frozen as frozen_io
from clip_mini.train import train
from clip_mini.train.build import build_model
from clip_mini.train.inputs import load_splits

from test_train_loop import TINY, _assert_same_weights, _rows, _weights, shapes  # noqa: F401 (fixture)

LOCKED = ["model.vision.trainable=false", "data.workers=0"]


def _cfg(shapes, out, *extra):
    return load_config(None, TINY + LOCKED + [f"data.captions={shapes / 'captions.csv'}",
                                              f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}",
                                              *extra])


def _model(cfg, run: Path):
    from clip_mini.train.build import save_tokenizer

    splits = load_splits(cfg, progress=False)
    save_tokenizer(cfg, splits["train"]["caption"].tolist(), run / "tokenizer")
    torch.manual_seed(0)
    return build_model(cfg, run / "tokenizer"), splits


def test_stored_rows_are_the_tower_outputs_and_views_are_reproducible(shapes, tmp_path):
    cfg = _cfg(shapes, tmp_path / "run", "train.frozen_features=3", "train.precision=fp32")
    model, splits = _model(cfg, tmp_path / "run")
    feats = frozen_io.prepare(model, cfg, splits, tmp_path / "run", None, torch.device("cpu"), True, lambda: None)
    train_feats, ok = feats["train"]
    paths = frozen_io.split_paths(splits["train"])
    assert train_feats.shape == (3, len(paths), model.visual.width) and bool(ok.all())
    # view 0 = the eval transform through the tower, image by image
    transform = build_eval_transform(model.preprocess)
    with torch.inference_mode():
        direct = model.visual(torch.stack([transform(load_image(p)) for p in paths[:5]]))
    torch.testing.assert_close(train_feats[0, :5], direct, rtol=1e-4, atol=1e-5)
    # views 1 and 2 are augmented (differ from view 0 and from each other) ...
    assert not torch.allclose(train_feats[1], train_feats[0]) and not torch.allclose(train_feats[2], train_feats[1])
    # ... and reproducible: computing them afresh gives the same rows
    again = tmp_path / "again"
    (again / "tokenizer").mkdir(parents=True)
    feats2 = frozen_io.prepare(model, cfg, splits, again, None, torch.device("cpu"), True, lambda: None)
    assert torch.equal(feats2["train"][0], train_feats)
    # the dataset picks view epoch % views
    ds = frozen_io.FrozenFeatureDataset(splits["train"], train_feats, ok)
    row = splits["train"].iloc[7]
    for epoch in (0, 1, 2, 4):
        ds.epoch = epoch
        vec, caption, image = ds[7]
        assert caption == row["caption"] and image == row["image_id"]
        assert torch.equal(vec, train_feats[epoch % 3, row["image_id"]])


def test_store_is_reused_and_recomputed_when_an_image_changes(shapes, tmp_path, monkeypatch):
    cfg = _cfg(shapes, tmp_path / "run", "train.frozen_features=1")
    run = tmp_path / "run"
    model, splits = _model(cfg, run)
    device = torch.device("cpu")
    first = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    store = run / "frozen_features" / "val-view0.safetensors"
    assert store.is_file()
    calls = []
    real = frozen_io.compute_view
    monkeypatch.setattr(frozen_io, "compute_view", lambda m, d, view, *a, **k: calls.append(view) or
                        real(m, d, view, *a, **k))
    again = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    assert calls == [] and torch.equal(again[0], first[0])
    # more views: view 0 is reused, only the new (augmented) ones are computed
    from clip_mini.data import build_train_transform
    from clip_mini.train.inputs import SeededAugment

    augment = SeededAugment(build_train_transform(model.preprocess, cfg.data))
    three = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 3, run, None, device, augment)
    assert calls == [1, 2] and three[0].shape[0] == 3 and torch.equal(three[0][0], first[0][0])
    calls.clear()
    # the same bytes with a new mtime (a fresh checkout, restored files) keep the store; edited bytes invalidate it
    path = frozen_io.split_paths(splits["val"])[0]
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    assert calls == []
    original = Path(path).read_bytes()
    try:
        with Image.open(path) as im:
            edited = im.convert("RGB")
        edited.putpixel((0, 0), tuple(255 - c for c in edited.getpixel((0, 0))))
        edited.save(path, format=Image.open(io.BytesIO(original)).format)
        frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    finally:
        Path(path).write_bytes(original)
    assert calls == [0]
    # other tower weights invalidate it too; a damaged store is recomputed, not trusted
    with torch.no_grad():
        next(model.visual.parameters()).add_(1.0)
    changed = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    assert calls == [0, 0] and not torch.allclose(changed[0], first[0])
    store.write_bytes(store.read_bytes()[:100])
    frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    assert calls == [0, 0, 0]


def test_unreadable_image_rows_are_replaced_by_a_readable_pair(shapes, tmp_path):
    cfg = _cfg(shapes, tmp_path / "run")
    splits = load_splits(cfg, progress=False)
    df = splits["train"]
    n = df["image_id"].nunique()
    feats, ok = torch.randn(1, n, 4), torch.ones(n, dtype=torch.bool)
    bad = int(df.iloc[3]["image_id"])
    ok[bad] = False
    ds = frozen_io.FrozenFeatureDataset(df, feats, ok)
    j = next(k for k in range(4, len(df)) if int(df.iloc[k]["image_id"]) != bad)   # the next readable row
    vec, caption, image = ds[3]
    assert (caption, image) == (df.iloc[j]["caption"], int(df.iloc[j]["image_id"]))
    assert torch.equal(vec, feats[0, image])


def test_a_trainable_tower_cannot_use_precomputed_features(shapes, tmp_path):
    cfg = load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}", f"train.out_dir={tmp_path}",
                                    "train.frozen_features=1"])
    with pytest.raises(ConfigError, match="train.frozen_features needs a locked image tower"):
        train(cfg)
    with pytest.raises(ConfigError, match="train.frozen_features must be >= 0"):
        load_config(None, ["train.frozen_features=-1"])


def test_training_on_precomputed_features_learns_and_resumes_bitwise(shapes, tmp_path):
    # bf16, as configs/flickr8k.yaml runs it: the store holds bf16 rows and the steps run under autocast.
    extra = ["train.frozen_features=2", "train.epochs=2", "train.accum_freq=2", "train.batch_size=8",
             "train.checkpoint_every=2", "model.text.dropout=0.1", "model.head_dropout=0.1", "train.precision=bf16"]
    ref = train(_cfg(shapes, tmp_path / "ref", *extra))
    assert ref["step"] == 20
    rows = [r for r in _rows(tmp_path / "ref") if r["kind"] == "epoch"]
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]   # the heads and the text tower learnt against the locked tower
    assert (tmp_path / "ref" / "frozen_features" / "train-view1.safetensors").is_file()
    run = tmp_path / "paused"
    assert train(_cfg(shapes, run, *extra), stop_after=3)["stopped"]
    train(_cfg(shapes, run, *extra), resume="auto")
    _assert_same_weights(_weights(tmp_path / "ref"), _weights(run))
    # the saved model embeds images through the (locked) tower: its image side matches the precomputed path
    from clip_mini.model.clip import CLIPModel

    model = CLIPModel.from_pretrained(run / "final").eval()
    feats = frozen_io.load_or_compute(model, _cfg(shapes, run, *extra), load_splits(_cfg(shapes, run, *extra),
                                      progress=False)["val"], "val", 1, run, None, torch.device("cpu"))
    paths = frozen_io.split_paths(load_splits(_cfg(shapes, run, *extra), progress=False)["val"])
    transform = build_eval_transform(model.preprocess)
    assert feats[0].dtype == torch.bfloat16   # the store really is bf16
    with torch.inference_mode():
        pixels = torch.stack([transform(load_image(p)) for p in paths[:4]])
        tower = model.visual(pixels)                  # the saved model's fp32 path
        direct = model.encode_image(pixels)
        via = model.project_image(feats[0][0, :4].float())
    # bf16 store (autocast tower, rounded to 8 mantissa bits) vs the fp32 tower: bf16 rounding apart ...
    stored = feats[0][0, :4].float()
    assert not torch.equal(stored, tower)
    torch.testing.assert_close(stored, tower, rtol=2e-2, atol=2e-2)
    # ... and the same embedding after the head
    torch.testing.assert_close(via, direct, rtol=2e-2, atol=2e-2)
    assert np.isfinite(rows[-1]["val_rsum"])


def test_bf16_eval_view_reads_pixels_straight_in_bf16_with_the_same_rows(shapes, tmp_path):
    """Under bf16 the eval view's loader normalises to bf16 (channels-last, ``collate_images``); the rows are
    bitwise those of the float32 pixels through the same bf16 tower, and the augmented view still runs."""
    cfg = _cfg(shapes, tmp_path / "run", "train.frozen_features=2", "train.precision=bf16")
    model, splits = _model(cfg, tmp_path / "run")
    feats = frozen_io.prepare(model, cfg, splits, tmp_path / "run", None, torch.device("cpu"), True, lambda: None)
    train_feats, ok = feats["train"]
    paths = frozen_io.split_paths(splits["train"])
    assert train_feats.dtype == torch.bfloat16 and bool(ok.all())
    tower = frozen_io.TowerPass(model, "bf16")
    assert tower.input_dtype == torch.bfloat16
    transform = build_eval_transform(model.preprocess)
    with torch.inference_mode():
        direct = tower(torch.stack([transform(load_image(p)) for p in paths[:6]]), torch.device("cpu"))
    assert torch.equal(train_feats[0, :6], direct)
    assert not torch.equal(train_feats[1], train_feats[0])
