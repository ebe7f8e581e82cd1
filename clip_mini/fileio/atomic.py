"""Atomic file writes and checksums shared by model directories, checkpoints and indexes.

A reader never sees a half-written file: every write goes to a temporary file in the same folder, is fsynced,
then renamed over the target (rename is atomic on POSIX). Failures (full disk, no permission) raise
``OutputError`` naming the path and leave the previous file untouched.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from clip_mini.errors import OutputError


@contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is fsynced and renamed onto ``path``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + suffix, dir=path.parent)
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs should be as readable as a plain open()
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp_path.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_write_with(path: str | Path, writer: Callable[[Path], None], suffix: str = "") -> None:
    """Let ``writer(tmp_path)`` produce the file (e.g. ``safetensors.torch.save_file``), then rename it in."""
    with atomic_path(path, suffix=suffix) as tmp:
        writer(tmp)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a whole directory in a temporary sibling, then swap it in; the old one survives any failure."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        os.chmod(tmp, 0o777 & ~_umask())
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_keyed_tensors(path: Path, key: str, names: tuple[str, ...]) -> Optional[dict]:
    """Tensors ``names`` of a safetensors cache file whose metadata ``key`` equals ``key``, else ``None``: a
    missing, damaged, foreign or differently keyed file is a cache miss, never an error (a cache is never the only
    copy of anything)."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            return {n: f.get_tensor(n) for n in names}
    except (SafetensorError, OSError):
        return None


def write_keyed_tensors(path: Path, tensors: dict, key: str) -> None:
    """Write ``tensors`` as a safetensors file under metadata ``key``, atomically (``read_keyed_tensors``)."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"key": key})
