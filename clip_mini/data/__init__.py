"""Data pipeline: caption readers, image-grouped splits, safe image loading, transforms, cache, datasets.

    from clip_mini.data import load_table, split_by_image, CaptionDataset, CaptionCollate
    df = load_table(cfg.data, report_dir="runs/x")
    splits = split_by_image(df, val=cfg.data.val, seed=cfg.data.seed)

Names are imported lazily, so ``python -m clip_mini.data.synthetic`` and the readers don't pay for torch and
albumentations until something needs them.
"""
import importlib
import os

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

_EXPORTS = {
    "readers": ["DataError", "read_captions"],
    "images": ["ImageError", "check_images", "load_image", "DEFAULT_MAX_PIXELS"],
    "splits": ["split_by_image", "read_name_list"],
    "transforms": ["build_eval_transform", "build_train_transform", "resize_op"],
    "cache": ["ImageCache", "make_cache", "default_cache_dir", "decode_resized"],
    "dataset": ["load_table", "load_splits", "CaptionDataset", "CaptionCollate", "OneCaptionPerImageSampler"],
    "image_dataset": ["ImageDataset", "collate_images"],
    "mirror": ["swap_left_right"],
    "synthetic": ["generate"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'clip_mini.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"clip_mini.data.{_WHERE[name]}"), name)
    globals()[name] = value   # cache: the next access skips __getattr__
    return value


def __dir__():
    return __all__
