"""README Results numbers come from benchmark JSONs (benchmarks/check_readme.py), and benchmarks record their
paths relative to the repository."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import check_readme  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo  # noqa: E402

HEAD = "## Results\n\n| what | figure | script |\n|---|---|---|\n"


def _check(tmp_path, rows: str, results: dict) -> list[str]:
    (tmp_path / "README.md").write_text(HEAD + rows + "\n## Next\n\n| a | b |\n|---|---|\n| x | 999 |\n")
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in results.items():
        (folder / name).write_text(json.dumps(data))
    return [t.text for t in check_readme.check(tmp_path / "README.md", folder)]


def test_every_readme_results_number_is_in_a_benchmark_json():
    bad = check_readme.check(ROOT / "README.md", ROOT / "benchmarks/results")
    assert not bad, [f"README.md:{t.line}: {t.text} ({t.row[:80]})" for t in bad]


def test_the_numbers_the_readme_used_to_quote_without_a_json_are_caught(tmp_path):
    # The speed row before this check existed: "8.8 min" (a figure from no JSON) and "6,591" are reported.
    row = ("| one-time frozen-feature pass, EffNet-Lite0 224 px | 27 images/s (256 timed); 3 views of 6,591 images "
           "≈ 12 min (8.8 min in the (d) run) | `bench_train.py` |\n")
    # train.json as it stood then (27.1 images/s, 256 timed, a 12-minute estimate in seconds), not today's file
    bad = _check(tmp_path, row, {"train.json": {"frozen_pass": {"images_per_s": 27.1, "timed_images": 256,
                                                                "views": 3, "image_size": 224,
                                                                "estimate_s": 722.0}}})
    assert bad == ["6,591", "8.8 min"]


def test_printed_precision_units_and_separators(tmp_path):
    results = {"x.json": {"rate": 1742.04, "r1": 0.2536, "wait": 0.1178, "p50_ms": 2.437, "wall_s": 1160.1,
                          "rss_mb": 783.0, "speedup": 37.81, "n": 100000}}
    ok = "| a | 1,740 and 0.254, 11.8%, 2.4 ms, 19 min, 0.78 GB, 38x at 100k |\n"
    assert _check(tmp_path, ok, results) == []
    wrong = "| a | 1,750 and 0.255, 12.8%, 2.5 ms, 21 min, 0.8 GB, 37x at 10k |\n"
    assert _check(tmp_path, wrong, results) == ["1,750", "0.255", "12.8%", "2.5 ms", "21 min", "37x", "10k"]
    # names are not numbers: R@1, bf16, MiniLM-L6; "0.8 GB" is 783 MB at one decimal, so it passes above


def test_a_row_naming_a_script_is_checked_against_that_scripts_json_only(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_a.py").write_text('OUT = "benchmarks/results/a.json"\n')
    results = {"a.json": {"q1": {"p50_ms": 3.0}}, "b.json": {"value": 7.0}}
    assert _check(tmp_path, "| exact, 1 query, R@1 | 3 ms | `bench_a.py` |\n", results) == []
    assert _check(tmp_path, "| exact, 1 query | 7 | `bench_a.py` |\n", results) == ["7"]
    assert _check(tmp_path, "| unscoped | 7 |\n", results) == []
    # the first column holds settings: a number in a key ("q1") backs it there, never in a result column
    assert _check(tmp_path, "| a | 1 | `bench_a.py` |\n", results) == ["1"]


def test_the_checker_script_exit_status(tmp_path, capsys):
    assert check_readme.main([]) == 0
    (tmp_path / "README.md").write_text(HEAD + "| a | 98765.4 |\n")
    assert check_readme.main(["--readme", str(tmp_path / "README.md")]) == 1
    assert "'98765.4' is in no benchmark JSON" in capsys.readouterr().out


def _strings(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)
    elif isinstance(x, str):
        yield x


def test_speed_benchmark_jsons_record_no_absolute_paths():
    names = {n for s in (ROOT / "benchmarks").rglob("bench_*.py") for n in check_readme.script_results(s)}
    assert {"index.json", "data.json"} <= names
    for name in sorted(names):
        for path in (ROOT / "benchmarks/results").rglob(name):
            absolute = [s for s in _strings(json.loads(path.read_text())) if s.startswith(("/", "~")) or ":\\" in s]
            assert not absolute, f"{path.name}: {absolute}"


@pytest.mark.parametrize("given, want", [(ROOT.parent / "shared/data/flickr8k/images", "../shared/data/flickr8k/images"),
                                         (ROOT / "data/shapes", "data/shapes")])
def test_relative_to_repo(given, want):
    assert relative_to_repo(given) == want
    assert relative_to_repo(str(given)) == want
