"""Fine-tuning the last k ViT blocks on stored token states (model.vision.trainable_blocks with
train.frozen_features): prefix + suffix is the tower, only the last k blocks train, the store holds the prefix's
token states and is keyed on the locked weights only, evaluation runs the current blocks and equals the saved
model on pixels, and a run resumes bit-exactly."""
import json

import pytest
import torch

from clip_mini.config import ConfigError, VisionConfig, load_config
from clip_mini.data import build_eval_transform, load_image
from clip_mini.train import frozen as frozen_io
from clip_mini.train import train
from clip_mini.train.optim import build_optimizer, freeze_towers, set_train_mode
from clip_mini.model.vision import ImageEncoder

from test_train_frozen import _model
from test_train_loop import TINY, _assert_same_weights, _rows, _weights, shapes  # noqa: F401 (fixture)

BLOCKS = ["model.vision.trainable_blocks=1", "data.workers=0"]


def _cfg(shapes, out, *extra):
    return load_config(None, TINY + BLOCKS + [f"data.captions={shapes / 'captions.csv'}",
                                              f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}",
                                              *extra])


@pytest.mark.parametrize("pooling", ["cls", "cls_mean"])
def test_suffix_of_prefix_is_the_tower(pooling):
    torch.manual_seed(0)
    enc = ImageEncoder(VisionConfig(image_size=28, patch_size=7, width=48, depth=4, heads=2, init_values=0.5,
                                    pooling=pooling)).eval()
    with torch.no_grad():   # LayerScale at 0.5 so every block visibly changes the tokens
        pixels = torch.randn(3, 3, 28, 28)
        whole = enc(pixels)
        for k in (0, 1, 2, 4):
            tokens = enc.forward_prefix(pixels, k)
            assert tokens.shape == (3, 1 + 16, 48)
            torch.testing.assert_close(enc.forward_suffix(tokens, k), whole, rtol=0, atol=1e-5)
        # the split is real: the prefix for k = 1 is not the prefix for k = 2
        assert not torch.allclose(enc.forward_prefix(pixels, 1), enc.forward_prefix(pixels, 2))
    with pytest.raises(ValueError, match=r"trainable_blocks must be in \[0, 4\], got 5"):
        enc.forward_prefix(pixels, 5)


def test_patch_drop_thins_only_the_trainable_blocks_and_both_paths_drop_alike():
    cfg = dict(image_size=28, patch_size=7, width=48, depth=3, heads=2, init_values=0.5, trainable_blocks=1)
    torch.manual_seed(0)
    dropping = ImageEncoder(VisionConfig(patch_drop=0.5, **cfg))
    plain = ImageEncoder(VisionConfig(**cfg))
    plain.load_state_dict(dropping.state_dict())
    seen = []
    for block in dropping.trunk.blocks:
        block.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    pixels = torch.randn(3, 3, 28, 28)
    dropping.train()
    with torch.no_grad():
        torch.manual_seed(1)
        from_pixels = dropping(pixels)
        assert seen == [1 + 16, 1 + 16, 1 + 8]   # the locked prefix sees every patch, the trainable block half
        torch.manual_seed(1)   # the stored-token path (train.frozen_features) drops the same tokens
        torch.testing.assert_close(dropping.forward_suffix(dropping.forward_prefix(pixels)), from_pixels,
                                   rtol=0, atol=0)
        assert not torch.allclose(dropping(pixels), from_pixels)   # a new subset each forward
        dropping.eval(), plain.eval()
        torch.testing.assert_close(dropping(pixels), plain(pixels), rtol=0, atol=0)   # evaluation: every token
    assert seen[-3:] == [1 + 16, 1 + 16, 1 + 16]


def test_config_checks_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model.vision.trainable_blocks must be in \[0, model.vision.depth=2\]"):
        load_config(None, TINY + ["model.vision.trainable_blocks=3"])
    with pytest.raises(ConfigError, match="set model.vision.trainable=true"):
        load_config(None, TINY + ["model.vision.trainable_blocks=1", "model.vision.trainable=false"])
    with pytest.raises(ConfigError, match="trainable_blocks needs model.vision.backbone=vit"):
        load_config(None, ["model.vision.backbone=efficientnet_lite0", "model.vision.trainable_blocks=1"])
    load_config(None, TINY + ["model.vision.trainable_blocks=0", "model.vision.trainable=false"])   # = locked


