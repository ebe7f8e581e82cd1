"""Distributed set-up from ``torchrun``'s environment, and rank-0 helpers.

``torchrun --nproc_per_node=N train.py ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous
address; a plain ``python train.py`` sets none of them and runs as a single process. The backend is nccl when the
ranks train on GPUs (``train.device``), else gloo (CPU). Only rank 0 writes files and prints.

Two kinds of wait, two timeouts. The collectives of a training step (the loss's all_gather, DDP's all-reduce)
take milliseconds, so a rank stuck there for ``STEP_TIMEOUT`` is a hang worth failing on. The waits around work
one rank does alone or unevenly (the frozen-feature pass, rank 0's evaluations and checkpoint writes, the
tokenizer) can take hours on a large split; ``barrier``, ``broadcast`` and ``gather`` run those on a gloo side
group with ``LONG_WAIT``, as ``clip-mini index`` does for its shards, so that they never trip the step timeout
(NCCL's default is 10 minutes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from clip_mini.config import ConfigError
from clip_mini.runtime.devices import DeviceError, resolve_device, use_device

STEP_TIMEOUT = timedelta(minutes=30)
LONG_WAIT = timedelta(hours=48)
_side: Optional[Any] = None   # the gloo group for long waits, while a process group is up


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer (set by torchrun)") from None


def train_device(spec: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """This process's device for ``train.device``: ``auto`` (this rank's GPU when CUDA is available, else the
    CPU), ``cpu``, ``cuda`` (``cuda:LOCAL_RANK`` under torchrun) or ``cuda:N`` (one process only).

    Raises:
        ConfigError: naming ``train.device``: misspelt, CUDA absent, too few GPUs, or ``cuda:N`` under torchrun.
    """
    spec = str(spec or "auto").strip().lower()
    try:
        if spec == "auto":
            spec = "cuda" if torch.cuda.is_available() else "cpu"
        device = resolve_device(spec)
        if spec == "cuda":
            return resolve_device(f"cuda:{local_rank}")
    except DeviceError as e:
        raise ConfigError(f"train.device: {e}".replace("--device ", "train.device=")) from None
    if device.type == "cuda" and world_size > 1:
        raise ConfigError(f"train.device={spec} names one GPU, but {world_size} processes train: use "
                          "train.device=cuda (each rank takes cuda:LOCAL_RANK) and CUDA_VISIBLE_DEVICES to choose GPUs")
    return device


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun (or use the one already joined); pick and make current
    this process's device (``train.device``), before anything allocates on a GPU."""
    global _side
    if dist.is_available() and dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank if world_size > 1 else 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    dev = use_device(train_device(device, local_rank, world_size))   # TF32 on: several times fp32's speed
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", timeout=STEP_TIMEOUT)
    if world_size > 1 and _side is None:
        _side = dist.new_group(backend="gloo", timeout=LONG_WAIT)
    return DistInfo(rank, world_size, local_rank, local_world, dev)


def cleanup() -> None:
    global _side
    _side = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _group():
    return _side if _side is not None else dist.group.WORLD


def barrier() -> None:
    """Wait for every rank (on the long-wait group: one rank may be busy for hours)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=_group())


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (any picklable value; only ever our own values, never user files)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_group())
    return box[0]


def gather(obj: Any) -> Optional[list]:
    """Every rank's ``obj`` as a list on rank 0 (None on the others); ``[obj]`` in a single process. Our own
    values only (they are pickled), e.g. each rank's random-number state for the checkpoint."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=_group())
    return out


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams (dropout, drop-path, patch-drop): ``seed`` itself on rank 0, so
    a single process draws as it always did; a distinct mix of ``(seed, rank)`` elsewhere, so no two ranks draw
    the same masks."""
    if rank == 0:
        return seed
    import numpy as np

    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> 1)


def all_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over all ranks (so every rank runs the same number of steps)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)   # nccl reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_max(value: int | float, device: torch.device) -> int | float:
    """The largest ``value`` over all ranks (a flag any one rank raises: a re-fit, a stop; a time one rank measured)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64 if isinstance(value, float) else torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return type(value)(t.item())


def default_threads(info: DistInfo) -> int:
    """CPU threads per process: the cores shared evenly among this machine's processes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, info.local_world_size))
