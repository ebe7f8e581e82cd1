"""Distributed set-up from ``torchrun``'s environment, and rank-0 helpers.

``torchrun --nproc_per_node=N train.py ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous
address; a plain ``python train.py`` sets none of them and runs as a single process. The backend is nccl when
CUDA is available, else gloo (CPU). Only rank 0 writes files and prints.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from clip_mini.runtime.devices import enable_tf32


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


def init_distributed() -> DistInfo:
    """Join the process group when launched by torchrun; pick this process's device."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        enable_tf32(device)   # TF32 matmuls: fp32 training at several times the speed on Ampere and newer
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return DistInfo(rank, world_size, local_rank, local_world, device)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (any picklable value; only ever our own values, never user files)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over all ranks (so every rank runs the same number of steps)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)   # nccl reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def default_threads(info: DistInfo) -> int:
    """CPU threads per process: the cores shared evenly among this machine's processes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, info.local_world_size))
