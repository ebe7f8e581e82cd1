"""The test-split ledger: one JSON line for every time a model was scored on the Flickr8k test split.

    python benchmarks/lib/ledger.py              # how many scorings, by CPU
    python benchmarks/lib/ledger.py --backfill   # one-off: the ledger from the quality JSONs (refuses if it exists)

Test numbers are only worth something while the split decides nothing; a ledger makes the number of looks
visible (benchmarks/RESULTS.md prints the count). Whatever scores test appends a line with
``append_test_scoring(...)``; races between variants should report val only.

A line: ``date`` (UTC, ISO 8601; null when not recorded), ``variant``, ``config`` (path), ``config_hash``
(sha256 of the resolved config, null when not recoverable), ``commit`` (git HEAD, ``-dirty`` when the tree had
changes; null when not recorded), ``cpu`` (``model``, ``amx``), ``test`` (model name -> metrics, e.g.
``{"best": {"t2i_r5": ...}, "final": {...}}``), ``test_images`` and ``source`` (the result JSON, relative to the
repository). Back-filled lines also carry ``backfilled: true`` and ``json_added`` (the commit that added the
source JSON and its date: when the scoring was at the latest).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEDGER = ROOT / "benchmarks/results/quality/test_ledger.jsonl"
QUALITY = ROOT / "benchmarks/results/quality"


class LedgerError(ValueError):
    """A ledger line that is not a JSON object (names the file and line)."""


def config_hash(resolved: dict) -> str:
    """sha256 of a resolved config (a nested dict), independent of key order."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def current_commit(root: Path = ROOT) -> str | None:
    """git HEAD of ``root`` with ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def cpu_stamp(machine: dict | None = None) -> dict:
    """``{"model", "amx"}`` from a result JSON's ``machine`` stamp, or of this machine when None."""
    if machine is None:
        from benchmarks.lib.machine import cpu_model_and_flags

        model, isa = cpu_model_and_flags()
        return {"model": model, "amx": "amx_bf16" in isa}
    if not machine.get("cpu_model"):
        return {"model": None, "amx": None}
    return {"model": machine["cpu_model"], "amx": "amx_bf16" in machine.get("isa", [])}


def _relative(path: str | os.PathLike) -> str:
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return p.as_posix()


def append_test_scoring(*, variant: str, test: dict, source: str | os.PathLike, config: str | None = None,
                        config_hash: str | None = None, commit: str | None = "auto", cpu: dict | None = None,
                        date: str | None = "auto", test_images: int | None = None,
                        ledger: str | os.PathLike = LEDGER, **extra) -> dict:
    """Append one test scoring to the ledger as one line, atomically, and return the record.

    ``test`` maps a model name to its metrics (``{"best": {...}, "final": {...}}``). ``commit="auto"`` reads git
    HEAD, ``date="auto"`` is now (UTC), ``cpu=None`` stamps this machine. Writers are serialised by a lock file
    beside the ledger, and the line goes out in one ``write`` on an ``O_APPEND`` descriptor, then fsync: a reader
    sees whole lines only. A torn last line left by a crash stays on a line of its own (``read_ledger`` names it).
    """
    from filelock import FileLock

    if not variant or not isinstance(test, dict) or not test:
        raise ValueError("append_test_scoring needs a variant and the test metrics")
    record = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds") if date == "auto" else date,
              "variant": variant, "config": config, "config_hash": config_hash,
              "commit": current_commit() if commit == "auto" else commit,
              "cpu": cpu_stamp() if cpu is None else cpu, "test": test, "test_images": test_images,
              "source": _relative(source), **extra}
    line = (json.dumps(record, sort_keys=False, allow_nan=False) + "\n").encode()
    path = Path(ledger)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=60):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size:
                with open(path, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        line = b"\n" + line
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    return record


def read_ledger(ledger: str | os.PathLike = LEDGER) -> list[dict]:
    """Every scoring in the ledger (an absent ledger is empty); a line that is not a JSON object is an error."""
    path = Path(ledger)
    if not path.exists():
        return []
    out = []
    for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise LedgerError(f"{path}:{n}: not a JSON line ({e.msg})") from None
        if not isinstance(rec, dict) or "variant" not in rec or "test" not in rec:
            raise LedgerError(f"{path}:{n}: not a test scoring (needs variant and test)")
        out.append(rec)
    return out


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
                        "config_hash": None, "commit": report.get("commit"), "cpu": cpu_stamp(report.get("machine")),
                        "test": test, "test_images": images.pop() if len(images) == 1 else None,
                        "source": _relative(path), "backfilled": True, "json_added": added})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ledger", type=Path, default=LEDGER)
    p.add_argument("--backfill", action="store_true", help="write the ledger from the quality JSONs (new file only)")
    args = p.parse_args(argv)
    if args.backfill:
        if args.ledger.exists():
            print(f"error: {args.ledger} exists; back-filling again would count scorings twice", file=sys.stderr)
            return 2
        for rec in backfill_records(list(QUALITY.glob("quality_flickr8k_*.json"))):
            append_test_scoring(ledger=args.ledger, **rec)
    recs = read_ledger(args.ledger)
    cpus = Counter(("AMX" if r["cpu"].get("amx") else "no AMX") if r.get("cpu", {}).get("model") else "not recorded"
                   for r in recs)
    print(f"{len(recs)} test scorings in {_relative(args.ledger)}: " + ", ".join(f"{k} {v}" for k, v in cpus.items()))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
