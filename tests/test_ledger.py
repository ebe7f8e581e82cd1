"""The test-split ledger (clip_mini/eval/ledger.py): each scoring's line is written before the body that scores
runs and completed after it (done, failed, or left as ``scoring`` by a killed process), nested scorings are one
line, appends are atomic, the reader names a bad line, the repository's ledger holds every quality JSON with
test numbers, and no benchmark reads the test split outside a ledger line."""
import ast
import json
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clip_mini.errors import LedgerError
from clip_mini.eval import ledger

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY_LEDGER = ROOT / "benchmarks/results/quality/test_ledger.jsonl"
TEST = {"best": {"t2i_r5": 0.5, "i2t_r5": 0.6}}


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_line_is_written_before_the_body_and_completed_after(ledger_path):
    with ledger.record_test_scoring(variant="vit", source="bench.py --final", config="configs/x.yaml",
                                    config_hash=ledger.config_hash({"train": {"epochs": 3}})) as line:
        (during,) = _lines(ledger_path)   # the look is on record before anything is scored
        assert during["status"] == "scoring" and during["test"] is None and during["id"] == line.id
        line.test, line.test_images = TEST, 30
    (after,) = ledger.read_ledger()
    assert after["status"] == "done" and after["test"] == TEST and after["test_images"] == 30
    assert after["id"] == during["id"] and after["date"] == during["date"] and after["scoring_s"] >= 0
    assert after["variant"] == "vit" and after["source"] == "bench.py --final" and after["config"] == "configs/x.yaml"
    assert after["config_hash"] == ledger.config_hash({"train": {"epochs": 3}}) != ledger.config_hash({"train": {}})
    assert after["cpu"]["model"] and isinstance(after["cpu"]["amx"], bool)   # this machine, now
    assert after["commit"] is None or len(after["commit"].split("-")[0]) == 40


def test_a_scoring_that_raises_leaves_a_failed_line_and_the_error_goes_on(ledger_path):
    with pytest.raises(RuntimeError, match="out of memory"):
        with ledger.record_test_scoring(variant="v", source="s") as line:
            line.test = {"best": {"t2i_r5": 0.4}}   # best/ was scored, final/ was not
            raise RuntimeError("out of memory")
    (rec,) = ledger.read_ledger()
    assert rec["status"] == "failed" and rec["error"] == "RuntimeError: out of memory"
    assert rec["test"] == {"best": {"t2i_r5": 0.4}}


