"""The frozen-feature key covers the image pipeline: data.cache, the resize mode and the cache record geometry."""
import dataclasses

import torch

from clip_mini.config import Config, DataConfig, PreprocessConfig
from clip_mini.train.frozen import features_key, inputs_digest


def _key(data: DataConfig, view: int, pre: PreprocessConfig = None) -> str:
    cfg = Config(data=data)
    pre = pre or PreprocessConfig(image_size=32)
    digest = inputs_digest(cfg, ["/nonexistent/a.jpg"], {"w": torch.ones(2)}, pre)
    return features_key(digest, cfg, view)


def test_key_changes_with_the_cache_switch_resize_mode_and_geometry():
    base = DataConfig()
    for view in (0, 1):
        ref = _key(base, view)
        assert _key(base, view) == ref                                             # deterministic
        assert _key(dataclasses.replace(base, cache=False), view) != ref
        assert _key(base, view, PreprocessConfig(image_size=32, resize_mode="center_crop")) != ref
        assert _key(base, view, PreprocessConfig(image_size=32, mean=(0.4, 0.5, 0.5))) != ref
    # scale_min moves the training record geometry (and the crops): every augmented view is recomputed
    assert _key(dataclasses.replace(base, scale_min=0.5), 1) != _key(base, 1)
