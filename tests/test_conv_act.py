"""Convolution + activation fused into one oneDNN call for the bf16 inference copy of a CNN tower
(clip_mini.model.layers.conv_act, vision.inference_tower)."""
import pytest
import torch
import torch.nn as nn

from clip_mini.model.layers import conv_act
from clip_mini.config import VisionConfig
from clip_mini.model.layers.conv_act import ConvAct, fuse_conv_act
from clip_mini.model.vision import ImageEncoder, inference_tower, tower_input
from conftest import cpu_runs_bf16_convolutions

pytestmark = [pytest.mark.skipif(not conv_act.available(), reason="this torch build has no oneDNN fused convolution"),
              pytest.mark.skipif(not cpu_runs_bf16_convolutions(),
                                 reason="this CPU runs no bf16 convolution (oneDNN needs AVX-512 BW/VL/DQ or "
                                        "AVX-NE-CONVERT); precision auto never asks it to")]


def _bf16_trunk(pad_type: str) -> nn.Module:
    """EfficientNet-Lite0 as inference_tower has it before the fusion: BN folded, bf16, channels-last."""
    import timm

    from clip_mini.model.layers.bn_fold import fold_batchnorm

    torch.manual_seed(0)
    model = timm.create_model("efficientnet_lite0", num_classes=0, bn_eps=1e-3, pad_type=pad_type).eval()
    g = torch.Generator().manual_seed(0)
    for m in model.modules():   # non-trivial BN, as trained weights have (fresh BN is the identity)
        if isinstance(m, nn.BatchNorm2d):
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g) * 0.1 + 1)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    model = fold_batchnorm(model, torch.randn(2, 3, 64, 64))
    return model.to(torch.bfloat16).to(memory_format=torch.channels_last)


def _pixels(n: int, size: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return x.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("pad_type", ["", "same"], ids=["timm", "tf-same"])
def test_fused_efficientnet_is_bitwise_the_unfused_one(pad_type):
    model = _bf16_trunk(pad_type)
    fused = fuse_conv_act(model, _pixels(2, 64, 0))
    assert fused is not model
    pairs = [m for m in fused.modules() if isinstance(m, ConvAct)]
    assert len(pairs) == 33   # stem, head and every block's ReLU6: Lite0 has no activation without a conv before it
    assert {(p.attr, tuple(p.scalars)) for p in pairs} == {("hardtanh", (0.0, 6.0))}
    assert not any(isinstance(m, ConvAct) for m in model.modules())   # the original is untouched
    x = _pixels(3, 96, 1)   # another size than the check's example: SAME padding is computed per input
    with torch.inference_mode():
        got, want = fused(x), model(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("make", [lambda: nn.Conv2d(8, 16, 1), lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8),
                                  lambda: __import__("timm").layers.Conv2dSame(8, 8, 3, stride=2, groups=8)],
                         ids=["pointwise", "depthwise", "tf-same-stride2"])
@pytest.mark.parametrize("act", [nn.ReLU6(), nn.ReLU()], ids=["relu6", "relu"])
def test_one_fused_pair_clips_like_the_activation(make, act):
    torch.manual_seed(0)
    conv = make().to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = (_pixels(2, 16, 4).repeat(1, 3, 1, 1)[:, :8] * 8).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        want, got = act(conv(x)), ConvAct(conv, act)(x)
    assert (want == 0).any() and (isinstance(act, nn.ReLU) or (want == 6).any())   # both ends are exercised
    assert torch.equal(got, want)


def test_fused_pairs_fall_back_where_a_graph_is_recorded():
    model = _bf16_trunk("same").float()
    fused = fuse_conv_act(model.to(torch.bfloat16), _pixels(2, 64, 0)).float()
    x = _pixels(2, 64, 2).float().requires_grad_()
    fused(x).sum().backward()   # the oneDNN op has no backward; the plain path runs instead
    grad = x.grad.clone()
    x.grad = None
    model.float()(x).sum().backward()
    torch.testing.assert_close(grad, x.grad)


def test_fused_pairs_fall_back_for_trainable_weights():
    conv = nn.Conv2d(8, 8, 3, padding=1)   # weights that need a gradient, input that does not
    x = torch.randn(2, 8, 16, 16)
    ConvAct(conv, nn.ReLU6())(x).sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0


def test_fuse_refuses_when_the_copy_disagrees(monkeypatch):
    model = _bf16_trunk("")
    monkeypatch.setattr(conv_act, "_post_op", lambda act: ("hardtanh", [0.0, 5.0]) if isinstance(act, nn.ReLU6)
                        else None)   # a wrong clamp: the check on the example must catch it
    assert fuse_conv_act(model, _pixels(2, 64, 0)) is model


def test_fuse_refuses_when_the_op_fails(monkeypatch):
    def refuse(self, x):
        raise RuntimeError("mkldnn: unsupported format")   # what a build's op says for a layout it cannot run

    monkeypatch.setattr(ConvAct, "forward", refuse)
    model = _bf16_trunk("")
    assert fuse_conv_act(model, _pixels(2, 64, 0)) is model


def test_fuse_refuses_without_the_op_or_off_eval(monkeypatch):
    model = _bf16_trunk("")
    assert fuse_conv_act(model.train(), _pixels(2, 64, 0)) is model
    monkeypatch.setattr(conv_act, "available", lambda: False)
    assert fuse_conv_act(model.eval(), _pixels(2, 64, 0)) is model


def test_inference_tower_fuses_and_leaves_no_in_place_activation():
    cfg = VisionConfig(backbone="efficientnet_lite0", image_size=96, trainable=False)
    encoder = ImageEncoder(cfg).eval()
    fast, plain = inference_tower(encoder, "bf16"), inference_tower(encoder, "bf16", fuse_acts=False)
    assert any(isinstance(m, ConvAct) for m in fast.modules())
    assert not any(getattr(m, "inplace", False) for m in fast.modules())
    assert any(getattr(m, "inplace", False) for m in plain.modules())   # timm builds them in place
    pixels = torch.randn(4, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(fast(tower_input(fast, pixels)), plain(tower_input(plain, pixels)))