def test_only_the_last_blocks_train_and_get_gradients(shapes, tmp_path):
    cfg = _cfg(shapes, tmp_path / "run")
    model, _ = _model(cfg, tmp_path / "run")
    frozen = freeze_towers(model)
    assert frozen == ["image (all but its last 1 blocks)"]
    trainable = {n for n, p in model.visual.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("trunk.blocks.1.") for n in trainable)
    assert all(p.requires_grad for n, p in model.visual.named_parameters() if n.startswith("trunk.blocks.1."))
    optimizer = build_optimizer(model, cfg.train)
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    image_groups = [g for g in optimizer.param_groups if g["name"].startswith("image.")]
    assert {id(p) for g in image_groups for p in g["params"]} == {
        id(p) for n, p in model.visual.named_parameters() if n in trainable}
    assert not any(id(p) in in_opt for n, p in model.visual.named_parameters() if n not in trainable)
    set_train_mode(model, True)
    assert not model.visual.trunk.blocks[0].training and model.visual.trunk.blocks[1].training
    assert model.text.training and model.image_head.training
    # one step on token states: every trainable parameter of the image side gets a finite, non-zero gradient
    tokens = torch.randn(4, 17, 64)
    model.project_image(model.visual.forward_suffix(tokens)).sum().backward()
    for n, p in model.visual.named_parameters():
        if n in trainable:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_the_trainers_train_mode_drops_tokens_in_the_trainable_blocks(shapes, tmp_path):
    # set_train_mode keeps the locked prefix in eval mode; the patch dropout, a module of the trunk outside every
    # block, must still be on, or model.vision.patch_drop silently does nothing in training
    cfg = _cfg(shapes, tmp_path / "run", "model.vision.patch_drop=0.5")
    model, _ = _model(cfg, tmp_path / "run")
    freeze_towers(model)
    seen = []
    model.visual.trunk.blocks[1].register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    tokens = torch.randn(4, 17, 64)
    set_train_mode(model, True)
    assert not model.visual.trunk.blocks[0].training
    model.visual.forward_suffix(tokens)
    set_train_mode(model, False)
    model.visual.forward_suffix(tokens)
    assert seen == [1 + 8, 1 + 16]


def test_store_holds_prefix_tokens_keyed_on_the_locked_weights(shapes, tmp_path, monkeypatch):
    cfg = _cfg(shapes, tmp_path / "run", "train.frozen_features=2", "train.precision=fp32")
    run = tmp_path / "run"
    model, splits = _model(cfg, run)
    freeze_towers(model)
    device = torch.device("cpu")
    feats, ok = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    paths = frozen_io.split_paths(splits["val"])
    assert isinstance(feats, list) and feats[0].shape == (len(paths), 17, 64) and bool(ok.all())
    with torch.inference_mode():
        pixels = torch.stack([build_eval_transform(model.preprocess)(load_image(p)) for p in paths[:4]])
        torch.testing.assert_close(feats[0][:4], model.visual.forward_prefix(pixels), rtol=0, atol=1e-5)
    calls = []
    real = frozen_io.compute_view
    monkeypatch.setattr(frozen_io, "compute_view", lambda m, d, view, *a, **k: calls.append(view) or
                        real(m, d, view, *a, **k))
    # the trainable last block changes during training (and in a resumed run): the store stays valid ...
    with torch.no_grad():
        model.visual.trunk.blocks[1].mlp.fc1.weight.add_(1.0)
    again, _ = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    assert calls == [] and torch.equal(again[0], feats[0])
    # ... a change to a locked block invalidates it, and so does another k (another split point)
    with torch.no_grad():
        model.visual.trunk.blocks[0].mlp.fc1.weight.add_(1.0)
    changed, _ = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device)
    assert calls == [0] and not torch.allclose(changed[0], feats[0])
    cfg2 = _cfg(shapes, run, "train.frozen_features=2", "model.vision.trainable_blocks=2")
    model.cfg.vision.trainable_blocks = 2   # the model's own config decides the split, as a k=2 run builds it
    two, _ = frozen_io.load_or_compute(model, cfg2, splits["val"], "val", 1, run, None, device)
    assert calls == [0, 0] and two[0].shape == (len(paths), 17, 64)
    # the dataset reads view epoch % views from per-view tensors
    ds = frozen_io.FrozenFeatureDataset(splits["val"], [changed[0], two[0]], ok)
    ds.epoch = 3
    vec, _, image = ds[0]
    assert torch.equal(vec, two[0][image])


