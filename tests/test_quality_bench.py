"""The Flickr8k quality benchmark: variant parsing, schedule fitting, and end-to-end runs on generated shapes.

The end-to-end runs use a tiny generated caption dataset (not Flickr8k) and tiny models, with budgets of well
under a minute; they check the report's structure and the budget, not quality.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clip_mini.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import openclip_peer  # noqa: E402
from benchmarks.quality import quality_flickr8k as qf  # noqa: E402
from conftest import tiny_sets  # noqa: E402

TOLERANCE_S = 10   # process exits and the final JSON write, after the last clock the benchmark reads
TINY = tiny_sets() + ["train.batch_size=32", "train.log_every=2", "train.warmup_steps=10", "train.threads=1",
                      "train.eval_batch_size=64", "data.workers=0", "data.val=30", "data.test=30"]
TINY += ["train.device=cpu"]   # bit-exact checks are a CPU property: pinned there on a GPU host too


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    from clip_mini.data.synthetic import generate

    return generate(tmp_path_factory.mktemp("quality") / "shapes", n=200, size=32) / "captions.csv"


def test_variants_builtin_config_file_and_errors(tmp_path):
    cfg = tmp_path / "vit.yaml"
    cfg.write_text("train:\n  epochs: 2\n")
    vs = qf.parse_variants(f"a, d,openclip,vit={cfg}")
    assert [v.name for v in vs] == ["a", "d", "openclip", "vit"]
    assert vs[2].is_peer and not vs[3].is_peer and vs[3].config == cfg and vs[3].overrides == []
    assert vs[0].overrides == qf.BUILTIN["a"] and vs[1].config == qf.REFERENCE
    vit, p = qf.parse_variants("vit,p")   # builtins over the ViT config
    assert vit.config == p.config == ROOT / "configs" / "flickr8k-vit.yaml" and vit.overrides == []
    assert "train.captions_per_image=5" in p.overrides and not p.is_peer
    for v in (vit, p):   # each builds a valid config
        load_config(v.config, v.overrides).validate()
    with pytest.raises(SystemExit, match="unknown variant 'z'"):
        qf.parse_variants("a,z")
    with pytest.raises(SystemExit, match="not found"):
        qf.parse_variants(f"x={tmp_path / 'missing.yaml'}")
    with pytest.raises(SystemExit, match="twice"):
        qf.parse_variants("a,a")


def test_every_variant_gets_the_reference_split():
    assert qf.split_overrides() == ["data.val=500.0", "data.test=1000.0", "data.seed=0", "data.val_list=null",
                                    "data.test_list=null"]


def test_peer_fit_steps():
    # 10 steps/epoch of 1 s, 5 s per evaluation, 8 steps done: 7 epochs = 62 s of steps + 35 s of evaluations
    assert openclip_peer.fit_steps(100, 1.0, 5.0, 10, 8) == 70
    assert openclip_peer.fit_steps(50, 1.0, 5.0, 100, 8) == 8 + 43       # no epoch fits: the steps before one eval
    assert openclip_peer.fit_steps(-5, 1.0, 5.0, 10, 8) == 8             # over budget already: stop now


def test_limit_images_writes_a_subset_and_scales_the_split(shapes, tmp_path):
    sets = qf.limit_captions(shapes, 50, tmp_path, qf.split_overrides())
    got = dict(s.split("=", 1) for s in sets)
    lines = Path(got["data.captions"]).read_text().splitlines()
    assert lines[0] == "image,caption" and len({ln.split(",")[0] for ln in lines[1:]}) == 50
    assert (Path(got["data.image_root"]) / lines[1].split(",")[0]).is_file()
    assert got["data.val"] == str(round(500 * 50 / 200)) and got["data.test"] == str(round(1000 * 50 / 200))


def _bench(shapes: Path, tmp_path: Path, variants: str, minutes: float, *args: str
           ) -> tuple[dict, subprocess.CompletedProcess]:
    result = tmp_path / "quality.json"
    cmd = [sys.executable, "benchmarks/quality/quality_flickr8k.py", "--variants", variants, "--budget-min", str(minutes),
           "--captions", str(shapes), "--out", str(tmp_path / "runs"), "--result", str(result), *args]
    cmd += [a for s in TINY + [f"data.cache_dir={tmp_path / 'cache'}"] for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          timeout=minutes * 60 * 2 + 60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(result.read_text()), proc


def _has_numbers(scores: dict) -> bool:
    return all(isinstance(scores[k], float) and 0 <= scores[k] <= 1 for k in ("t2i_r1", "t2i_r5", "i2t_r10"))


def _bench_here(shapes: Path, tmp_path: Path, variants: str, minutes: float, capsys, *args: str
                ) -> tuple[dict, str]:
    """``_bench`` in this process, so that its test scorings go to this test's ledger (``ledger_path``)."""
    result = tmp_path / "quality.json"
    argv = ["--variants", variants, "--budget-min", str(minutes), "--captions", str(shapes), "--out",
            str(tmp_path / "runs"), "--result", str(result), *args]
    qf.main(argv + [a for s in TINY + [f"data.cache_dir={tmp_path / 'cache'}"] for a in ("--set", s)])
    return json.loads(result.read_text()), capsys.readouterr().out


