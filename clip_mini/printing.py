"""Console output shared by the commands: JSON for scripts, tables for people."""
from __future__ import annotations

import json
import sys


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_results(results: list[dict]) -> None:
    """A ranked result table: rank, score, path (and caption when any result has one)."""
    with_captions = any(r.get("caption") for r in results)
    print(f"{'rank':>4}  {'score':>7}  path" + ("  caption" if with_captions else ""))
    for r in results:
        caption = f"  {r['caption'][:80]}" if with_captions else ""
        print(f"{r['rank']:>4}  {r['score']:>7.4f}  {r['path']}{caption}")
