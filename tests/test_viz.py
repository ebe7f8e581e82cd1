"""PNG outputs (sizes are exact) and the attention summaries."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from clip_mini.model.attention import attention_map, rollout
from clip_mini.pictures.draw import attention_overlay, grid_size, plot_curves, result_grid

from conftest import write_images


def _png_size(path):
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.load()
        return im.size


def test_result_grid_size_and_missing_files(tmp_path):
    paths = [str(p) for p in write_images(tmp_path / "imgs", 7)] + [str(tmp_path / "deleted.png")]
    scores = np.linspace(0.9, 0.2, 8)
    size = result_grid(paths, scores, tmp_path / "grid.png", title="'a red circle'", cols=5, thumb=64)
    assert size == grid_size(8, cols=5, thumb=64) == _png_size(tmp_path / "grid.png")
    assert size == (5 * 70 + 6, 28 + 2 * (64 + 34 + 6) + 6)   # two label lines: rank + score, file name
    with pytest.raises(ValueError):
        result_grid([], [], tmp_path / "x.png")


def test_attention_overlay_size(tmp_path):
    image = np.zeros((60, 90, 3), np.uint8)
    heat = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert attention_overlay(image, heat, tmp_path / "a.png", size=300) == (300, 200) == _png_size(tmp_path / "a.png")
    assert attention_overlay(image, heat, tmp_path / "b.png", size=None) == (90, 60)
    # The hottest patch (bottom right) is brightest in the overlay.
    arr = np.asarray(Image.open(tmp_path / "b.png"), np.float32).sum(-1)
    assert arr[-5:, -5:].mean() > arr[:5, :5].mean()


def test_rollout_hand_computed():
    a = torch.tensor([[[[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]])   # (B=1, heads=1, N=3, N=3)
    # (A + I) / 2 has CLS row [0.75, 0.125, 0.125]: the patches get 0.125 each.
    np.testing.assert_allclose(rollout([a]).numpy(), [[0.125, 0.125]])
    # Two layers: rows of (A + I)/2 multiplied; CLS row of M @ M = [0.5625, 0.21875, 0.21875].
    np.testing.assert_allclose(rollout([a, a]).numpy(), [[0.21875, 0.21875]])


def test_attention_maps_of_a_vit(model_dir):
    from clip_mini.model.clip import CLIPModel

    model = CLIPModel.from_pretrained(model_dir)
    pixels = torch.randn(1, 3, 32, 32)
    # The maps we recompute equal timm's own attention probabilities (captured from its unfused path).
    captured = []
    for block in model.visual.trunk.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach()))
    model.eval()
    with torch.no_grad():
        model.visual(pixels)
    timm_maps = list(captured)   # attention_maps runs the blocks too; keep only the plain forward's maps
    maps, grid = model.visual.attention_maps(pixels)
    assert grid == (4, 4) and len(timm_maps) == len(maps) == 2
    for ours, timms in zip(maps, timm_maps):
        torch.testing.assert_close(ours, timms)
    cls_rows = torch.stack([m[:, :, 0, 1:] for m in timm_maps], 1).reshape(1, len(maps), -1, 4, 4)
    torch.testing.assert_close(model.visual.cls_attention(pixels), cls_rows)
    for mode in ("mean", "rollout"):
        heat = attention_map(model, pixels[0], mode)
        assert heat.shape == (4, 4) and heat.min() >= 0 and heat.sum() == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="unknown attention mode"):
        attention_map(model, pixels, "max")


def test_plot_curves(tmp_path):
    records = [{"kind": "step", "step": s, "epoch": s // 10, "loss": 4 - s / 20, "lr": 1e-3, "logit_scale": 14.0}
               for s in range(1, 31)]
    records += [{"kind": "epoch", "epoch": e, "step": 10 * e, "val_loss": 3.5 - e / 5, "val_t2i_r1": 0.1 * e,
                 "val_i2t_r1": 0.08 * e, "val_t2i_r5": 0.2 * e, "val_t2i_medr": 5.0} for e in (1, 2, 3)]
    records.append({"kind": "epoch", "epoch": 4, "val_loss": math.nan, "val_t2i_r1": 0.5})   # no step, NaN loss
    plot_curves(records, tmp_path / "curves.png")
    assert _png_size(tmp_path / "curves.png") == (1500, 400)
    with pytest.raises(ValueError, match="no step or epoch records"):
        plot_curves([], tmp_path / "none.png")
