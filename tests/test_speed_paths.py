"""The speed paths compute what the plain ones do: plain vs fused attention, bf16-weight towers, bf16 indexing."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clip_mini.config import VisionConfig
from clip_mini.model.layers.kernels import fused_attention
from clip_mini.model.clip import CLIPModel
from clip_mini.model.vision import ImageEncoder, inference_tower, tower_input
from conftest import tiny_model_config, tiny_sets

VIT = tiny_model_config().vision
EFFNET = VisionConfig(backbone="efficientnet_lite0", image_size=64, trainable=False)


def test_kernel_choice_plain_for_cpu_graphs_fused_for_inference():
    x = torch.zeros(1)
    assert not fused_attention(x)
    with torch.no_grad():   # accumulation's first pass must match its re-forward with gradient
        assert not fused_attention(x)
    with torch.inference_mode():
        assert fused_attention(x)


def test_towers_switch_kernels_and_give_the_same_features():
    torch.manual_seed(0)
    model = CLIPModel(tiny_model_config(), vocab_size=50).eval()
    pixels, ids = torch.randn(3, 3, 32, 32), torch.randint(5, 50, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0   # padding goes through the plain path's mask too
    image, text = model.encode_image(pixels), model.encode_text(ids, mask)          # with a graph: plain
    assert not model.visual.trunk.blocks[0].attn.fused_attn
    assert model.text.bert.config._attn_implementation == "clip_mini_eager"   # plain, clip_mini mask
    with torch.inference_mode():
        image_fused, text_fused = model.encode_image(pixels), model.encode_text(ids, mask)
    assert model.visual.trunk.blocks[0].attn.fused_attn
    assert model.text.bert.config._attn_implementation == "sdpa"
    torch.testing.assert_close(image.detach(), image_fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(text.detach(), text_fused, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", [VIT, EFFNET], ids=["vit", "effnet"])
def test_bf16_inference_tower_within_1e2_cosine_of_fp32(cfg):
    torch.manual_seed(0)
    encoder = ImageEncoder(cfg).eval()
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    assert inference_tower(encoder, "fp32") is encoder
    tower = inference_tower(encoder, "bf16")
    assert next(tower.parameters()).dtype == torch.bfloat16
    pixels = torch.randn(4, 3, cfg.image_size, cfg.image_size)
    with torch.inference_mode():
        reference = encoder(pixels)
        fast = tower(tower_input(tower, pixels))
    assert fast.dtype == torch.bfloat16
    assert F.cosine_similarity(fast.float(), reference).min() > 0.99
    for k, v in encoder.state_dict().items():   # the tower itself is untouched (still fp32, same values)
        assert torch.equal(v, before[k]), k


def test_bf16_indexing_rows_within_1e2_cosine_of_fp32(tmp_path):
    from PIL import Image

    from clip_mini.embed import Embedder
    from clip_mini.features.image_files import iter_image_features

    rng = np.random.default_rng(0)
    paths = []
    for i in range(5):   # real JPEG files, smooth enough that the features are not noise
        base = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((120, 90), Image.BILINEAR)
        paths.append(str(tmp_path / f"{i}.jpg"))
        img.save(paths[-1], quality=90)
    torch.manual_seed(0)
    model = CLIPModel(tiny_model_config(), vocab_size=50)
    embedder = Embedder(model, device="cpu")

    def rows(precision: str) -> np.ndarray:
        out = list(iter_image_features(embedder, paths, batch_size=2, precision=precision, progress=False))
        assert all(not bad for _, _, bad in out)
        return np.concatenate([feats for _, feats, _ in out])

    fp32, bf16 = rows("fp32"), rows("bf16")
    assert fp32.shape == bf16.shape == (5, model.cfg.embed_dim)
    np.testing.assert_allclose(np.linalg.norm(bf16, axis=1), 1.0, atol=1e-5)
    assert (fp32 * bf16).sum(1).min() > 0.99


@pytest.mark.parametrize("cfg", [VIT, EFFNET], ids=["vit", "effnet"])
def test_bf16_indexing_loader_feeds_the_tower_the_same_pixels(tmp_path, cfg):
    """The bf16 loader normalises straight to bf16 (channels-last); the rows are bitwise those of the float32
    loader's pixels cast by the tower's own input conversion."""
    from PIL import Image

    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.embed import Embedder
    from clip_mini.model.clip import ImageForward
    from clip_mini.features.image_files import iter_image_features

    rng = np.random.default_rng(0)
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"{i}.jpg"))
        Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)).resize((120, 90)).save(paths[-1])
    torch.manual_seed(0)
    model = CLIPModel(dataclasses.replace(tiny_model_config(), vision=cfg), vocab_size=50).eval()
    embedder = Embedder(model, device="cpu")
    rows = np.concatenate([f for _, f, _ in iter_image_features(embedder, paths, batch_size=3, precision="bf16",
                                                                 progress=False)])
    transform = build_eval_transform(model.preprocess)
    pixels = torch.stack([transform(load_image(p, min_size=transform.base[0])) for p in paths])
    forward = ImageForward(model, "bf16", "cpu")
    assert forward.input_dtype == torch.bfloat16
    np.testing.assert_array_equal(rows, forward(pixels).numpy())


def test_train_reports_where_its_time_went(tmp_path):
    from clip_mini.config import load_config
    from clip_mini.data import generate
    from clip_mini.train import train

    shapes = generate(tmp_path / "shapes", n=60, seed=0, size=32)
    cfg = load_config(None, tiny_sets() + [
        "data.val=12", "train.batch_size=16", "train.epochs=1", "train.threads=1", "train.eval_batch_size=64",
        f"data.captions={shapes / 'captions.csv'}", f"train.out_dir={tmp_path / 'run'}"])
    result = train(cfg)
    times = result["time_breakdown"]
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())   # the same record, on disk
    assert saved["time_breakdown"] == pytest.approx(times) and saved["step"] == result["step"]
    assert {"steps_s", "data_wait_s", "evaluation_s", "checkpoints_s", "other_s", "total_s"} <= times.keys()
    assert all(v >= 0 for v in times.values())
    assert sum(v for k, v in times.items() if k != "total_s") == pytest.approx(times["total_s"])
    assert "feature_pass_s" not in times   # no locked tower here: nothing precomputed


def test_index_precision_auto_is_bf16_only_where_bf16_is_native(monkeypatch):
    import clip_mini.runtime.devices as devices
    from clip_mini.cli.main import build_parser

    cpu = torch.device("cpu")
    import clip_mini.runtime.isa as isa

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx512f", "avx2"})   # bf16 emulated: slower than fp32
    assert devices.resolve_precision("auto", cpu) == "fp32"
    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert devices.resolve_precision(None, cpu) == "bf16"
    assert devices.resolve_precision("fp32", cpu) == "fp32"   # an explicit choice is kept
    parse = build_parser().parse_args
    assert parse(["index", "--model", "m", "--images", "i", "--out", "o"]).precision == "auto"
    assert parse(["index", "--model", "m", "--images", "i", "--out", "o", "--bf16"]).precision == "bf16"
    assert parse(["index", "--model", "m", "--images", "i", "--out", "o", "--precision", "fp32"]).precision == "fp32"

