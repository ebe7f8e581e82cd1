"""Optimiser set-up: tower freezing (LiT-style), AdamW parameter groups, the learning rate set from the schedule
(``train/schedule.py``).

Groups: image tower (only its last ``model.vision.trainable_blocks`` blocks when set), text tower (its last
``model.text.trainable_layers`` when set) and heads (projection heads + ``logit_scale``) each get their own learning rate
(``train.lr_image`` / ``lr_text`` / ``lr_head``, falling back to ``train.lr``), and each is split into a decayed
and a non-decayed part; with ``train.lr_layer_decay`` below 1, a tower's groups are further split by depth, each
block at that factor of the rate of the block above it. Biases, norm weights, the CLS token, positional embeddings
and ``logit_scale`` are never weight-decayed: decay would pull them towards zero, which has no regularising meaning
for them.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from clip_mini.config import TrainConfig
from clip_mini.train.schedule import lr_factor  # noqa: F401  (the fixed-length schedule, imported from here too)

# Parameter names (substrings) that are never decayed even when they are matrices.
NO_DECAY_NAMES = ("cls_token", "pos_embed", "position_embeddings", "logit_scale")


def freeze_towers(model: nn.Module) -> list[str]:
    """Switch off gradients for towers whose config says ``trainable: false``, for all but the last
    ``model.vision.trainable_blocks`` blocks of the image tower, and for the embeddings and all but the last
    ``model.text.trainable_layers`` blocks of the text tower; returns what is frozen, by name.

    The projection heads always train: they are freshly initialised, so a locked tower still needs its head
    to map into the shared space (LiT locks the image tower and trains the text side against it).
    """
    frozen = []
    for name, tower, tower_cfg in (("image", model.visual, model.cfg.vision), ("text", model.text, model.cfg.text)):
        if not tower_cfg.trainable:
            tower.requires_grad_(False)
            frozen.append(name)
    k = model.cfg.vision.trainable_blocks
    if model.cfg.vision.trainable and k is not None:
        for n, p in model.visual.named_parameters():
            p.requires_grad_(model.visual.in_trainable_suffix(n))
        frozen.append("image" if k == 0 else f"image (all but its last {k} blocks)")
    k = model.cfg.text.trainable_layers
    if model.cfg.text.trainable and k is not None:
        for p in model.text.locked_part():
            p.requires_grad_(False)
        frozen.append(f"text (all but its last {k} blocks)")
    return frozen


def set_train_mode(model: nn.Module, training: bool = True) -> None:
    """``model.train(training)``, but frozen towers (and a frozen block prefix) stay in eval mode: no dropout or
    drop-path noise where nothing learns, and the stored prefix outputs were computed in eval mode."""
    model.train(training)
    if training:
        for tower, tower_cfg in ((model.visual, model.cfg.vision), (model.text, model.cfg.text)):
            if not tower_cfg.trainable:
                tower.eval()
        k = model.cfg.vision.trainable_blocks
        if model.cfg.vision.trainable and k is not None:
            model.visual.eval()
            for block in model.visual.trunk.blocks[model.visual.prefix_depth():]:
                block.train()
            model.visual.trunk.patch_drop.train()   # model.vision.patch_drop thins the trainable blocks' tokens
        if model.cfg.text.trainable and model.cfg.text.trainable_layers is not None:
            for module in model.text.locked_modules():
                module.eval()


def _no_decay(name: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or any(key in name for key in NO_DECAY_NAMES)


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """AdamW groups ``{name, params, lr, base_lr, weight_decay}``; empty groups and frozen parameters are left out.

    Args:
        model: a ``CLIPModel`` (its ``visual``, ``text``, heads and ``logit_scale``).
        cfg: learning rates and weight decay.
    """
    towers = {"image": (model.visual, cfg.lr_image), "text": (model.text, cfg.lr_text)}
    seen: set[int] = set()
    groups = []
    for tower, (module, lr) in towers.items():
        named = [(n, p) for n, p in module.named_parameters()]
        lr = cfg.lr if lr is None else lr
        if cfg.lr_layer_decay == 1.0:
            groups += _split(tower, named, lr, cfg.weight_decay)
        else:   # one pair of groups per depth, the top block at the tower's rate
            depths = _depths(named)
            top = max(depths.values())
            for level in sorted(set(depths.values()), reverse=True):
                part = [(n, p) for n, p in named if depths[n] == level]
                groups += _split(f"{tower}.{level}", part, lr * cfg.lr_layer_decay ** (top - level),
                                 cfg.weight_decay)
        seen.update(id(p) for _, p in named)
    # Everything else (projection heads, logit_scale) is the "head" group.
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in seen]
    groups += _split("head", rest, cfg.lr if cfg.lr_head is None else cfg.lr_head, cfg.weight_decay)
    return groups


_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layer|layers)\.(\d+)\.")


def _depths(named: list) -> dict[str, int]:
    """Each parameter's depth in its tower for ``train.lr_layer_decay``: block i (timm's ``blocks.i``, a BERT's
    ``layer.i``) is i + 1, what comes before the blocks (embeddings, patch embedding, class token, positions) 0, and
    what comes after them (a final norm, pooling) the top block's depth."""
    found = {n: _BLOCK.search(n) for n, _ in named}
    top = max((int(m.group(1)) + 1 for m in found.values() if m), default=0)
    out, after = {}, False
    for n, _ in named:   # named_parameters lists a tower's modules in definition order: before, blocks, after
        m = found[n]
        if m:
            out[n], after = int(m.group(1)) + 1, True
        else:
            out[n] = top if after else 0
    return out


def _split(tower: str, named: list, lr: float, weight_decay: float) -> list[dict]:
    decay = [p for n, p in named if p.requires_grad and not _no_decay(n, p)]
    no_decay = [p for n, p in named if p.requires_grad and _no_decay(n, p)]
    out = []
    for suffix, params, wd in (("decay", decay, weight_decay), ("no_decay", no_decay, 0.0)):
        if params:
            out.append({"name": f"{tower}.{suffix}", "params": params, "lr": lr, "base_lr": lr,
                        "weight_decay": wd})
    return out


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; raises ``ValueError`` when nothing is trainable."""
    groups = param_groups(model, cfg)
    if not groups:
        raise ValueError("no trainable parameters: both towers frozen and no heads?")
    # fused: one kernel per group instead of a chain of foreach ops, a cheaper step on CPU; bitwise deterministic
    # as the foreach path is
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Scale every group's ``base_lr`` by ``factor``; returns the largest resulting learning rate (for logs)."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    return max(group["lr"] for group in optimizer.param_groups)
