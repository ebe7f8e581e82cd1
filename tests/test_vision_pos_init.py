"""model.vision.pos_init: a from-scratch ViT's learned positions start as timm's random ones or MAE's 2D sin-cos."""
import pytest
import torch

from clip_mini.config import ConfigError, VisionConfig, load_config
from clip_mini.model.vision import ImageEncoder


def test_sincos_positions_start_as_the_2d_table_and_still_learn():
    from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed

    torch.manual_seed(0)
    enc = ImageEncoder(VisionConfig(image_size=32, patch_size=8, width=32, depth=1, heads=2, pos_init="sincos"))
    pos = enc.trunk.pos_embed
    assert pos.requires_grad
    assert torch.equal(pos[0, 0], torch.zeros(32))                       # the class token's
    assert torch.equal(pos[0, 1:], build_sincos2d_pos_embed([4, 4], 32))
    # neighbours along a row are more alike than patches far apart: the table says where a patch lies
    table = pos[0, 1:].reshape(4, 4, 32)
    near = torch.cosine_similarity(table[0, 0], table[0, 1], dim=0)
    far = torch.cosine_similarity(table[0, 0], table[3, 3], dim=0)
    assert near > far
    random = ImageEncoder(VisionConfig(image_size=32, patch_size=8, width=32, depth=1, heads=2)).trunk.pos_embed
    assert random.abs().max() < 0.2                                       # timm's: trunc normal, std 0.02


def test_an_unknown_pos_init_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {captions: x.csv}\n")
    with pytest.raises(ConfigError, match="pos_init"):
        load_config(cfg, ["model.vision.pos_init=fourier"])
