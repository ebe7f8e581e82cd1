"""Console output shared by the commands: JSON for scripts, tables for people, numbers rounded for both."""
from __future__ import annotations

import json
import math
import sys

SIGNIFICANT = 6   # a float32 score or metric carries ~7 digits; more is noise (0.002222222276031971)


def rounded(obj):
    """``obj`` with every float rounded to ``SIGNIFICANT`` significant digits (nested dicts and lists too)."""
    if isinstance(obj, float):
        return obj if not math.isfinite(obj) or obj == 0 else float(f"{obj:.{SIGNIFICANT}g}")
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
