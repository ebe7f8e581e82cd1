"""Imports run one way: the retrieval modules in the order of ``clip_mini/retrieval/__init__.py``, nothing outside
``train/`` imports the trainer, and leaf modules stay leaves. Read from the source (AST), lazy imports included."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "clip_mini"
RETRIEVAL_ORDER = ["rows", "search", "faiss_auto", "format", "files", "onnx_export", "reader", "build", "shards", "wds_source",
                   "ray_index", "preprocess_np", "query", "engine", "index"]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)   # `from clip_mini.retrieval import search`
    return {m for m in found if m == "clip_mini" or m.startswith("clip_mini.")}


def test_retrieval_imports_only_modules_above_it():
    for i, name in enumerate(RETRIEVAL_ORDER):
        allowed = {f"clip_mini.retrieval.{m}" for m in RETRIEVAL_ORDER[:i]}
        for imp in _imports(PKG / "retrieval" / f"{name}.py"):
            if imp.startswith("clip_mini.retrieval."):
                mod = ".".join(imp.split(".")[:3])
                assert mod in allowed, f"retrieval/{name}.py imports {imp}, which is not above it"


def test_nothing_outside_train_imports_the_trainer():
    for path in PKG.rglob("*.py"):
        if "train" in path.relative_to(PKG).parts or path.name in ("cli.py", "__main__.py"):
            continue   # the trainer itself, and the command line on top of everything
        bad = [m for m in _imports(path) if m.startswith("clip_mini.train")]
        assert not bad, f"{path.relative_to(PKG)} imports the trainer: {bad}"


def test_leaves_stay_leaves():
    # model.py records the version without importing the package root (which pulls in the embedding API)
    assert "clip_mini" not in _imports(PKG / "model.py")
    assert "clip_mini.version" in _imports(PKG / "model.py")
    # the command bodies print through printing.py, not through the argument parser that imports them
    assert not any(m.startswith("clip_mini.cli") for m in _imports(PKG / "commands.py"))
    for leaf in ("version.py", "printing.py", "retrieval/rows.py"):
        assert _imports(PKG / leaf) <= {"clip_mini.io", "clip_mini.io.atomic_write_with"}, \
            f"{leaf} should import nothing from clip_mini but the file helpers"
    # the search back ends read stored rows (float16 or bfloat16) and nothing else of the package
    assert {m for m in _imports(PKG / "retrieval/search.py") if not m.startswith("clip_mini.retrieval.rows")} <= \
        {"clip_mini.io", "clip_mini.io.atomic_write_with"}, "retrieval/search.py should import only rows and io"
