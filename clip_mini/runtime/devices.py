"""Which device to compute on: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:i"``.

Every entry point that runs a tower (``clip_mini.load``, ``index``, ``search``, ``eval``, ``attention``, ``serve``)
resolves its ``device`` argument here, so they agree on what "auto" means and fail the same way when a GPU is asked
for but absent. Loader settings that only help on a GPU (pinned memory, non-blocking copies) come from here too.
"""
from __future__ import annotations

import os
import re
import warnings
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch

from clip_mini.errors import DeviceError, PrecisionError
from clip_mini.runtime.isa import cpu_native_bf16

DeviceArg = Union[str, torch.device, None]
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


PRECISIONS = ("fp32", "bf16", "fp16")


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
    """TF32 matmuls and convolutions on CUDA (Ampere and newer): ~fp32 accuracy, several times faster.

    One policy for every pass on a GPU (training, its evaluations, ``clip-mini eval``, indexing, embedding), so a
    run's validation numbers and ``clip-mini eval`` of its model are computed the same way."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


@contextmanager
def tf32_disabled() -> Iterator[None]:
    """Full fp32 matmuls and convolutions inside the block, the previous settings restored after: for parity
    checks whose tolerance TF32's 10-bit mantissa would exceed (e.g. the BatchNorm fold check)."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    cuda_matmul = torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn
        torch.backends.cuda.matmul.allow_tf32 = cuda_matmul


def use_device(device: DeviceArg) -> torch.device:
    """Make ``device`` this process's current CUDA device and turn TF32 on for it; nothing on a CPU.

    Called before anything touches CUDA (pinned host memory, loader pin threads, a model copy): each of those
    opens a context on the *current* device, and without ``set_device`` that is GPU 0 whatever ``device`` says
    (about half a GB per process there, for nothing).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        enable_tf32(device)
    return device


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 runs natively fast on ``device``: a CUDA GPU of compute capability 8.0 or newer (Ampere on),
    or a CPU with AVX-512 BF16 or AMX that oneDNN may use (``runtime.isa.cpu_native_bf16``).

    Older GPUs (V100: 7.0, T4: 7.5) have no bf16 units: ``torch.cuda.is_bf16_supported()`` still answers True
    there (bf16 emulated in fp32 units) and asks about the *current* device, not ``device``; the capability of
    ``device`` itself is what matters. On a CPU without those instructions bf16 is emulated and slower than fp32.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return cpu_native_bf16()


def resolve_precision(precision: Optional[str], device: torch.device, warn: bool = True) -> str:
    """The one rule for a compute dtype: ``"auto"`` / None -> ``"bf16"`` where ``fast_bf16(device)``, else
    ``"fp32"``; an explicit choice is kept.

    "auto" never picks fp16 on an older GPU by itself (fp16's range can overflow a tower's activations); there
    ``--precision fp16`` is the fast choice to ask for (``precision_hint``). An explicit ``"bf16"`` on a CPU without
    native bf16 runs, with one warning naming its cost; on a GPU without bf16 units it is refused.

    Raises:
        PrecisionError: an unknown name, or bf16 asked of a GPU that has no bf16 units.
    """
    if precision in (None, "auto"):
        return "bf16" if fast_bf16(device) else "fp32"
    if precision not in PRECISIONS:
        raise PrecisionError(f"unknown precision {precision!r}: use {', '.join(('auto',) + PRECISIONS)}")
    device = torch.device(device)
    if precision == "bf16" and not fast_bf16(device):
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            raise PrecisionError(f"bf16 asked for on {torch.cuda.get_device_name(device)} (compute capability "
                                 f"{major}.{minor}), which has no bf16 units: use fp16 (with loss scaling) or auto")
        if warn:   # once per calling line, as Python shows a RuntimeWarning
            warnings.warn("bf16 asked for on a CPU without native bf16 (no AVX512-BF16 or AMX here, or oneDNN capped "
                          "below them): it is emulated, about 2.3-2.7x slower than fp32 for a training step; "
                          "precision auto picks fp32 here", RuntimeWarning, stacklevel=2)
    return precision


def precision_hint(precision: str, device: torch.device) -> Optional[str]:
    """A line for the user when ``precision`` leaves an older GPU's fp16 tensor cores unused, else None."""
    device = torch.device(device)
    if device.type != "cuda" or precision != "fp32" or fast_bf16(device):
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no bf16 units: "
            f"--precision fp16 runs its fp16 tensor cores (check the results against fp32 once)")


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or ``taskset``'s share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _local_processes() -> int:
    """Processes sharing this machine's cores: torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def loader_workers(workers: Optional[int]) -> int:
    """``data.workers`` / ``--workers`` unset (None): 0 on a CPU-only machine (worker processes would compete with
    the model for the cores), else up to 4 per process where CUDA is available (a GPU step outruns one process
    decoding its images), never more than this process's share of the cores it may run on (the affinity mask
    divided among torchrun's ``LOCAL_WORLD_SIZE`` processes, so 8 ranks on 16 cores get 2 each, not 4)."""
    if workers is not None:
        return workers
    if not torch.cuda.is_available():
        return 0
    return max(1, min(4, _cores() // _local_processes()))


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
    return max(1, min(4, _cores() // _local_processes()))
