"""Console output shared by the commands: JSON for scripts, tables for people, numbers rounded for both."""
from __future__ import annotations

import json
import math
import struct
import sys


def _as_float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def short_float(x: float) -> float:
    """The shortest decimal that reads back as the same float32: scores and metrics are float32, and the digits a
    float64 print adds beyond that are noise (0.002222222276031971 prints as 0.0022222223)."""
    if not math.isfinite(x) or x == 0 or abs(x) > 3.4e38:
        return x
    target = _as_float32(x)
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if _as_float32(candidate) == target:
            return candidate
    return x


def rounded(obj):
    """``obj`` with every float shortened by ``short_float`` (nested dicts and lists too)."""
    if isinstance(obj, float):
        return short_float(obj)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v) for v in obj]
    return obj


def print_json(obj) -> None:
    json.dump(rounded(obj), sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_results(results: list[dict]) -> None:
    """A ranked result table: rank, score, path (and caption when any result has one)."""
    with_captions = any(r.get("caption") for r in results)
    print(f"{'rank':>4}  {'score':>7}  path" + ("  caption" if with_captions else ""))
    for r in results:
        caption = f"  {r['caption'][:80]}" if with_captions else ""
        print(f"{r['rank']:>4}  {r['score']:>7.4f}  {r['path']}{caption}")