def test_a_killed_scoring_leaves_its_line(ledger_path):
    code = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        from clip_mini.eval import ledger
        ledger.LEDGER = Path(sys.argv[1])
        with ledger.record_test_scoring(variant="killed", source="s") as line:
            os.kill(os.getpid(), signal.SIGKILL)   # mid-scoring: no exit handler, no finally
    """)
    r = subprocess.run([sys.executable, "-c", code, str(ledger_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    (rec,) = ledger.read_ledger()
    assert rec["variant"] == "killed" and rec["status"] == "scoring" and rec["test"] is None


def test_a_scoring_inside_another_is_the_same_look(ledger_path):
    with ledger.record_test_scoring(variant="outer", source="s") as outer:
        for which in ("best", "final"):
            with ledger.record_test_scoring(variant=f"models/{which}", source="clip-mini eval") as inner:
                assert inner.id is None
                inner.test = {"model": {"t2i_r5": 0.1}}   # goes nowhere: the outer line stands for it
            outer.test[which] = {"t2i_r5": 0.5}
    (rec,) = ledger.read_ledger()
    assert rec["variant"] == "outer" and rec["test"] == {"best": {"t2i_r5": 0.5}, "final": {"t2i_r5": 0.5}}
    with ledger.record_test_scoring(variant="next", source="s"):   # closed: the next scoring has its own line
        pass
    assert [r["variant"] for r in ledger.read_ledger()] == ["outer", "next"]


def test_numpy_numbers_and_a_diverged_loss_are_written_as_json(ledger_path):
    import numpy as np

    with ledger.record_test_scoring(variant="v", source="s") as line:
        line.test = {"best": {"t2i_r5": np.float32(0.5), "loss": float("nan")}}
        line.test_images = np.int64(30)
    (rec,) = ledger.read_ledger()
    assert rec["status"] == "done" and rec["test"] == {"best": {"t2i_r5": 0.5, "loss": None}}
    assert rec["test_images"] == 30


def test_needs_a_variant(ledger_path):
    with pytest.raises(ValueError, match="variant"):
        with ledger.record_test_scoring(variant="", source="s"):
            pass
    assert not ledger_path.exists()


def test_a_torn_line_is_named_and_kept_and_the_next_line_starts_a_new_line(ledger_path):
    ledger.append_line({"variant": "a", "test": TEST})
    with open(ledger_path, "a") as f:
        f.write('{"variant": "b", "te')          # a writer killed mid-line
    with pytest.raises(LedgerError, match=r"test_ledger\.jsonl:2: not a JSON line"):
        ledger.read_ledger()
    with ledger.record_test_scoring(variant="c", source="s") as line:
        line.test = TEST
    lines = ledger_path.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == '{"variant": "b", "te' and json.loads(lines[2])["status"] == "done"


def test_a_line_that_is_not_a_scoring_is_named(ledger_path):
    ledger_path.parent.mkdir(parents=True)
    ledger_path.write_text('{"variant": "a", "test": {}}\n[1, 2]\n')
    with pytest.raises(LedgerError, match=r"test_ledger\.jsonl:2: not a test scoring"):
        ledger.read_ledger()


def _score(args):
    path, i = args
    ledger.LEDGER = Path(path)
    with ledger.record_test_scoring(variant=f"v{i}", source="s") as line:
        line.test = {"best": {"x": "y" * 5000}}


def test_concurrent_scorings_from_processes_keep_whole_lines(ledger_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_score, [(str(ledger_path), i) for i in range(24)])
    recs = ledger.read_ledger()
    assert sorted(r["variant"] for r in recs) == sorted(f"v{i}" for i in range(24))
    assert {r["status"] for r in recs} == {"done"}


def test_the_ledger_is_the_repositorys_in_a_checkout():
    assert ledger._location() == REPOSITORY_LEDGER


def test_the_ledger_holds_every_quality_json_with_test_numbers():
    recs = ledger.read_ledger(REPOSITORY_LEDGER)
    # the lines a --final run writes before it scores (open_clip's arm of a race writes its own)
    live = ("benchmarks/quality/quality_flickr8k.py --final", "benchmarks/quality/openclip_peer.py --final")
    for path in sorted(REPOSITORY_LEDGER.parent.glob("quality_flickr8k_*.json")):
        report = json.loads(path.read_text())
        for r in report["results"]:
            if report.get("reported_split") == "test" and r.get("best", {}).get("test"):
                source = path.relative_to(ROOT).as_posix()
                lines = [x for x in recs if x["variant"] == r["variant"] and (
                    x["source"] == source or (x["source"] in live and x.get("test", {}).get("best") == r["best"]["test"]))]
                assert lines, f"{source} {r['variant']} is not in the ledger"
                (line,) = lines
                assert line["test"]["best"] == r["best"]["test"]


def _reads_test_labels(tree) -> bool:
    """Whether a module indexes something with the constant "test" (``splits["test"]``) or names it as a split
    (``split="test"``, ``SPLIT = "test"``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "test":
            return True
        if isinstance(node, ast.keyword) and node.arg == "split" and getattr(node.value, "value", None) == "test":
            return True
        if isinstance(node, ast.Assign) and getattr(node.value, "value", None) == "test" and any(
                "split" in getattr(t, "id", "").lower() for t in node.targets):
            return True
    return False


def test_every_benchmark_that_loads_splits_and_reads_test_goes_through_the_ledger():
    """A benchmark that loads the dataset's splits and reads the test one scores it: it must write its ledger line
    (``record_test_scoring``) before. ``bench_ann_real.py`` read test without one; it calibrates on val now."""
    offenders, readers = [], []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "load_splits" not in text or not _reads_test_labels(ast.parse(text)):
            continue
        readers.append(path.name)
        if "record_test_scoring" not in text:
            offenders.append(path.relative_to(ROOT).as_posix())
    assert not offenders, f"read the test split outside the ledger: {offenders}"
    assert "openclip_peer.py" in readers   # the check sees a real reader (its --final scores test in its line)


class _NoTest(dict):
    def __getitem__(self, key):
        assert key != "test", "bench_ann_real read the test split"
        return super().__getitem__(key)


def test_bench_ann_real_calibrates_on_val_and_never_reads_test(tmp_path, ledger_path, monkeypatch):
    import numpy as np
    import pandas as pd

    import clip_mini
    from clip_mini.data import dataset
    from benchmarks.speed import bench_ann_real as bench

    val = pd.DataFrame({"path": ["b.jpg", "a.jpg", "b.jpg", "a.jpg"], "caption": ["b1", "a1", "b2", "a2"]})
    calls = []

    def load_splits(cfg, **kw):
        calls.append(cfg.data.val)
        return _NoTest(train=val.iloc[:0], val=val, test=None)

    class Embedder:
        def encode_image(self, paths):
            return np.array([[float(p[0] == "a"), 1.0] for p in paths], np.float32)

        def encode_text(self, captions):
            return np.array([[float(c[0] == "a"), 2.0] for c in captions], np.float32)

    monkeypatch.setattr(dataset, "load_splits", load_splits)
    monkeypatch.setattr(clip_mini, "load", lambda model, **kw: Embedder())
    cache = tmp_path / "cache.npz"
    got = bench.real_embeddings("m", cache)
    assert got["text_image"].tolist() == [1, 0, 1, 0]   # val's captions -> val's images (sorted: a.jpg, b.jpg)
    assert got["image"].tolist() == [[1.0, 1.0], [0.0, 1.0]] and len(got["text"]) == 4
    again = bench.real_embeddings("m", cache)   # from the cache: the split is not loaded again
    assert len(calls) == 1 and {k: v.tolist() for k, v in again.items()} == {k: v.tolist() for k, v in got.items()}
    with open(cache, "wb") as f:   # an older run's cache of test embeddings is not reused
        np.savez(f, image=np.zeros((1, 2)), text=np.zeros((1, 2)), text_image=np.zeros(1, int))
    assert bench.real_embeddings("m", cache)["text_image"].tolist() == [1, 0, 1, 0] and len(calls) == 2
    assert not ledger_path.exists()   # val calibration is no test scoring
