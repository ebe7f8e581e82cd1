"""Imports run one way, read from the source (AST), imports inside functions included:

    cli, serve  ->  retrieval, train, eval  ->  embed  ->  features, builtin  ->  model, data, pictures
                ->  config, errors, version, runtime, fileio

No import circles; the model never imports retrieval, serve, the CLI, training or evaluation; embed and eval never
import retrieval (what they share with it lives in features); nothing in the package imports the package root
(which is the public API for users); the root holds at most 8 modules.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "clip_mini"
RETRIEVAL_ORDER = ["rows", "cutoff", "search", "items", "taken", "faiss_auto", "format", "dupe_groups", "dupes",
                   "files", "reader", "filters", "build", "shards", "wds_source", "dupe_features", "ray_index",
                   "preprocess_np", "query", "engine", "index"]
# retrieval/search/: the modules of the search package, each importing only those before it
SEARCH_ORDER = ["bounds", "shortlist", "groups", "faiss_lib", "codes", "exact_numpy", "exact_ort", "exact_faiss",
                "exact_torch", "exact_int8", "approximate", "dispatch"]
# package (or root module) -> what it must never import
FORBIDDEN = {
    "fileio": ["model", "data", "train", "eval", "retrieval", "serve", "cli", "pictures", "runtime", "embed", "config",
               "features"],
    "runtime": ["model", "data", "train", "eval", "retrieval", "serve", "cli", "pictures", "embed", "features"],
    "config": ["model", "data", "train", "eval", "retrieval", "serve", "cli", "pictures", "runtime", "embed",
               "features"],
    "model": ["train", "eval", "retrieval", "serve", "cli", "embed", "pictures", "features"],
    "data": ["model", "train", "eval", "retrieval", "serve", "cli", "embed", "features"],
    "pictures": ["model", "train", "eval", "retrieval", "serve", "cli", "embed", "features"],
    "features": ["train", "eval", "retrieval", "serve", "cli", "embed"],
    # built-in models: a delta over the towers, materialised into a model directory; embed and retrieval resolve
    # names through it
    "builtin": ["train", "eval", "retrieval", "serve", "cli", "embed", "features", "pictures", "data"],
    "embed": ["train", "eval", "retrieval", "serve", "cli"],
    "eval": ["train", "retrieval", "serve", "cli"],
    "train": ["retrieval", "serve", "cli"],
    "retrieval": ["train", "eval", "serve", "cli"],
    "serve": ["train", "cli"],
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (``from a import b`` counts as ``a.b`` when b is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m == "clip_mini" or m.startswith("clip_mini.")}


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imports(path) if m in MODULES} for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        for dep in deps:
            if dep == "clip_mini" and mod not in ("clip_mini", "clip_mini.__main__"):
                bad.append(f"{mod} imports the package root")
            elif _area(dep) in FORBIDDEN.get(_area(mod), []):
                bad.append(f"{mod} imports {dep}")
    return sorted(bad)


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_no_upward_imports():
    assert _upward(_graph()) == []


def test_the_checks_catch_a_circle_and_an_upward_import():
    graph = _graph()
    graph["clip_mini.model.vision"] = graph["clip_mini.model.vision"] | {"clip_mini.retrieval.index"}
    assert "clip_mini.model.vision imports clip_mini.retrieval.index" in _upward(graph)
    graph["clip_mini.fileio.atomic"] = graph["clip_mini.fileio.atomic"] | {"clip_mini.fileio.manifest"}
    assert any("clip_mini.fileio.atomic" in c for c in _cycles(graph))   # manifest imports atomic
    graph["clip_mini.embed"] = graph["clip_mini.embed"] | {"clip_mini.retrieval.rows"}
    graph["clip_mini.eval.scoring"] = graph["clip_mini.eval.scoring"] | {"clip_mini.retrieval.files"}
    graph["clip_mini.features.image_files"] = graph["clip_mini.features.image_files"] | {"clip_mini.embed"}
    assert {"clip_mini.embed imports clip_mini.retrieval.rows",
            "clip_mini.eval.scoring imports clip_mini.retrieval.files",
            "clip_mini.features.image_files imports clip_mini.embed"} <= set(_upward(graph))


def test_root_holds_at_most_eight_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 8, root


def _ordered_imports(package: str, order: list[str]):
    """(module, imported module, the modules above it) for each import within ``package`` (a module of ``order``
    may be a package: its files count as it, and importing any of them counts as importing it)."""
    folder = PKG.joinpath(*package.split(".")[1:])
    for i, name in enumerate(order):
        files = sorted((folder / name).glob("*.py")) if (folder / name).is_dir() else [folder / f"{name}.py"]
        for path in files:
            for imp in _imports(path):
                if imp.startswith(f"{package}.") and not imp.startswith(f"{package}.{name}."):
                    yield path, imp, {f"{package}.{m}" for m in order[:i]}


def _is_above(imp: str, above: set[str]) -> bool:
    return any(imp == m or imp.startswith(f"{m}.") for m in above)


def test_retrieval_imports_only_modules_above_it():
    for path, imp, above in _ordered_imports("clip_mini.retrieval", RETRIEVAL_ORDER):
        assert _is_above(imp, above), f"{path.relative_to(PKG)} imports {imp}, which is not above it"


def test_search_modules_import_only_modules_above_them():
    package = "clip_mini.retrieval.search"
    assert sorted(p.stem for p in (PKG / "retrieval/search").glob("*.py")) == sorted(SEARCH_ORDER + ["__init__"])
    for path, imp, above in _ordered_imports(package, SEARCH_ORDER + ["__init__"]):
        assert _is_above(imp, above), f"{path.relative_to(PKG)} imports {imp}, which is not above it"


def test_nothing_outside_train_and_cli_imports_the_trainer():
    for name, path in MODULES.items():
        if _area(name) in ("train", "cli"):
            continue
        bad = [m for m in _imports(path) if m.startswith("clip_mini.train")]
        assert not bad, f"{name} imports the trainer: {bad}"


@pytest.mark.parametrize("leaf", ["version.py", "cli/printing.py", "retrieval/rows.py", "errors.py",
                                  "features/unit.py"])
def test_leaves_stay_leaves(leaf):
    assert _imports(PKG / leaf) <= {"clip_mini.fileio.atomic"}, f"{leaf} should import nothing but the file helpers"


@pytest.mark.parametrize("module", SEARCH_ORDER + ["__init__"])
def test_search_back_ends_read_rows_only(module):
    # the search back ends read stored rows (float16 or bfloat16) and nothing else of the package, but for the one
    # rule of what this CPU computes natively (torch-free, as they are), and the file checksums the int8 codes'
    # sidecar is checked against (``search.codes``)
    outside = {m for m in _imports(PKG / "retrieval/search" / f"{module}.py")
               if not m.startswith("clip_mini.retrieval.search")}
    assert outside <= {"clip_mini.retrieval.rows", "clip_mini.fileio.atomic", "clip_mini.fileio.checksums",
                       "clip_mini.runtime.isa"}, module


def test_command_modules_do_not_import_the_parser():
    for path in (PKG / "cli").glob("*.py"):
        if path.name != "main.py":
            assert "clip_mini.cli.main" not in _imports(path), f"cli/{path.name} imports the top-level parser"
