"""What machine a benchmark ran on, recorded in every result JSON.

Two machines of the same "2 cores, AVX-512" description can differ several-fold where these benchmarks care: a
CPU with AMX tiles multiplies bf16 matrices at ~6x its fp32 rate, one with only AVX512-BF16 at ~2x. A number is
only comparable with another measured on the same CPU model and instruction set, so both are written down.
"""
from __future__ import annotations

import os
import platform
import sys

# the instruction-set extensions that move this project's numbers (bf16 / int8 matrix products, fp16 conversion)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16",
             "amx_int8")


def cpu_model_and_flags(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """The first processor's model name and which of ``ISA_FLAGS`` it has, from ``/proc/cpuinfo``.

    Elsewhere (no such file): ``platform.processor()`` and no flags."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return platform.processor() or platform.machine(), []
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:   # Features: aarch64
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), [f for f in ISA_FLAGS if f in flags]


def machine_info() -> dict:
    """CPU model, instruction-set flags, cores, platform, Python, torch (when imported) and the 1-minute load."""
    model, flags = cpu_model_and_flags()
    info = {"cpu_model": model, "isa": flags, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(),
            # other processes competing for the cores make every rate smaller
            "load_average_1min_at_start": round(os.getloadavg()[0], 2)}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
    return info
