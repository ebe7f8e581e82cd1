"""Paths as benchmark JSONs record them: relative to the repository, so a result names the same data on every
checkout (the shared data folder reads ``../shared/...``) and carries no machine's absolute layout."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def relative_to_repo(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root, with forward slashes (``../shared/data/flickr8k/images``)."""
    # abspath, not resolve(): a shared folder that is a link must still read ../shared, not the link's target
    return Path(os.path.relpath(os.path.abspath(path), ROOT)).as_posix()


def scrub_paths(obj):
    """``obj`` (a JSON-able value) with every absolute path inside the repository or the shared folder beside it
    rewritten relative to the repository, inside longer strings too (recorded command lines, overrides)."""
    if isinstance(obj, dict):
        return {k: scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub_paths(v) for v in obj]
    if isinstance(obj, str):
        shared = ROOT.parent.resolve() / "shared"
        return obj.replace(f"{shared}/", "../shared/").replace(str(shared), "../shared").replace(f"{ROOT}/", "")
    return obj
