"""The model directory's ``manifest.json``: sha256 of every file and a fingerprint over them. Torch-free.

Both the torch model loader (``clip_mini.model.clip``) and the ONNX query path (``clip_mini.retrieval.query``, which must
start without torch) read model directories through this one function, so they agree on what counts as intact.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from clip_mini.errors import ModelDirError
from clip_mini.fileio.atomic import sha256_file

MODEL_FILES = ("config.json", "model.safetensors", "preprocess.json")


def fingerprint(checksums: dict[str, str]) -> str:
    """The model's identity (indexes record it): a hash over the files' checksums."""
    blob = json.dumps(checksums, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise ModelDirError(f"model directory is missing {path.name}: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path}: not valid JSON ({e})") from None


def read_manifest(model_dir: str | Path, verify: bool = True, required: Sequence[str] = MODEL_FILES,
                  hasher: Callable[[Path], str] = sha256_file) -> dict:
    """Read ``manifest.json``; every ``required`` file must be listed and present, and with ``verify`` the
    fingerprint must match the checksums and every listed file must exist and match its sha256 (as ``hasher``
    computes it: ``fileio.checksums.known_sha256`` remembers a file's hash against its identity)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "is a file, not a directory" if model_dir.exists() else "not found"
        raise ModelDirError(f"model directory {what}: {model_dir}")
    manifest = read_json(model_dir / "manifest.json")
    if (not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict)
            or not isinstance(manifest.get("fingerprint"), str)):
        raise ModelDirError(f"{model_dir / 'manifest.json'}: not a clip_mini model manifest")
    for name in required:
        if name not in manifest["files"]:
            raise ModelDirError(f"{model_dir}: manifest does not list {name}")
        if not (model_dir / name).is_file():
            raise ModelDirError(f"model directory is missing {name}: {model_dir / name}")
    if verify:
        if fingerprint(manifest["files"]) != manifest["fingerprint"]:
            raise ModelDirError(f"{model_dir / 'manifest.json'}: fingerprint does not match its checksums")
        for name, digest in manifest["files"].items():
            path = model_dir / name
            if not path.is_file():
                raise ModelDirError(f"model directory is missing {name}: {path}")
            if hasher(path) != digest:
                raise ModelDirError(f"{path} is corrupt: its checksum does not match manifest.json")
    return manifest


def model_fingerprint(model_dir: str | Path) -> str:
    return read_manifest(model_dir, verify=False)["fingerprint"]
