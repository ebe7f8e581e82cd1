"""The test-split ledger: one JSON line for every time a model is scored on a test split, written before the
split's labels are read.

Test numbers are only worth something while the split decides nothing; the ledger makes the number of looks
visible (benchmarks/RESULTS.md prints the count). Every path that scores a test split goes through
``record_test_scoring``: ``clip-mini eval --split test`` (``clip_mini.eval.scoring.evaluate_retrieval``),
``benchmarks/quality/quality_flickr8k.py --final`` and ``benchmarks/quality/openclip_peer.py --final``. It
appends the line (``status: scoring``) before its body runs and completes it afterwards (``done`` with the
numbers, or ``failed`` with the error), so a scoring that raises, or whose process is killed, still leaves its
line.

There is one ledger, ``LEDGER``: ``benchmarks/results/quality/test_ledger.jsonl`` of the checkout clip_mini runs
from (an installed copy outside a checkout keeps it at ``$XDG_STATE_HOME/clip_mini/test_ledger.jsonl``). No
option or argument moves it.

A line: ``id``, ``status`` (``scoring``, ``done`` or ``failed``; absent on back-filled lines), ``date`` (UTC, ISO
8601, when the scoring began; null when not recorded), ``variant``, ``config`` (path), ``config_hash`` (sha256
of the resolved config, null when not recoverable), ``commit`` (git HEAD, ``-dirty`` when the tree had changes;
null when not recorded), ``cpu`` (``model``, ``amx``), ``test`` (model name -> metrics, e.g. ``{"best": {...},
"final": {...}}``; null until the scoring ends), ``test_images``, ``source`` (what scored), and once complete
``scoring_s`` (plus ``error`` when it failed).
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from clip_mini.errors import LedgerError
from clip_mini.fileio.atomic import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[2]


def _location() -> Path:
    if (ROOT / "benchmarks" / "results").is_dir():
        return ROOT / "benchmarks/results/quality/test_ledger.jsonl"
    # an installed copy: the checkout's folder does not exist, and site-packages is no place for a record
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "clip_mini" / "test_ledger.jsonl"


LEDGER = _location()
_LOCK_TIMEOUT_S = 60


@dataclass
class ScoringLine:
    """One scoring while it runs: its body fills ``test`` (model name -> metrics) and ``test_images``.

    ``id`` is None for a scoring nested in another one: the outer line already stands for it, and nothing of the
    nested one is written.
    """
    id: Optional[str]
    test: dict = field(default_factory=dict)
    test_images: Optional[int] = None


# The scoring open in this thread or task: a test read inside it (a benchmark's scoring of best/ and final/ calls
# evaluate_retrieval twice) is one look, one line.
_OPEN: contextvars.ContextVar[Optional[ScoringLine]] = contextvars.ContextVar("clip_mini_test_scoring", default=None)


@contextlib.contextmanager
def record_test_scoring(*, variant: str, source: str | os.PathLike, config: str | os.PathLike | None = None,
                        config_hash: Optional[str] = None, **extra) -> Iterator[ScoringLine]:
    """Write the ledger line of a test scoring, then run the body that scores, then complete the line.

    The line goes out (``status: scoring``) before the body runs; the body fills the yielded ``ScoringLine``.
    On exit the line is rewritten in place as ``done`` with ``test``, ``test_images`` and ``scoring_s``; when the
    body raises, as ``failed`` with ``error`` (and whatever ``test`` it had filled), and the exception goes on. A
    process killed in the body leaves the ``scoring`` line. Inside another open scoring it writes nothing.

    Args:
        variant: what was scored (a benchmark variant, or a model directory).
        source: the program that scores (``"clip-mini eval"``, a benchmark script).
        config: the config file the split came from; config_hash: ``config_hash`` of its resolved form.
        extra: more fields for the line (JSON values).
    """
    if _OPEN.get() is not None:
        yield ScoringLine(id=None)
        return
    if not variant:
        raise ValueError("record_test_scoring needs the variant (what is scored)")
    line = ScoringLine(id=uuid.uuid4().hex)
    record = {"id": line.id, "status": "scoring", "date": _now(), "variant": variant,
              "config": None if config is None else repo_relative(config), "config_hash": config_hash,
              "commit": current_commit(), "cpu": cpu_stamp(), "test": None, "test_images": None,
              "source": repo_relative(source), **extra}
    path = LEDGER   # the location when the line was written, whatever happens to the name meanwhile
    append_line(record, path)
    token, tick = _OPEN.set(line), time.monotonic()
    try:
        yield line
    except BaseException as e:
        try:
            _complete(path, record, line, tick, "failed", error=f"{type(e).__name__}: {e}"[:2000])
        except OSError:
            pass   # the "scoring" line stands: the look is counted either way
        raise
    finally:
        _OPEN.reset(token)
    _complete(path, record, line, tick, "done")


def _complete(path: Path, record: dict, line: ScoringLine, tick: float, status: str, **more) -> None:
    done = {**record, "status": status, "test": line.test, "test_images": line.test_images,
            "scoring_s": round(time.monotonic() - tick, 1), **more}
    _replace_line(path, record["id"], done)


def append_line(record: dict, path: Optional[Path] = None) -> dict:
    """Append ``record`` to the ledger as one line and return it (a back-fill of past scorings uses this; a new
    scoring goes through ``record_test_scoring``, which writes before it scores).

    Writers are serialised by a lock file beside the ledger, and the line goes out in one ``write`` on an
    ``O_APPEND`` descriptor, then fsync: a reader sees whole lines only. A torn last line left by a crash stays
    on a line of its own (``read_ledger`` names it).
    """
    from filelock import FileLock

    path = Path(LEDGER if path is None else path)
    data = (json.dumps(_plain(record), allow_nan=False) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=_LOCK_TIMEOUT_S):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size:
                with open(path, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        data = b"\n" + data
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    return record


def _replace_line(path: Path, line_id: str, record: dict) -> None:
    """Rewrite the line whose ``id`` is ``line_id`` as ``record``, every other byte of the file kept; the file
    is swapped in whole (a crash leaves the old or the new one). A line that has gone is appended again."""
    from filelock import FileLock

    new = (json.dumps(_plain(record), allow_nan=False) + "\n").encode()
    with FileLock(str(path) + ".lock", timeout=_LOCK_TIMEOUT_S):
        lines = path.read_bytes().splitlines(keepends=True) if path.exists() else []
        for i, text in enumerate(lines):
            try:
                found = json.loads(text).get("id") == line_id
            except (ValueError, AttributeError):
                found = False   # a torn or foreign line: kept as it is
            if found:
                lines[i] = new
                break
        else:
            lines.append((b"" if not lines or lines[-1].endswith(b"\n") else b"\n") + new)
        atomic_write_bytes(path, b"".join(lines))


def read_ledger(path: str | os.PathLike | None = None) -> list[dict]:
    """Every scoring in the ledger (``LEDGER`` unless ``path``; an absent ledger is empty).

    Raises:
        LedgerError: a line that is not a JSON object with ``variant`` and ``test`` (names the file and line).
    """
    path = Path(LEDGER if path is None else path)
    if not path.exists():
        return []
    out = []
    for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise LedgerError(f"{path}:{n}: not a JSON line ({e.msg})") from None
        if not isinstance(rec, dict) or "variant" not in rec or "test" not in rec:
            raise LedgerError(f"{path}:{n}: not a test scoring (needs variant and test)")
        out.append(rec)
    return out


def config_hash(resolved: dict) -> str:
    """sha256 of a resolved config (a nested dict), independent of key order."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def current_commit(root: Path = ROOT) -> Optional[str]:
    """git HEAD of ``root`` with ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def cpu_stamp() -> dict:
    """``{"model", "amx"}`` of this machine, from ``/proc/cpuinfo`` (elsewhere: ``platform.processor()``, None)."""
    model, flags = "", None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for text in f:
                key, _, value = text.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and flags is None:   # Features: aarch64
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model or platform.processor() or platform.machine() or None,
            "amx": None if flags is None else "amx_bf16" in flags}


def _plain(obj):
    """JSON values only: numpy scalars as Python numbers, NaN and infinities (a diverged model's loss) as None."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):   # a numpy scalar
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def repo_relative(path: str | os.PathLike) -> str:
    """A path relative to the checkout when it lies inside it; anything else (a command name) as it is."""
    p = Path(path)
    if not p.is_absolute():
        return os.fspath(path)
    try:
        return p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return p.as_posix()