def test_races_report_val_only_and_final_scores_test_once_into_the_ledger(shapes, tmp_path, ledger_path, capsys,
                                                                          monkeypatch):
    # --epochs 1: the flag is what is tested here, not the budget (below)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the machine's speed, measured for 1 s before and after each variant, is recorded, not read here (the budget
    # test below checks it): 4 s of this test saved
    monkeypatch.setattr(qf, "machine_gflops", lambda: 100.0)
    report, stdout = _bench_here(shapes, tmp_path, "a", 1.0, capsys, "--epochs", "1")
    assert report["reported_split"] == "val" and "VAL split" in stdout and "TEST" not in stdout
    (r,) = report["results"]
    r0 = r
    assert "error" not in r, r
    assert not {"test", "test_images"} & (r["best"].keys() | r["final"].keys()) and "test_score_s" not in r
    assert _has_numbers(r["best"]["val"]) and _has_numbers(r["final"]["val"])
    assert r["flip_average"] is False   # --flip-average left out: the plain image rows, as in earlier reports
    assert not ledger_path.exists()   # the test split was not read
    race = tmp_path / "race.json"
    race.write_text((tmp_path / "quality.json").read_text())
    with pytest.raises(SystemExit, match="no finished run of variant 'b'"):
        qf.main(["--score-race", str(race), "--variants", "b", "--out", str(tmp_path / "runs")])
    assert not ledger_path.exists()
    qf.main(["--score-race", str(race), "--variants", "a", "--out", str(tmp_path / "runs")])   # no training again
    scored = json.loads(race.read_text())
    (r,) = scored["results"]
    assert scored["reported_split"] == "test" and r["test_scored_after_the_race"] and r["wall_s"] == r0["wall_s"]
    assert _has_numbers(r["best"]["test"]) and r["best"]["step"] == r0["best"]["step"]
    (line,) = [json.loads(x) for x in ledger_path.read_text().splitlines()]
    assert line["variant"] == "a" and line["test"]["best"] == r["best"]["test"]
    ledger_path.unlink()
    capsys.readouterr()
    seen = []
    scoring = qf.score_best_and_final
    monkeypatch.setattr(qf, "score_best_and_final",
                        lambda run, **kw: seen.append(ledger_path.read_text()) or scoring(run, **kw))
    report, stdout = _bench_here(shapes, tmp_path, "a", 1.0, capsys, "--epochs", "1", "--final")
    assert report["reported_split"] == "test" and "TEST split" in stdout
    (r,) = report["results"]
    for which in ("best", "final"):
        assert _has_numbers(r[which]["test"]) and r[which]["test_images"] == 30, which
    (before,) = [json.loads(x) for x in seen[0].splitlines()]   # on record before test was read
    assert before["variant"] == "a" and before["status"] == "scoring" and before["test"] is None
    (line,) = [json.loads(x) for x in ledger_path.read_text().splitlines()]   # one scoring, one line
    assert line["variant"] == "a" and line["test"]["best"] == r["best"]["test"] and line["test_images"] == 30
    assert line["status"] == "done" and line["id"] == before["id"]
    assert len(line["config_hash"]) == 64 and line["date"] and line["cpu"]["model"]
    assert line["commit"] is None or len(line["commit"].split("-")[0]) == 40
    assert report["ledger"] == os.path.relpath(ledger_path, ROOT)   # the report names the one ledger
    with pytest.raises(SystemExit):   # no option points the scorings elsewhere
        qf.main(["--ledger", str(tmp_path / "elsewhere.jsonl")])


