"""What machine a benchmark ran on, recorded in every result JSON; run as a script, also what it can do.

    python benchmarks/lib/machine.py   # -> benchmarks/results/speed/machine.json: the CPU, matmul peaks, memory reads

Two machines of the same "2 cores, AVX-512" description can differ several-fold where these benchmarks care: a
CPU with AMX tiles multiplies bf16 matrices at ~6x its fp32 rate, one with only AVX512-BF16 at ~2x. A number is
only comparable with another measured on the same CPU model and instruction set, so both are written down.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

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
    from clip_mini.runtime.isa import cpu_record

    rec = cpu_record()   # the CPU kind as the compute dtype sees it, oneDNN's cap, what precision auto picks here
    info.update(cpu_kind=rec["kind"], onednn_max_cpu_isa=rec["onednn_max_cpu_isa"], auto_precision=rec["auto_precision"])
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
    return info


def write_result(path: str | Path, result: dict) -> dict:
    """A benchmark's last step: the 1-minute load average at the end into ``result["machine"]``, the JSON written
    atomically to ``path`` and printed; returns ``result``."""
    from clip_mini.fileio.atomic import atomic_write_json

    result["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
    atomic_write_json(path, result)
    print(json.dumps(result, indent=2))
    return result


def matmul_peak(dtype, n: int = 2048, seconds: float = 0.5) -> float:
    """GFLOP/s of a square matmul on this machine (fastest of the repeats within ``seconds``). A bf16 product on a CPU
    without native bf16 is emulated on one core (one 2048^3 product took minutes on the AVX2 EPYC): ``n`` is capped
    at 256 there, as for float16, which is emulated everywhere."""
    import torch

    from clip_mini.runtime.isa import cpu_native_bf16

    if dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_native_bf16()):
        n = min(n, 256)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def read_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """GB/s of one pass summing a float32 array larger than any cache (fastest of ``repeats``)."""
    import numpy as np

    x = np.ones(int(gigabytes * 1e9) // 4, np.float32)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "benchmarks/results/speed/machine.json"))
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    result = {"machine": machine_info(),
              "matmul_gflops": {"float32": round(matmul_peak(torch.float32), 1),
                                "bfloat16": round(matmul_peak(torch.bfloat16), 1),
                                # fp16 products are emulated on CPUs without AVX512-FP16/AMX-FP16: a small n is enough
                                "float16": round(matmul_peak(torch.float16, n=256), 2)},
              "matmul_n": {"float32": 2048, "bfloat16": 2048, "float16": 256},
              "read_gb_per_s": round(read_bandwidth(), 1), "read_gigabytes": 1.0}
    result["bf16_over_fp32"] = round(result["matmul_gflops"]["bfloat16"] / result["matmul_gflops"]["float32"], 2)
    result["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from clip_mini.fileio.atomic import atomic_write_json

    atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