def test_val_features_run_the_current_last_blocks(shapes, tmp_path):
    cfg = _cfg(shapes, tmp_path / "run", "train.frozen_features=1", "train.precision=fp32")
    run = tmp_path / "run"
    model, splits = _model(cfg, run)
    feats, ok = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, torch.device("cpu"))
    with torch.no_grad():
        model.visual.trunk.blocks[1].attn.proj.weight.mul_(3.0)   # "fine-tuned" after the store was written
    pooled, _ = frozen_io.val_tower_features(model, (feats[0], ok), 7, torch.device("cpu"), "fp32")
    paths = frozen_io.split_paths(splits["val"])
    with torch.inference_mode():
        pixels = torch.stack([build_eval_transform(model.preprocess)(load_image(p)) for p in paths])
        torch.testing.assert_close(pooled, model.visual(pixels), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_training_last_block_learns_resumes_bitwise_and_eval_matches_pixels(shapes, tmp_path, capsys):
    from clip_mini.cli.main import main
    from clip_mini.model.clip import CLIPModel

    # bf16, as the flickr8k-vit config runs: a bf16 token store, the steps under autocast; pause and resume
    extra = ["train.frozen_features=2", "train.epochs=2", "train.accum_freq=2", "train.batch_size=8",
             "train.checkpoint_every=2", "model.text.dropout=0.1", "model.head_dropout=0.1", "train.precision=bf16"]
    ref = train(_cfg(shapes, tmp_path / "ref", *extra))
    assert ref["step"] == 20
    store = tmp_path / "ref" / "frozen_features" / "train-view1.safetensors"
    assert store.is_file()
    from safetensors import safe_open

    with safe_open(str(store), "pt") as f:
        assert f.get_tensor("features").dtype == torch.bfloat16 and f.get_tensor("features").ndim == 3
    run = tmp_path / "paused"
    assert train(_cfg(shapes, run, *extra), stop_after=3)["stopped"]
    train(_cfg(shapes, run, *extra), resume="auto")
    _assert_same_weights(_weights(tmp_path / "ref"), _weights(run))

    # fp32: the last block moved, the locked rest did not, and the trainer's val numbers are the saved model's
    fp32 = ["train.frozen_features=1", "train.epochs=2", "train.precision=fp32", "train.eval_batch_size=24"]
    out = tmp_path / "fp32"
    train(_cfg(shapes, out, *fp32))
    final = _weights(out)
    model, _ = _model(_cfg(shapes, tmp_path / "init", *fp32), tmp_path / "init")   # the same seed's initial weights
    init = {f"visual.{k}": v for k, v in model.visual.state_dict().items()}
    for name, value in init.items():
        if name.startswith("visual.trunk.blocks.1."):
            continue
        assert torch.equal(final[name], value), name
    assert not torch.equal(final["visual.trunk.blocks.1.mlp.fc1.weight"], init["visual.trunk.blocks.1.mlp.fc1.weight"])
    trained = json.loads((out / "best" / "config.json").read_text())["trained"]
    row = next(r for r in _rows(out) if r["kind"] == "epoch" and r["epoch"] == trained["epoch"])
    capsys.readouterr()
    # at the run's precision (eval's auto is bf16 on a CPU that has it natively)
    assert main(["eval", "--model", str(out / "best"), "--data", str(out / "config.yaml"), "--split", "val",
                 "--precision", "fp32", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    for k in [f"{d}_{m}" for d in ("t2i", "i2t") for m in ("r1", "r5", "r10", "medr")] + ["rsum", "loss"]:
        assert got[k] == pytest.approx(row[f"val_{k}"], abs=1e-5), k
    # the saved model embeds pixels through the whole tower; the trainer's path is the stored tokens + suffix
    best = CLIPModel.from_pretrained(out / "best").eval()
    cfg = _cfg(shapes, out, *fp32)
    feats, ok = frozen_io.load_or_compute(best, cfg, _val_split(cfg), "val", 1, out, None,
                                          torch.device("cpu"), write=False)
    paths = frozen_io.split_paths(_val_split(cfg))
    with torch.inference_mode():
        pixels = torch.stack([build_eval_transform(best.preprocess)(load_image(p)) for p in paths])
        via = best.project_image(frozen_io.val_tower_features(best, (feats[0], ok), 16, torch.device("cpu"),
                                                              "fp32")[0])
        torch.testing.assert_close(via, best.encode_image(pixels), rtol=0, atol=1e-5)


def _val_split(cfg):
    from clip_mini.train.inputs import load_splits

    return load_splits(cfg, progress=False)["val"]
