"""Start a run from a saved model directory (``train.init_from``): its weights, tokenizer and preprocessing.

The model section was resolved against the directory when the config loaded (``config._model_from_init_dir``:
left out, it is the directory's; given, it must match but for the keys that only change how the towers train).
Here the trainer checks the directory (its manifest and checksums), uses its tokenizer as the run's, loads its
weights from ``model.safetensors`` (nothing else is read: no pickle) and takes its ``preprocess.json``, so the
untrained-model evaluation at epoch 0 is that model's ``clip-mini eval`` on the same split.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from clip_mini.config import Config, ConfigError, PreprocessConfig, from_dict


def init_dir(cfg: Config) -> Path:
    """The directory ``train.init_from`` names, checked (manifest, checksums) and its preprocessing matched against
    ``model.vision.resize_mode``; raises ``ConfigError`` naming the key."""
    from clip_mini.fileio.manifest import ModelDirError, read_json, read_manifest

    path = Path(cfg.train.init_from)
    try:
        read_manifest(path, verify=True)
        pre = from_dict(PreprocessConfig, read_json(path / "preprocess.json"), "preprocess.")
    except (ModelDirError, ConfigError) as e:
        raise ConfigError(f"train.init_from: {e}") from None
    if pre.resize_mode != cfg.model.vision.resize_mode:
        raise ConfigError(f"model.vision.resize_mode is {cfg.model.vision.resize_mode!r} here but {pre.resize_mode!r} in "
                          f"train.init_from's preprocessing ({path}); set model.vision.resize_mode={pre.resize_mode}")
    return path


def copy_tokenizer(src: Path, out: Path) -> None:
    """The directory's tokenizer saved as the run's ``tokenizer/`` (atomically)."""
    from clip_mini.fileio.atomic import atomic_dir
    from clip_mini.model.text import load_tokenizer

    tokenizer = load_tokenizer(src)
    with atomic_dir(out) as tmp:
        tokenizer.save_pretrained(str(tmp))


def load_weights(model, src: Path) -> None:
    """``src``'s ``model.safetensors`` into ``model`` (every key, same shapes) and its preprocessing."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from clip_mini.fileio.manifest import read_json

    try:
        model.load_state_dict(load_file(str(src / "model.safetensors")))
    except (SafetensorError, RuntimeError, OSError) as e:
        raise ConfigError(f"train.init_from: {src / 'model.safetensors'} does not fit the model section: {e}") \
            from None
    pre = from_dict(PreprocessConfig, read_json(src / "preprocess.json"), "preprocess.")
    model.preprocess = model.visual.preprocess = dataclasses.replace(pre)
