"""Every error a user can catch is importable from ``clip_mini.errors``, is the class the raising module raises,
and derives from ``ClipMiniError``; no module defines its own outside ``clip_mini/errors.py``."""
import ast
import importlib
from pathlib import Path

import pytest

import clip_mini
import clip_mini.errors as errors

PKG = Path(clip_mini.__file__).resolve().parent
# error -> the module that raises it (and keeps the name importable, as before the classes moved)
RAISED_IN = {
    "ConfigError": "clip_mini.config",
    "DeviceError": "clip_mini.runtime.devices",
    "OutputError": "clip_mini.fileio.atomic",
    "UnreadableFileError": "clip_mini.fileio.bounded_read",
    "DataError": "clip_mini.data.readers",
    "ImageError": "clip_mini.data.images",
    "ModelDirError": "clip_mini.fileio.manifest",
    "OnnxError": "clip_mini.model.onnx_export",
    "QueryEncoderError": "clip_mini.retrieval.query",
    "TokenizerError": "clip_mini.model.text",
    "WeightsError": "clip_mini.model.weights",
    "EmbeddingIndexError": "clip_mini.retrieval.format",
    "ItemsFormatError": "clip_mini.retrieval.items",
    "FilterError": "clip_mini.retrieval.filters",
    "DatesNotIndexedError": "clip_mini.retrieval.filters",
    "EvalError": "clip_mini.eval.scoring",
    "LedgerError": "clip_mini.eval.ledger",
    "PrecisionError": "clip_mini.runtime.devices",
    "QueryError": "clip_mini.features.terms",
    "BudgetError": "clip_mini.train.budget",
    "TrainError": "clip_mini.train.build",
    "CheckpointError": "clip_mini.train.checkpoint",
}


@pytest.mark.parametrize("name", sorted(RAISED_IN))
def test_each_error_is_importable_from_clip_mini_errors_and_is_the_raised_class(name):
    exec(f"from clip_mini.errors import {name}", {})
    cls = getattr(errors, name)
    assert issubclass(cls, errors.ClipMiniError) and cls.__module__ == "clip_mini.errors"
    assert getattr(importlib.import_module(RAISED_IN[name]), name) is cls
    if name in clip_mini.__all__:
        assert getattr(clip_mini, name) is cls


def test_each_error_also_refines_a_builtin_exception():
    for name in RAISED_IN:
        cls = getattr(errors, name)
        assert issubclass(cls, (ValueError, OSError, RuntimeError)), name


def test_no_module_defines_an_error_of_its_own():
    """A ``ClipMiniError`` subclass defined anywhere but clip_mini/errors.py: its users could not find it there."""
    ours = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.ClipMiniError)}
    assert ours == set(RAISED_IN) | {"ClipMiniError", "InputError"}
    elsewhere = {}
    for path in PKG.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)
                     for b in getattr(node, "bases", [])}
            if isinstance(node, ast.ClassDef) and bases & ours:
                elsewhere[node.name] = path.relative_to(PKG.parent).as_posix()
    assert not elsewhere, elsewhere


def test_the_error_classes_keep_their_fields():
    e = errors.ImageError("a.png", "truncated")
    assert (str(e), e.path, e.reason) == ("a.png: truncated", "a.png", "truncated")
    u = errors.UnreadableFileError("/dev/zero", "not a regular file")
    assert (str(u), u.filename, u.strerror) == ("/dev/zero: not a regular file", "/dev/zero", "not a regular file")
    assert issubclass(errors.OnnxError, errors.ModelDirError) and issubclass(errors.QueryEncoderError,
                                                                             errors.ModelDirError)
