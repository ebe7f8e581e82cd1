"""Run set-up that must happen before the first step: config checks, run directory, tokenizer, model.

Everything here fails fast with a message naming the key, file or folder, before any data is read or any
weight is trained.
"""
from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch

from clip_mini.config import Config, ConfigError
from clip_mini.errors import TrainError
from clip_mini.runtime.devices import PRECISIONS, resolve_precision
from clip_mini.runtime.isa import cpu_kind
from clip_mini.train.logbook import metric_key


def check_train_config(cfg: Config) -> None:
    """Checks that ``config.validate`` leaves to the trainer; raises ``ConfigError`` naming the key."""
    t = cfg.train
    try:
        metric_key(t.best_metric)
    except ValueError as e:
        raise ConfigError(f"train.best_metric: {e}") from None
    if cfg.data.val <= 0 and cfg.data.val_list is None:
        raise ConfigError("data.val must be > 0 (or data.val_list set): the trainer evaluates on the validation "
                          "split after every epoch")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio!r}")
    for i, beta in enumerate(t.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"train.betas[{i}] must be in [0, 1), got {beta!r}")
    from clip_mini.train.distributed import train_device

    train_device(t.device)   # misspelt, or a GPU asked for that is not here: ConfigError naming train.device
    if t.threads is not None and t.threads < 1:
        raise ConfigError(f"train.threads must be >= 1 (or null for automatic), got {t.threads!r}")
    if not t.out_dir.strip():
        raise ConfigError("train.out_dir must not be empty")
    if t.frozen_features and cfg.model.vision.trainable and cfg.model.vision.trainable_blocks is None:
        raise ConfigError("train.frozen_features needs a locked image tower (model.vision.trainable: false) or a "
                          "locked block prefix (model.vision.trainable_blocks: k): the outputs of a tower that "
                          "trains change every step and cannot be precomputed")
    if not (cfg.model.vision.trainable or cfg.model.text.trainable) and t.lr_head == 0:
        raise ConfigError("nothing to train: both towers frozen and train.lr_head = 0")


def run_precision(cfg: Config, resume: Optional[str] = None) -> str:
    """The dtype a run of ``cfg`` will compute in, before it starts: a resumed run's, as its saved ``config.yaml``
    recorded it, else ``train.precision`` decided for ``train.device`` (the rule of ``resolve_train_precision``).
    The command line loads the config's section for it (``config.load_config(precision=...)``)."""
    import yaml

    from clip_mini.train.distributed import train_device

    saved = Path(cfg.train.out_dir) / "config.yaml"
    if resume is not None and cfg.train.precision == "auto" and saved.is_file():
        try:
            kept = (yaml.safe_load(saved.read_text(encoding="utf-8")) or {}).get("train", {}).get("precision")
        except (yaml.YAMLError, UnicodeDecodeError, AttributeError):
            kept = None   # the trainer reports a damaged run directory itself
        if kept in PRECISIONS:
            return kept
    return resolve_precision(cfg.train.precision, train_device(cfg.train.device), warn=False)


def resolve_train_precision(cfg: Config, device: torch.device, ckpt: Optional[dict] = None,
                            say: bool = True) -> Config:
    """``cfg`` with ``train.precision`` decided once for the run (``runtime.devices.resolve_precision``): ``auto`` by
    the device, unless a resumed checkpoint already decided it (a resumed run keeps its precision, whatever CPU it
    continues on). Prints the choice and why; the returned config is what the run saves and checkpoints."""
    asked = cfg.train.precision
    kept = (ckpt or {}).get("config", {}).get("train", {}).get("precision")
    if asked == "auto" and kept in PRECISIONS:
        chosen, why = kept, "kept from the checkpoint"
    else:
        chosen = resolve_precision(asked, device)
        if asked != "auto":
            why = "asked for"
        elif device.type == "cuda":
            why = "auto: " + ("this GPU has bf16 units" if chosen == "bf16" else "this GPU has no bf16 units")
        else:
            why = (f"auto: this CPU computes bf16 natively ({cpu_kind()})" if chosen == "bf16" else
                   "auto: this CPU has no native bf16 (AVX512-BF16 or AMX), where bf16 is slower than fp32")
    if say:
        print(f"precision: {chosen} ({why})")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=chosen))


def check_run_dir(run: Path, resuming: bool) -> None:
    """Refuse to start a fresh run on top of another run's checkpoints (they would be mixed up)."""
    if run.exists() and not run.is_dir():
        raise ConfigError(f"train.out_dir {run} is a file, not a folder; choose another train.out_dir")
    ckpts = run / "checkpoints"
    if not resuming and ckpts.is_dir() and any(ckpts.glob("ckpt-*.pt")):
        raise TrainError(f"{run} already holds a run with checkpoints; continue it with --resume auto, or "
                         "choose another train.out_dir (or delete the folder) to start afresh")


def config_changes(old: dict, new: Config) -> list[str]:
    """Keys whose value differs between a checkpoint's config and the current one."""
    a, b = _flat(old), _flat(dataclasses.asdict(new))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def warn_config_changes(old: dict, new: Config) -> None:
    changed = [k for k in config_changes(old, new) if k != "train.out_dir"]
    if changed:
        warnings.warn("resuming with a config that differs from the checkpoint's in " + ", ".join(changed)
                      + ": the run will not match an uninterrupted one", RuntimeWarning, stacklevel=2)


def prepare_tokenizer(cfg: Config, run: Path, train_captions: list[str], ckpt_path: Optional[Path]) -> Path:
    """The run's ``tokenizer/`` folder: built on a fresh start, kept on resume (copied from the checkpoint's run
    when resuming into a new folder). Called on rank 0 only."""
    out = run / "tokenizer"
    if ckpt_path is None:
        save_tokenizer(cfg, train_captions, out)
    elif not out.is_dir():
        src = Path(ckpt_path).resolve().parent.parent / "tokenizer"
        if not src.is_dir():
            raise TrainError(f"cannot resume from {ckpt_path}: the tokenizer it was trained with ({src}) is missing")
        from clip_mini.fileio.atomic import atomic_dir

        with atomic_dir(out) as tmp:
            for f in src.iterdir():
                shutil.copy2(f, tmp / f.name)
    return out


def save_tokenizer(cfg: Config, train_captions: list[str], out_dir: Path) -> None:
    """Build the run's tokenizer (WordPiece on the TRAIN captions, or MiniLM's vocab) and save it atomically."""
    from clip_mini.fileio.atomic import atomic_dir
    from clip_mini.model.text import build_tokenizer

    tokenizer = build_tokenizer(cfg.model.text, train_captions)
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(str(tmp))


def build_model(cfg: Config, tokenizer_dir: Path, load_pretrained: bool = True):
    """``CLIPModel`` around the run's saved tokenizer, with the config's local pretrained weights loaded.

    Every rank, and a resumed run, reads the same saved tokenizer, so token ids never depend on retraining
    WordPiece (whose tie-breaking is not guaranteed to be stable).
    """
    from clip_mini.model.clip import CLIPModel
    from clip_mini.model.text import load_tokenizer

    return CLIPModel.build(cfg.model, load_pretrained=load_pretrained, tokenizer=load_tokenizer(tokenizer_dir))
