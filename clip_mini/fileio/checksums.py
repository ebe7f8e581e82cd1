"""sha256 of files that are read on every query, remembered so that an unchanged file is hashed once.

A cold ``clip-mini search`` checks the ONNX towers and the index files against their recorded checksums. Hashing them
every time is a real share of a cold query already for the MiniLM ``text.onnx`` and grows with the index, so
``known_sha256`` remembers each digest in the user cache against the file's identity (device, inode, size, mtime and
ctime in ns). Any write to a file changes its ctime, which user code cannot set back, so a changed file is always
hashed again; a stamp that cannot be read or written is ignored (the file is simply hashed).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from clip_mini.fileio.atomic import atomic_write_json, sha256_file


def cache_root() -> Path:
    """The user cache of clip_mini (decoded images, ONNX exports of read-only models, checksum stamps):
    ``$CLIP_MINI_CACHE_DIR``, else ``$XDG_CACHE_HOME/clip_mini``, else ``~/.cache/clip_mini``."""
    if os.environ.get("CLIP_MINI_CACHE_DIR"):
        return Path(os.environ["CLIP_MINI_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clip_mini"


def known_sha256(path: Path) -> str:
    """``sha256_file(path)``, remembered against the file's identity (see the module docstring)."""
    path = Path(path)
    st = path.stat()
    identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    stamp = cache_root() / "sha256" / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")
    try:
        known = json.loads(stamp.read_text(encoding="utf-8"))
        if known["identity"] == identity and isinstance(known["sha256"], str):
            return known["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(path)
    if path.stat().st_ctime_ns == st.st_ctime_ns:   # not written to while it was being hashed
        try:
            atomic_write_json(stamp, {"path": str(path.resolve()), "identity": identity, "sha256": digest})
        except OSError:
            pass
    return digest
