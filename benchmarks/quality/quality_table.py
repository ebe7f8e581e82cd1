"""Print the README's quality table (markdown) from benchmarks/results/quality_flickr8k_*.json.

    python benchmarks/quality/quality_table.py benchmarks/results/quality/quality_flickr8k_d.json benchmarks/results/quality/quality_flickr8k_vit.json

One row per variant and model (best/ selected on val, final/): test recall@1/5/10 and median rank both ways, the
val rsum the trainer measured for that model, epochs and wall time. Numbers are printed at three decimals, as
benchmarks/lib/check_readme.py expects to find them in the JSONs.
"""
from __future__ import annotations

import json
import sys


def rows(path: str) -> list[str]:
    report = json.load(open(path))
    out = []
    for r in report["results"]:
        if "skipped" in r or "error" in r:
            out.append(f"| {r['variant']} | {r.get('skipped') or r.get('error')} |")
            continue
        for which in ("best", "final"):
            m = r[which]
            if which == "final" and m.get("same_as_best"):
                continue
            t, v = m["test"], m["val"]
            label = "best = final" if r["final"].get("same_as_best") else which
            val_rsum = "–" if v.get("rsum") is None else f"{v['rsum']:.3f}"
            out.append(
                f"| {r['variant']} | {label} (epoch {m['epoch']}) | {r['wall_s']:.0f} s | "
                f"{t['t2i_r1']:.3f} | {t['t2i_r5']:.3f} | {t['t2i_r10']:.3f} | {t['t2i_medr']:g} | "
                f"{t['i2t_r1']:.3f} | {t['i2t_r5']:.3f} | {t['i2t_r10']:.3f} | {t['i2t_medr']:g} | {val_rsum} |")
    return out


def main(paths: list[str]) -> None:
    print("| variant | model | wall | t2i R@1 | R@5 | R@10 | medr | i2t R@1 | R@5 | R@10 | medr | val rsum |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        print("\n".join(rows(p)))


if __name__ == "__main__":
    main(sys.argv[1:])
