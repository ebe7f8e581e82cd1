"""The test-split ledger from the command line: its count, and the one-off back-fill from the quality JSONs.

    python benchmarks/lib/ledger.py              # how many scorings, by CPU
    python benchmarks/lib/ledger.py --backfill   # one-off: the ledger from the quality JSONs (refuses if it exists)

The ledger itself (where it lives, the line format, and ``record_test_scoring``, through which every test
scoring writes its line before it reads the split) is ``clip_mini/eval/ledger.py``. Back-filled lines also carry
``backfilled: true`` and ``json_added`` (the commit that added the source JSON and its date: when the scoring was
at the latest).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUALITY = ROOT / "benchmarks/results/quality"
sys.path.insert(0, str(ROOT))
from clip_mini.eval.ledger import LEDGER, append_line, read_ledger, repo_relative  # noqa: E402


def cpu_stamp(machine: dict) -> dict:
    """``{"model", "amx"}`` from a result JSON's ``machine`` stamp (as ``clip_mini.eval.ledger.cpu_stamp`` stamps
    this machine)."""
    if not machine.get("cpu_model"):
        return {"model": None, "amx": None}
    return {"model": machine["cpu_model"], "amx": "amx_bf16" in machine.get("isa", [])}


def _git_added(path: Path) -> dict | None:
    """The first commit that added ``path`` (following renames) and its author date."""
    try:
        out = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%H %aI", "--", str(path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": out[-2], "date": out[-1]} if len(out) >= 2 else None


def backfill_records(reports: list[Path]) -> list[dict]:
    """One record per variant of each quality report that scored test (best and/or final)."""
    out = []
    for path in sorted(reports):
        report = json.loads(path.read_text(encoding="utf-8"))
        if report.get("reported_split") != "test":
            continue
        added = _git_added(path)
        for r in report.get("results", []):
            test = {w: r[w]["test"] for w in ("best", "final") if isinstance(r.get(w), dict) and r[w].get("test")}
            if not test:
                continue
            images = {r[w].get("test_images") for w in test} - {None}
            out.append({"date": report.get("date"), "variant": r["variant"], "config": r.get("config"),
                        "config_hash": None, "commit": report.get("commit"),
                        "cpu": cpu_stamp(report.get("machine") or {}),
                        "test": test, "test_images": images.pop() if len(images) == 1 else None,
                        "source": repo_relative(path), "backfilled": True, "json_added": added})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backfill", action="store_true", help="write the ledger from the quality JSONs (new file only)")
    args = p.parse_args(argv)
    if args.backfill:
        if LEDGER.exists():
            print(f"error: {LEDGER} exists; back-filling again would count scorings twice", file=sys.stderr)
            return 2
        for rec in backfill_records(list(QUALITY.glob("quality_flickr8k_*.json"))):
            append_line(rec)
    recs = read_ledger()
    cpus = Counter(("AMX" if r["cpu"].get("amx") else "no AMX") if r.get("cpu", {}).get("model") else "not recorded"
                   for r in recs)
    print(f"{len(recs)} test scorings in {repo_relative(LEDGER)}: " + ", ".join(f"{k} {v}" for k, v in cpus.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
