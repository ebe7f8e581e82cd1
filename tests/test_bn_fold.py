"""BatchNorm folding for the inference copy of a CNN tower (clip_mini.model.layers.bn_fold, vision.inference_tower)."""
import pytest
import torch
import torch.nn as nn

from clip_mini.model.layers.bn_fold import fold_batchnorm
from clip_mini.config import VisionConfig
from clip_mini.model.vision import ImageEncoder, inference_tower, tower_input


def _randomise_bn(model: nn.Module) -> None:
    """Non-trivial running statistics and affine parameters, as trained weights have (fresh BN is the identity)."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g) * 0.1 + 1)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)


@pytest.mark.parametrize("pad_type", ["", "same"], ids=["timm", "tf-same"])
def test_folded_efficientnet_equals_unfolded_fp32(pad_type):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("efficientnet_lite0", num_classes=0, bn_eps=1e-3, pad_type=pad_type).eval()
    _randomise_bn(model)
    x = torch.randn(2, 3, 96, 96)
    folded = fold_batchnorm(model, x)
    assert folded is not model
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())   # every BN found its conv
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())        # the original is untouched
    with torch.no_grad():
        torch.testing.assert_close(folded(torch.randn(3, 3, 128, 128, generator=torch.Generator().manual_seed(1))),
                                   model(torch.randn(3, 3, 128, 128, generator=torch.Generator().manual_seed(1))),
                                   atol=1e-4, rtol=1e-4)


class _Misordered(nn.Module):
    """Registers conv then bn, but the bn runs on the input, before the conv: folding it would be wrong."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.conv(self.bn(x))


def test_fold_refuses_when_the_folded_copy_disagrees():
    model = _Misordered().eval()
    _randomise_bn(model)
    with pytest.warns(RuntimeWarning, match="BatchNorm folding of _Misordered refused"):
        assert fold_batchnorm(model, torch.randn(2, 4, 8, 8)) is model


class _Recorder(nn.Module):
    """Identity that records the TF32 settings each forward ran under."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
        return x


def test_fold_checks_parity_with_tf32_off_and_restores_the_settings():
    # On a GPU TF32 is on for every pass (runtime.devices.enable_tf32); the check must not run under it, or its
    # 10-bit mantissa exceeds the 1e-4 tolerance and every fold is refused. A CPU shows the flags being switched.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), _Recorder()).eval()
    _randomise_bn(model)
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        folded = fold_batchnorm(model, torch.randn(2, 3, 8, 8))
        assert folded is not model
        assert model[2].seen == [("highest", False)] and folded[2].seen == [("highest", False)]
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("high", True)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_fold_needs_eval_mode():
    with pytest.raises(ValueError, match="eval-mode"):
        fold_batchnorm(_Misordered().train(), torch.randn(2, 4, 8, 8))


def test_bf16_inference_tower_of_a_cnn_has_no_batchnorm_and_matches_fp32():
    cfg = VisionConfig(backbone="efficientnet_lite0", image_size=96, trainable=False)
    encoder = ImageEncoder(cfg).eval()
    _randomise_bn(encoder)
    tower = inference_tower(encoder, "bf16")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in tower.modules())
    pixels = torch.randn(4, 3, 96, 96)
    with torch.inference_mode():
        ref, fast = encoder(pixels), tower(tower_input(tower, pixels)).float()
    assert torch.nn.functional.cosine_similarity(fast, ref).min() > 0.99