@pytest.mark.slow
def test_trainer_variant_is_a_budget_run_of_the_trainer(shapes, tmp_path):
    report, proc = _bench(shapes, tmp_path, "a", 0.3)   # 18 s: the first fit comes at the first epoch's end, ~6 s in
    (r,) = report["results"]
    assert "error" not in r, r
    assert r["train_wall_s"] <= r["budget_s"] + TOLERANCE_S and not r["stopped_at_budget"]
    plan = r["budget"]   # the trainer's own fit (clip_mini/train/budget.py), as a user's train.py run makes it
    assert plan["fitted"] and plan["budget_s"] == 18 and plan["total"] == r["steps_done"] == r["final"]["step"]
    assert "--set train.budget=18s" in r["command"]
    assert _has_numbers(r["best"]["val"]) and "test" not in r["best"]
    assert all(r["machine_fp32_gflops"][k] > 1 for k in ("before", "after"))   # the machine's speed, recorded
    curve = r["val_curve"]
    assert [c["epoch"] for c in curve] == list(range(1, r["epochs_done"] + 1)) and 0 <= curve[-1]["rsum"] <= 6
    # the precision the run computed in, and its config's section for it (none in the default config)
    assert r["precision_section"]["settings"] == [] and r["precision_section"]["precision"] in ("fp32", "bf16")


def test_minutes_curve_keeps_each_cpu_kinds_points_and_draws_them(tmp_path):
    from benchmarks.quality import minutes_curve

    val = {k: 0.5 for k in minutes_curve.METRICS}
    runs = {}
    for minutes, r5 in ((10, 0.41), (30, 0.62)):
        runs[minutes] = tmp_path / f"q{minutes}.json"
        runs[minutes].write_text(json.dumps({"results": [{
            "best": {"val": {**val, "t2i_r5": r5}}, "steps_done": 10 * minutes, "epochs_done": minutes // 5,
            "wall_s": 60.0 * minutes, "precision_section": {"precision": "fp32", "settings": ["train.x=1"]},
            "command": f"{ROOT}/train.py --config configs/flickr8k-vit.yaml"}]}))
    out = tmp_path / "curve.json"
    out.write_text(json.dumps({"curves": {"other_kind": {"points": [{"minutes": 30, "val": val}]}}}))
    doc = minutes_curve.main(["--budgets", "--reuse", f"30={runs[30]}", "--reuse", f"10={runs[10]}",
                              "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    kind = doc["machine"]["cpu_kind"]
    points = doc["curves"][kind]["points"]
    assert [(p["minutes"], p["val"]["t2i_r5"], p["steps"]) for p in points] == [(10, 0.41, 100), (30, 0.62, 300)]
    assert points[0]["command"] == "train.py --config configs/flickr8k-vit.yaml"   # no machine's absolute paths
    assert doc["curves"]["other_kind"]["points"][0]["minutes"] == 30          # another CPU's points kept
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("open_clip") is None, reason="open_clip_torch (extra bench) missing")
def test_openclip_peer_reports_val_and_test_within_budget(shapes, tmp_path):
    report, _ = _bench(shapes, tmp_path, "openclip", 0.4)   # 24 s: its 8 timed steps end ~9 s in
    (r,) = report["results"]
    assert "error" not in r and "skipped" not in r, r
    assert r["wall_s"] <= r["budget_s"] + TOLERANCE_S
    assert r["model"]["patch_size"] == 4 and r["split_images"] == {"train": 140, "val": 30, "test": 30}
    for which in ("best", "final"):
        assert _has_numbers(r[which]["val"]) and "test" not in r[which], which   # a race: val only
    assert r["steps_done"] >= openclip_peer.TIMED_STEPS and r["epochs_done"] >= 1


@pytest.mark.skipif(importlib.util.find_spec("open_clip") is None, reason="open_clip_torch (extra bench) missing")
def test_openclip_peer_final_scores_test_inside_its_ledger_line(shapes, tmp_path, ledger_path, monkeypatch):
    """The peer's --final scores test in its own process: that process writes the line, before the scoring."""
    import torch

    cfg = load_config(None, TINY + [f"data.captions={shapes}", "data.cache=false"])
    seen, real = [], openclip_peer.evaluate

    def evaluate(model, df, **kw):
        seen.append([line["status"] for line in _ledger_lines(ledger_path)])
        return real(model, df, **kw)

    monkeypatch.setattr(openclip_peer, "evaluate", evaluate)
    threads = torch.get_num_threads()
    try:   # a budget already spent: one step, one val evaluation, then the test scoring of best and final
        result = openclip_peer.train_peer(cfg, budget_s=1.0, final=True, config="configs/peer.yaml")
    finally:
        torch.set_num_threads(threads)
    assert seen[0] == [] and seen[-1] == ["scoring"]   # val before the line; test inside it
    (line,) = _ledger_lines(ledger_path)
    assert line["variant"] == "openclip" and line["status"] == "done" and line["config"] == "configs/peer.yaml"
    assert line["test"] == {"best": result["best"]["test"], "final": result["final"]["test"]}
    assert line["test_images"] == 30 and line["source"] == "benchmarks/quality/openclip_peer.py --final"


def _ledger_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
