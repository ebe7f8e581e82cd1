"""Every figure in benchmarks/RESULTS.md and in the README's results table is tied to one JSON file and key
(benchmarks/lib/results_md.py generates both), so a single changed digit fails; the README keeps its shape; and
benchmarks record their paths relative to the repository."""
import json
import random
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import results_md  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo  # noqa: E402

# a figure: digits not glued to a word before (R@1, fp32, L6) or after (1M, 64px), an "x" or "%" allowed after
NUMBER = re.compile(r"(?<![\w.@])(\d[\d,]*(?:\.\d+)?)(?:x|%)?(?![\w.])")


def test_results_md_and_the_readme_table_match_the_jsons():
    problems = results_md.check()
    assert not problems, "\n".join(problems[:5]) + "\n(run: python benchmarks/lib/results_md.py)"


def _copies(tmp_path):
    readme, res = tmp_path / "README.md", tmp_path / "RESULTS.md"
    readme.write_text((ROOT / "README.md").read_text())
    res.write_text((ROOT / "benchmarks/RESULTS.md").read_text())
    return readme, res


def _bump(line: str, start: int) -> str:
    d = line[start]
    return line[:start] + ("1" if d == "0" else str(int(d) - 1)) + line[start + 1:]


def test_one_changed_digit_in_results_md_fails_and_names_its_key(tmp_path):
    readme, res = _copies(tmp_path)
    lines = res.read_text().splitlines()
    (i,) = [n for n, ln in enumerate(lines) if ln.startswith("| **vit_amx**")]
    at = lines[i].index("| 0.612 |") + 4          # 0.612 -> 0.611 (the headline's text-to-image R@5)
    lines[i] = _bump(lines[i], at)
    res.write_text("\n".join(lines) + "\n")
    problems = results_md.check(readme, res)
    assert len(problems) == 1
    assert "quality/quality_flickr8k_vit_amx.json: results.0.best.test.t2i_r5" in problems[0]
    assert f"RESULTS.md:{i + 1}:" in problems[0]
    assert results_md.main(["--check", "--readme", str(readme), "--results-md", str(res)]) == 1


def test_one_changed_digit_in_the_readme_table_fails(tmp_path):
    readme, res = _copies(tmp_path)
    text = readme.read_text()
    head, block = text.split(results_md.BEGIN)
    row = next(ln for ln in block.splitlines() if "`make demo`" in ln)
    m = NUMBER.search(row.split("|")[2])
    changed = row.replace(row.split("|")[2], _bump(row.split("|")[2], m.start(1)))
    readme.write_text(head + results_md.BEGIN + block.replace(row, changed, 1))
    problems = results_md.check(readme, res)
    assert len(problems) == 1 and "speed/e2e.json: runs.demo.process_wall_s" in problems[0]


def _figure_digits(text: str) -> list[tuple[int, int]]:
    """(line, column) of every digit of a figure in the result tables: table rows, columns that hold results."""
    out = []
    for n, line in enumerate(text.splitlines()):
        if not line.startswith("| ") or set(line) <= set("|-"):
            continue
        cells = line.split("|")
        col = len(cells[1]) + 2
        for cell in cells[2:-1]:
            if "`" not in cell and not re.fullmatch(r"\s*(AMX|no-AMX) \w+\s*|\s*not recorded\s*", cell):
                for m in NUMBER.finditer(cell):
                    out.extend((n, col + k) for k in range(m.start(1), m.end(1)) if cell[k].isdigit())
            col += len(cell) + 1
    return out


def test_any_single_digit_changed_in_a_results_table_fails(tmp_path):
    readme, res = _copies(tmp_path)
    text = res.read_text()
    digits = _figure_digits(text)
    assert len(digits) > 500
    lines = text.splitlines()
    for n, col in random.Random(0).sample(digits, 25):
        changed = lines.copy()
        changed[n] = _bump(changed[n], col)
        res.write_text("\n".join(changed) + "\n")
        assert results_md.check(readme, res), f"line {n + 1}: {changed[n][:100]}"


def test_every_figure_in_a_generated_row_comes_from_a_json_key():
    doc = results_md.document()
    for line, sources in zip(doc.lines, doc.sources):
        if not line.startswith("| ") or set(line) <= set("|-") or not sources:
            continue
        from_json = [s.text.rstrip("%x") for s in sources]
        for cell in line.split("|")[2:-1]:   # the result columns; the first holds settings, backticks names
            if "`" in cell or re.search(r"AMX|not recorded", cell):
                continue
            for m in NUMBER.finditer(cell):
                assert m.group(1) in from_json, f"typed figure {m.group(1)!r} in: {line[:120]}"
                from_json.remove(m.group(1))


def test_the_readme_shape():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300
    inside = False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            assert len(line) <= 120, f"README.md:{n} is {len(line)} characters"
    first = "\n".join(lines[:40])
    assert "make demo" in first and "make test" in first
    summary = text.split(results_md.BEGIN)[1].split(results_md.END)[0]
    rows = [ln for ln in summary.splitlines() if ln.startswith("| ") and not ln.startswith("| question")]
    assert 0 < len(rows) <= 10
    for row in rows:
        assert re.search(r"\| (AMX|no-AMX|no-bf16) \w+( \(AVX2\))? \|", row), row          # every figure names its CPU kind
        assert "benchmarks/RESULTS.md#" in summary and re.search(r"\]\[\w+\] \|$", row), row


def test_the_readme_layout_matches_the_package():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout")[1].split("```text")[1].split("```")[0]
    listed = {m.group(1).rstrip("/") for m in re.finditer(r"^  (\w+/)", block, re.M)}
    listed |= {f"model/{m.group(1)}" for m in re.finditer(r"^    (\w+)/", block, re.M)}
    pkg = ROOT / "clip_mini"
    actual = {p.parent.relative_to(pkg).as_posix() for p in pkg.rglob("__init__.py") if p.parent != pkg}
    actual = {a for a in actual if a.count("/") == 0 or a == "model/layers"}
    assert listed == actual
    modules = {m for line in re.findall(r"^  (\S[^ ]*(?:, \S+)*)\s{2,}", block, re.M) for m in line.split(", ")}
    root = {p.name for p in pkg.glob("*.py")}
    assert {m for m in modules if m.endswith(".py")} == root


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
    names = {n for s in (ROOT / "benchmarks/speed").glob("bench_*.py")
             for n in re.findall(r"benchmarks/results/speed/([\w.-]+\.json)", s.read_text())}
    assert {"index.json", "data.json"} <= names
    for name in sorted(names):
        path = ROOT / "benchmarks/results/speed" / name
        if path.is_file():
            absolute = [s for s in _strings(json.loads(path.read_text())) if s.startswith(("/", "~")) or ":\\" in s]
            assert not absolute, f"{path.name}: {absolute}"


@pytest.mark.parametrize("given, want", [(ROOT.parent / "shared/data/flickr8k/images", "../shared/data/flickr8k/images"),
                                         (ROOT / "data/shapes", "data/shapes")])
def test_relative_to_repo(given, want):
    assert relative_to_repo(given) == want
    assert relative_to_repo(str(given)) == want
