"""The test-split ledger (benchmarks/lib/ledger.py): atomic appends, a reader that names a bad line, and a
back-fill that holds every quality JSON with test numbers."""
import json
import multiprocessing
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import ledger  # noqa: E402

TEST = {"best": {"t2i_r5": 0.5, "i2t_r5": 0.6}}


def test_append_then_read_back(tmp_path):
    path = tmp_path / "q" / "ledger.jsonl"
    a = ledger.append_test_scoring(variant="vit", test=TEST, source=tmp_path / "r.json", config="configs/x.yaml",
                                   config_hash=ledger.config_hash({"train": {"epochs": 3}}), ledger=path)
    ledger.append_test_scoring(variant="d", test=TEST, source="benchmarks/results/quality/d.json", commit=None,
                               cpu={"model": "AMD EPYC", "amx": False}, date="2026-12-01", ledger=path)
    recs = ledger.read_ledger(path)
    assert [r["variant"] for r in recs] == ["vit", "d"] and recs[0] == a
    assert a["date"] and a["cpu"]["model"] and isinstance(a["cpu"]["amx"], bool)   # this machine, now
    assert a["config_hash"] == ledger.config_hash({"train": {"epochs": 3}}) != ledger.config_hash({"train": {}})
    assert recs[1]["commit"] is None and recs[1]["source"] == "benchmarks/results/quality/d.json"
    assert len(path.read_text().splitlines()) == 2


def test_commit_is_git_head(tmp_path):
    rec = ledger.append_test_scoring(variant="v", test=TEST, source="s.json", ledger=tmp_path / "l.jsonl")
    assert rec["commit"] is None or len(rec["commit"].split("-")[0]) == 40


def test_needs_variant_and_numbers(tmp_path):
    for kw in ({"variant": "", "test": TEST}, {"variant": "v", "test": {}}):
        with pytest.raises(ValueError):
            ledger.append_test_scoring(source="s.json", ledger=tmp_path / "l.jsonl", **kw)
    assert not (tmp_path / "l.jsonl").exists()


def test_a_torn_line_is_named_and_the_next_append_starts_a_new_line(tmp_path):
    path = tmp_path / "l.jsonl"
    ledger.append_test_scoring(variant="a", test=TEST, source="s.json", commit=None, ledger=path)
    with open(path, "a") as f:
        f.write('{"variant": "b", "te')          # a writer killed mid-line
    with pytest.raises(ledger.LedgerError, match=r"l\.jsonl:2: not a JSON line"):
        ledger.read_ledger(path)
    ledger.append_test_scoring(variant="c", test=TEST, source="s.json", commit=None, ledger=path)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["variant"] == "c"


def _append(args):
    path, i = args
    ledger.append_test_scoring(variant=f"v{i}", test={"best": {"x": "y" * 5000}}, source="s.json", commit=None,
                               cpu={"model": None, "amx": None}, date=None, ledger=path)


def test_concurrent_appends_from_processes_keep_whole_lines(tmp_path):
    path = tmp_path / "l.jsonl"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_append, [(path, i) for i in range(24)])
    assert sorted(r["variant"] for r in ledger.read_ledger(path)) == sorted(f"v{i}" for i in range(24))


def test_the_ledger_holds_every_quality_json_with_test_numbers():
    recs = ledger.read_ledger(ledger.LEDGER)
    seen = {(r["source"], r["variant"]) for r in recs}
    for path in sorted(ledger.QUALITY.glob("quality_flickr8k_*.json")):
        report = json.loads(path.read_text())
        for r in report["results"]:
            if report.get("reported_split") == "test" and r.get("best", {}).get("test"):
                source = path.relative_to(ROOT).as_posix()
                assert (source, r["variant"]) in seen, f"{source} {r['variant']} is not in the ledger"
                (line,) = [x for x in recs if (x["source"], x["variant"]) == (source, r["variant"])]
                assert line["test"]["best"] == r["best"]["test"]
