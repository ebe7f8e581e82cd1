"""``train.ema``: an exponential moving average of the weights, timm's ``ModelEmaV3``, updated after every applied
optimiser step; the run evaluates, keeps (``best/``) and ships (``final/``) the average.

The decay warms up as a running mean: update n uses ``min(ema, (n - 1) / n)`` (timm's ``use_warmup`` with gamma and
power 1), so the first update copies the weights, the next ones average all steps so far, and the configured decay
rules once its window ``1 / (1 - ema)`` is reached: the average never leans on the untrained weights. n is the run's
step count, which a resume restores.

Only trained parameters move (and floating buffers, e.g. a trained BatchNorm's statistics): the copy of a locked
tower stays exactly the model's. A checkpoint stores just those averaged entries (``ema_state``); a resume rebuilds
the rest from the resumed model.
"""
from __future__ import annotations

from typing import Optional

import torch
from timm.utils import ModelEmaV3


def build_ema(model: torch.nn.Module, decay: Optional[float]) -> Optional[ModelEmaV3]:
    """An averaged copy of ``model`` (in eval mode) for ``train.ema`` = ``decay``; None when it is off."""
    if not decay:
        return None
    ema = ModelEmaV3(model, decay=decay, use_warmup=True, warmup_gamma=1.0, warmup_power=1.0)
    ema.module.requires_grad_(False)
    return ema


def averaged_keys(model: torch.nn.Module) -> list[str]:
    """State-dict keys the average can move: trained parameters and floating buffers."""
    moving = {n for n, p in model.named_parameters() if p.requires_grad}
    moving |= {n for n, b in model.named_buffers() if b.is_floating_point()}
    return [k for k in model.state_dict() if k in moving]


def ema_state(ema: ModelEmaV3, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The averaged entries of ``ema`` (keys of ``averaged_keys(model)``), for a checkpoint."""
    state = ema.module.state_dict()
    return {k: state[k] for k in averaged_keys(model)}


def load_ema_state(ema: ModelEmaV3, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore what ``ema_state`` saved into ``ema`` (a fresh copy of the resumed ``model``).

    Raises:
        KeyError: ``state`` lacks an entry this model averages (another model or other trained towers).
    """
    missing = [k for k in averaged_keys(model) if k not in state]
    if missing:
        raise KeyError(f"the EMA state lacks {missing[0]} ({len(missing)} entries)")
    ema.module.load_state_dict(state, strict=False)
