"""Which device to compute on: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:i"``.

Every entry point that runs a tower (``clip_mini.load``, ``index``, ``search``, ``eval``, ``attention``, ``serve``)
resolves its ``device`` argument here, so they agree on what "auto" means and fail the same way when a GPU is asked
for but absent. Loader settings that only help on a GPU (pinned memory, non-blocking copies) come from here too.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Union

import torch

from clip_mini.errors import ClipMiniError

DeviceArg = Union[str, torch.device, None]
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceError(ClipMiniError, ValueError):
    """A device that does not exist here (e.g. ``cuda`` on a machine without a GPU) or is misspelled."""


def resolve_device(device: DeviceArg = "auto") -> torch.device:
    """``"auto"`` / ``None`` -> ``cuda`` when available, else ``cpu``; ``"cuda[:i]"`` checked to exist.

    Raises:
        DeviceError: unknown spelling, CUDA asked for but not available, or a GPU index out of range.
    """
    if isinstance(device, torch.device):
        device = str(device)
    spec = (device or "auto").strip().lower()
    m = _SPEC.match(spec)
    if m is None or (m.group(1) != "cuda" and m.group(2) is not None):
        raise DeviceError(f"unknown device {device!r}: use {DEVICE_CHOICES}")
    if m.group(1) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if m.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} asked for, but CUDA is not available here (torch {torch.__version__}, "
                          f"built for CUDA {torch.version.cuda}); use --device cpu or auto")
    index = int(m.group(2) or 0)
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def loader_options(device: torch.device) -> dict:
    """DataLoader keyword arguments for feeding ``device``: pinned host memory when copying to a GPU."""
    return {"pin_memory": device.type == "cuda"}


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy to ``device``; asynchronous from pinned memory to a GPU (the next batch decodes meanwhile)."""
    return x.to(device, non_blocking=device.type == "cuda")


def enable_tf32(device: torch.device) -> None:
    """TF32 matmuls and convolutions on CUDA (Ampere and newer): ~fp32 accuracy for training, several times faster."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 runs natively fast on ``device``: a CUDA GPU with bf16, or a CPU with AVX-512 BF16 or AMX.

    On such a CPU a bf16 matmul is much faster than an fp32 one; without those instructions bf16 is emulated and slower than
    fp32, so "auto" precision picks fp32 there. Reads the Linux CPU flags; elsewhere answers False (fp32).
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_precision(precision: Optional[str], device: torch.device) -> str:
    """``"auto"`` / None -> ``"bf16"`` where ``fast_bf16(device)``, else ``"fp32"``; anything else unchanged."""
    if precision in (None, "auto"):
        return "bf16" if fast_bf16(device) else "fp32"
    return precision


def loader_workers(workers: Optional[int]) -> int:
    """``data.workers`` / ``--workers`` unset (None): 0 on a CPU-only machine (worker processes would compete with
    the model for the cores), 4 where CUDA is available (a GPU step outruns one process decoding its images)."""
    if workers is not None:
        return workers
    return min(4, os.cpu_count() or 1) if torch.cuda.is_available() else 0


def default_workers(workers: Optional[int], device: torch.device) -> int:
    """Image-decoding DataLoader workers for an embedding pass (``index``, ``eval``): ``workers`` when given; else
    4 processes on a GPU (decoding is then the bottleneck) and none on a CPU: there the model's forward already
    uses every core, and a decoding process beside it gains nothing clear over decoding in between batches, on
    small photos or camera-size ones (``benchmarks/results/speed/index.json``; large JPEGs decode at reduced scale,
    ``load_image(min_size=)``, which keeps decoding cheap). ``--workers 1`` still overlaps decoding where a CPU has
    cores to spare."""
    if workers is not None:
        return workers
    # an embedder of the user's own may say its device as a string ("cpu", "cuda:0")
    if torch.device(device).type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cores)
