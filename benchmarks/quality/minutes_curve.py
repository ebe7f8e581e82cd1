"""The minutes curve: how much the photo recipe's val R@5 gains from a longer budget, on each CPU kind.

    python benchmarks/quality/minutes_curve.py --budgets 10 20 \
        --reuse 30=benchmarks/results/quality/quality_flickr8k_vit_nobf16.json

Each budget is its own run of ``benchmarks/quality/quality_flickr8k.py`` with the config as the README runs it
(``--variants NAME=configs/flickr8k-vit.yaml --budget-min N``): the trainer fits its schedule to that budget, so the
point at 10 minutes is what a user who trains for 10 minutes gets, not the 30-minute run read at minute 10. Val
only: the test split is never read here. ``--reuse N=JSON`` takes budget N from a run already made with the same
command (the val numbers of its ``best/``), instead of training again.

Points go to ``benchmarks/results/quality/minutes_curve.json`` under the CPU kind of the machine (points of other
kinds already there are kept), and the plot of every kind's points to ``minutes_curve.png`` beside it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo, scrub_paths  # noqa: E402

OUT = ROOT / "benchmarks/results/quality/minutes_curve.json"
CONFIG = "configs/flickr8k-vit.yaml"
METRICS = ("t2i_r1", "t2i_r5", "t2i_r10", "i2t_r1", "i2t_r5", "i2t_r10", "rsum")


def run_budget(minutes: float, config: str, kind: str) -> Path:
    """One quality_flickr8k.py run at ``minutes`` (val only); returns its JSON."""
    name = f"curve{minutes:g}"
    result = ROOT / f"benchmarks/results/quality/quality_flickr8k_vit_{kind}_{minutes:g}min.json"
    cmd = [sys.executable, "benchmarks/quality/quality_flickr8k.py", "--variants", f"{name}={config}",
           "--budget-min", f"{minutes:g}", "--result", str(result)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return result


def point(minutes: float, path: Path) -> dict:
    """The val numbers of a run's ``best/`` at one budget, with what it ran and where it came from."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    (r,) = doc["results"]
    best = r["best"]
    return {"minutes": minutes, "val": {k: round(best["val"][k], 4) for k in METRICS},
            "steps": r.get("steps_done"), "epochs": r.get("epochs_done"), "wall_s": r.get("wall_s"),
            "precision_section": r.get("precision_section"), "load_avg_mean": r.get("load_avg_mean"),
            "json": relative_to_repo(path), "command": scrub_paths(r.get("command"))}


def plot(curves: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, c in sorted(curves.items()):
        pts = sorted(c["points"], key=lambda p: p["minutes"])
        x = [p["minutes"] for p in pts]
        line, = ax.plot(x, [p["val"]["t2i_r5"] for p in pts], "o-", label=f"{kind}: text→image")
        ax.plot(x, [p["val"]["i2t_r5"] for p in pts], "s--", color=line.get_color(), label=f"{kind}: image→text")
    ax.set_xlabel("training budget (minutes, everything included)")
    ax.set_ylabel("Flickr8k val R@5")
    ax.set_title(f"{CONFIG}: val R@5 by budget, 2 cores")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(png)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=float, nargs="*", default=[10, 20, 30, 60], help="minutes, one run each")
    p.add_argument("--reuse", action="append", default=[], metavar="MINUTES=JSON",
                   help="take this budget from a quality_flickr8k.py JSON already made with the same command")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    machine = machine_info()
    kind = machine.get("cpu_kind") or "unknown"
    reuse = {}
    for text in args.reuse:
        minutes, _, path = text.partition("=")
        reuse[float(minutes)] = Path(path)
    points = [point(m, reuse[m]) for m in sorted(reuse)]
    for minutes in sorted(set(args.budgets) - set(reuse)):
        points.append(point(minutes, run_budget(minutes, args.config, kind)))
    doc = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    curves = doc.get("curves", {})
    kept = {p["minutes"]: p for p in curves.get(kind, {}).get("points", [])}
    kept.update({p["minutes"]: p for p in points})
    curves[kind] = {"machine": machine, "points": sorted(kept.values(), key=lambda p: p["minutes"])}
    result = {"benchmark": "minutes_curve", "machine": machine, "config": args.config,
              "protocol": "one quality_flickr8k.py run per budget (the trainer fits its schedule to it); val R@5 of "
                          "best/; the test split is never read",
              "plot": relative_to_repo(args.out.with_suffix(".png")), "curves": curves}
    write_result(args.out, result)
    plot(curves, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
