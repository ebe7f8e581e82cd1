"""What this CPU computes natively, read without importing torch (the torch-free search path asks too).

bf16 is native only with AVX512-BF16 or AMX: elsewhere a bf16 matmul is emulated (a training step 2.3-2.7x slower
than fp32 on an Ice Lake Xeon) and fp32 is the fast dtype. fp16 arithmetic is emulated on every CPU kind.

``ONEDNN_MAX_CPU_ISA`` (or its old name ``DNNL_MAX_CPU_ISA``) caps the instructions oneDNN may use: a cap below
``AVX512_CORE_BF16`` makes bf16 emulated on any CPU, so it counts as "no native bf16" here. That is how an AMX box
stands in for the other CPU kinds: ``AVX512_CORE_BF16`` (bf16 without AMX), ``AVX512_CORE_VNNI`` (no bf16).
"""
from __future__ import annotations

import functools
import os
import platform

# oneDNN's ISA names, lowest first (oneDNN's `dnnl_cpu_isa_t`); a cap at or above AVX512_CORE_BF16 keeps bf16
_ISA_ORDER = ["SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
              "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
              "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "DEFAULT", "ALL"]
_BF16_FLOOR = _ISA_ORDER.index("AVX512_CORE_BF16")
_AMX_FLOOR = _ISA_ORDER.index("AVX10_1_512_AMX")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The Linux CPU flags (``/proc/cpuinfo``); empty elsewhere (then nothing counts as native)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def onednn_cap() -> str | None:
    """The ISA cap set for oneDNN by the environment (upper case), or None."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap and cap.strip() else None


def _cap_allows(floor: int) -> bool:
    cap = onednn_cap()
    if cap is None or cap not in _ISA_ORDER:   # an unknown name: oneDNN ignores it too
        return True
    return _ISA_ORDER.index(cap) >= floor


def cpu_native_bf16() -> bool:
    """Whether bf16 matmuls run natively on this CPU: AVX512-BF16 or AMX, and no oneDNN cap below them."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and _cap_allows(_BF16_FLOOR)


def cpu_amx() -> bool:
    """Whether oneDNN may use AMX tiles here (the flag, and no cap below AMX)."""
    return "amx_bf16" in cpu_flags() and _cap_allows(_AMX_FLOOR)


def cpu_kind() -> str:
    """A short name of the CPU kind as far as the compute dtype goes: ``amx``, ``avx512_bf16`` or ``no_bf16``."""
    if cpu_amx():
        return "amx"
    return "avx512_bf16" if cpu_native_bf16() else "no_bf16"


def cpu_record() -> dict:
    """What a benchmark JSON records about the CPU: its name, the flags that decide the dtype, the oneDNN cap, the
    kind that follows (``cpu_kind``) and the compute dtype ``precision: auto`` picks on it."""
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    flags = cpu_flags()
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "onednn_max_cpu_isa": onednn_cap(), "kind": cpu_kind(),
            "auto_precision": "bf16" if cpu_native_bf16() else "fp32"}
