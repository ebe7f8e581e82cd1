"""Check that every number in the README's Results tables comes from a benchmark JSON in benchmarks/results/.

    python benchmarks/lib/check_readme.py [--readme README.md] [--results benchmarks/results]

Reads every markdown table row under ``## Results`` (up to the next ``## `` heading) and takes each numeric token
of it: ``1,740``, ``0.254``, ``98 pairs/s``, ``2.4 / 14 ms``, ``11.8%``, ``6.1x``, ``10k``. A token passes when
some number in the JSONs equals it at its printed precision (``0.33`` matches 0.3302; ``1,740``, written to three
significant figures, matches 1742.04) after the token's unit is applied (``%`` a fraction or a percentage, ``ms``
milliseconds or seconds, ``min`` seconds, ``GB`` megabytes, ``k``/``M`` thousands/millions).

Where it looks:

* a row naming a benchmark script (``bench_train.py``) is checked against the JSON that script writes, other rows
  (the quality table) against every JSON;
* the first column says *what* was measured (``batch 64``, ``ViT @96``, ``1 / 64 queries``): settings, which a
  JSON may record as a key (``q64``) or inside a string (a recorded command line); the other columns are results
  and must be numeric JSON values;
* ``ALLOWED`` lists tokens that are derived, each with the reason (none today).

Exits 1 and prints each unmatched token with its row; 0 when all match.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# token -> why it is not a JSON number (e.g. a ratio of two JSON numbers, named). Keep it short and honest.
ALLOWED: dict[str, str] = {}

# A number not glued to a word before it (R@1, L6, bf16, Lite0 are names), with an optional unit after it.
_TOKEN = re.compile(r"(?<![\w.])(?<!\w@)(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?![\d.]\d)"
                    r"(\s*(?:%|x\b|k\b|M\b|ms\b|s\b|min\b|GB\b|MB\b))?")
_SCALES = {"": (1,), "%": (1, 0.01), "x": (1,), "k": (1000,), "M": (1e6,), "ms": (1, 1000), "s": (1, 0.001),
           "min": (1, 60), "GB": (1, 1000, 1024, 1e9), "MB": (1, 1e6)}   # JSON value = token * scale


@dataclass
class Token:
    text: str
    value: float
    tolerance: float
    unit: str
    label: bool    # in the first column (a setting, not a result)
    row: str
    line: int


def table_rows(readme: str) -> list[tuple[int, list[str]]]:
    """``(line number, cells)`` of every data row of the markdown tables in the ``## Results`` section."""
    rows, inside, lines = [], False, readme.splitlines()
    for i, line in enumerate(lines, 1):
        if line.startswith("## "):
            inside = line.strip() == "## Results"
            continue
        if not inside or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
            continue
        nxt = lines[i] if i < len(lines) else ""
        if re.match(r"\|\s*:?-{3,}", nxt):   # the header row (the separator follows it)
            continue
        rows.append((i, cells))
    return rows


def tokens(readme: str) -> list[Token]:
    out = []
    for line, cells in table_rows(readme):
        row = " | ".join(cells)
        for col, cell in enumerate(cells):
            cell = cell.replace("*", "").replace("`", " ")
            for m in _TOKEN.finditer(cell):
                text, unit = m.group(1), (m.group(2) or "").strip()
                digits = text.replace(",", "")
                if "." in digits:
                    tol = 0.5 * 10 ** -len(digits.split(".")[1])
                elif "," in text:   # "1,740", "10,600": rounded to their last non-zero digit
                    tol = 0.5 * 10 ** (len(digits) - len(digits.rstrip("0")))
                else:
                    tol = 0.5
                out.append(Token(m.group(0).strip(), float(digits), tol, unit, col == 0, row, line))
    return out


def json_numbers(path: Path) -> tuple[list[float], list[float]]:
    """(numeric values, numbers found in keys and strings) of one JSON file."""
    values, names = [], []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                names.extend(float(n) for n in re.findall(r"\d+(?:\.\d+)?", str(k)))
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, bool) or x is None:
            pass
        elif isinstance(x, (int, float)):
            if math.isfinite(x):
                values.append(float(x))
        elif isinstance(x, str):
            names.extend(float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", x))

    try:
        walk(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not valid JSON ({e})")
    return values, names


def script_results(script: Path) -> list[str]:
    """JSON file names a benchmark script writes (the ``benchmarks/results/<name>.json`` it mentions)."""
    if not script.is_file():
        return []
    return re.findall(r"benchmarks/results/(?:\w+/)?([\w.-]+\.json)", script.read_text(encoding="utf-8"))


def matches(token: Token, numbers: list[float]) -> bool:
    for scale in _SCALES[token.unit]:
        want, tol = token.value * scale, token.tolerance * scale * (1 + 1e-9) + 1e-12
        if any(abs(v - want) <= tol for v in numbers):
            return True
    return False


def check(readme: Path, results: Path) -> list[Token]:
    """The tokens of the Results tables that no benchmark JSON backs."""
    files = {p.name: json_numbers(p) for p in sorted(results.rglob("*.json"))}
    if not files:
        raise SystemExit(f"no benchmark JSONs in {results}")
    bad = []
    for t in tokens(readme.read_text(encoding="utf-8")):
        if t.text in ALLOWED:
            continue
        named = [n for s in re.findall(r"[\w-]+\.py", t.row) for p in results.parent.rglob(s) for n in script_results(p)]
        scope = [files[n] for n in named if n in files] or list(files.values())
        numbers = [v for values, names in scope for v in (values + names if t.label else values)]
        if not matches(t, numbers):
            bad.append(t)
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks/results")
    args = p.parse_args(argv)
    bad = check(args.readme, args.results)
    for t in bad:
        print(f"{args.readme.name}:{t.line}: {t.text!r} is in no benchmark JSON  [{t.row[:100]}]")
    print(f"{len(bad)} README Results number(s) without a benchmark JSON behind them" if bad else
          "every README Results number is in a benchmark JSON")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
