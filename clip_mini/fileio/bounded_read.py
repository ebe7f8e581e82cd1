"""Reading input files so that no read blocks without bound.

A folder of "images" or a captions file can name things that are not regular files, and opening or reading
those blocks or never ends:

* a named pipe (FIFO): ``open()`` waits for a writer, forever if none comes; ``read()`` then waits for data;
* a socket: ``open()`` fails (ENXIO), but nothing useful can be read from it anyway;
* a device node, e.g. ``photo.jpg -> /dev/zero``: reads never end (memory grows until the process dies), and
  merely opening some devices waits (a serial line without carrier) or has side effects (a watchdog starts);
* a regular file on a stalled network or FUSE mount: ``stat``/``open``/``read`` sleep uninterruptibly in the
  kernel, and no flag changes that.

So: the path is ``stat``-ed first and anything but a regular file (symlinks are followed) is refused before it
is opened; it is then opened with ``O_NONBLOCK`` (a FIFO swapped in after the ``stat`` cannot block the open)
and ``fstat``-ed again on the open descriptor, which is what is actually read. Reads are capped at the size
``fstat`` reported (a file that keeps growing does not keep us reading) and at ``max_bytes``. Last, the whole
operation runs on a helper thread and the caller waits at most ``timeout`` seconds: a stalled mount cannot be
interrupted, so the stuck thread is abandoned (it is a daemon thread, and the next read gets a fresh one) and
the file is reported as unreadable.
"""
from __future__ import annotations

import hashlib
import os
import queue
import stat
import threading
from typing import BinaryIO, Callable, Iterator, Optional, Sequence, TypeVar

from clip_mini.errors import UnreadableFileError

# Generous for any local disk: a whole 1 GiB file reads in a few seconds even from a slow disk.
READ_TIMEOUT_S = 60.0
_IDLE_S = 10.0   # a helper thread with no work for this long ends itself

T = TypeVar("T")


def file_kind(mode: int) -> str:
    """What a ``st_mode`` describes, in words ("named pipe (FIFO)", "socket", ...)."""
    kinds = [(stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "named pipe (FIFO)"),
             (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")]
    return next((name for test, name in kinds if test(mode)), f"special file (mode {mode:o})")


def check_regular(path: str | os.PathLike) -> os.stat_result:
    """``os.stat(path)`` (links followed), or ``UnreadableFileError`` when it is not a regular file.

    Raises:
        FileNotFoundError: the path does not exist (or is a dangling link).
        UnreadableFileError: it is a pipe, socket, device node or directory.
    """
    if "\0" in os.fsdecode(path):   # os.stat would raise ValueError, which callers do not expect of a bad file
        raise UnreadableFileError(os.fsdecode(path), "the name contains a NUL byte")
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnreadableFileError(os.fspath(path), f"not a regular file but a {file_kind(st.st_mode)}; skipped")
    return st


def read_file(path: str | os.PathLike, head: Optional[int] = None, tail: int = 0,
              max_bytes: Optional[int] = None, timeout: Optional[float] = None) -> tuple[bytes, bytes, int]:
    """The first ``head`` bytes (all when None) and the last ``tail`` bytes of a regular file, and its size.

    Args:
        path: the file; a link to a regular file is fine.
        head: bytes to read from the start; None reads the whole file.
        tail: bytes to read from the end (0: none); they may overlap the head.
        max_bytes: refuse files larger than this before reading anything.
        timeout: seconds the whole read may take (default ``READ_TIMEOUT_S``).

    Raises:
        FileNotFoundError, PermissionError, ...: as ``open`` raises them.
        UnreadableFileError: not a regular file, larger than ``max_bytes``, or not read within ``timeout``.
    """
    path = os.fspath(path)
    return run_bounded(path, lambda: _read_unbounded(path, head, tail, max_bytes), timeout)


def _read_unbounded(path: str, head: Optional[int] = None, tail: int = 0,
                    max_bytes: Optional[int] = None) -> tuple[bytes, bytes, int]:
    def work(fd: int, size: int) -> tuple[bytes, bytes, int]:
        if max_bytes is not None and size > max_bytes:
            raise UnreadableFileError(path, f"{size} bytes is more than the limit of {max_bytes}")
        first = _read_at(fd, 0, size if head is None else min(head, size))
        last = _read_at(fd, max(0, size - tail), min(tail, size)) if tail else b""
        return first, last, size

    return _with_regular_fd(path, work)


def sha256_regular_file(path: str | os.PathLike, max_bytes: Optional[int] = None,
                        timeout: Optional[float] = None, chunk: int = 1 << 20) -> str:
    """sha256 hex digest of a regular file's bytes, read under the same rules as ``read_file``."""
    path = os.fspath(path)
    return run_bounded(path, lambda: _sha256_unbounded(path, max_bytes, chunk), timeout)


def _sha256_unbounded(path: str, max_bytes: Optional[int] = None, chunk: int = 1 << 20,
                      inspect: Optional[Callable[[BinaryIO], T]] = None):
    def work(fd: int, size: int):
        if max_bytes is not None and size > max_bytes:
            raise UnreadableFileError(path, f"{size} bytes is more than the limit of {max_bytes}")
        h, done = hashlib.sha256(), 0
        while done < size:
            block = os.pread(fd, min(chunk, size - done), done)
            if not block:
                break   # the file shrank while being read; hash what there is, as a plain read would
            h.update(block)
            done += len(block)
        return h.hexdigest() if inspect is None else (h.hexdigest(), _inspect_fd(fd, inspect))

    return _with_regular_fd(path, work)


def _inspect_fd(fd: int, inspect: Callable[[BinaryIO], T]) -> T:
    """``inspect`` on a file object over ``fd`` (left open: the caller closes it)."""
    with open(fd, "rb", closefd=False) as f:
        return inspect(f)


def read_files(paths: Sequence[str], max_bytes: Optional[int] = None, timeout: Optional[float] = None
               ) -> Iterator[tuple[str, bytes | OSError]]:
    """``(path, whole contents)`` for each path in order, or ``(path, the OSError)`` for one that cannot be read
    (``read_file``'s rules and errors): ``iter_bounded`` reads them ahead on one helper thread."""
    return _only_os_errors(iter_bounded(paths, lambda p: _read_unbounded(p, max_bytes=max_bytes)[0], timeout))


def sha256_regular_files(paths: Sequence[str], max_bytes: Optional[int] = None, timeout: Optional[float] = None,
                         inspect: Optional[Callable[[BinaryIO], T]] = None) -> Iterator[tuple[str, object]]:
    """``(path, sha256 hex digest)`` for each path in order, or ``(path, the OSError)``, as ``read_files``.

    With ``inspect``: ``(path, (digest, inspect(file)))``, ``inspect`` called on the descriptor just hashed (the
    same file, not whatever the name points at by then; its pages still cached), on the helper thread and within
    the same time bound; it should not raise (anything but an ``OSError`` is taken for a bug and re-raised)."""
    return _only_os_errors(iter_bounded(paths, lambda p: _sha256_unbounded(p, max_bytes, 1 << 20, inspect), timeout))


def inspect_regular_files(paths: Sequence[str], inspect: Callable[[BinaryIO], T], timeout: Optional[float] = None
                          ) -> Iterator[tuple[str, T | OSError]]:
    """``(path, inspect(file))`` for each path in order, or ``(path, the OSError)``: each regular file opened under
    ``read_file``'s rules and handed to ``inspect`` (which reads what it needs, e.g. a header), read ahead on one
    helper thread, each within ``timeout``."""
    return _only_os_errors(iter_bounded(
        paths, lambda p: _with_regular_fd(p, lambda fd, size: _inspect_fd(fd, inspect)), timeout))


def _only_os_errors(results: Iterator[tuple[str, bool, object]]) -> Iterator[tuple[str, object]]:
    for path, ok, value in results:
        if not ok and not isinstance(value, OSError):
            raise value   # a bug or MemoryError, not a bad file: as run_bounded re-raises it
        yield path, value


def _with_regular_fd(path: str, work: Callable[[int, int], T]) -> T:
    check_regular(path)   # refuse devices before opening them: opening some has side effects
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)   # the descriptor we read, not whatever the name pointed at a moment ago
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFileError(path, f"not a regular file but a {file_kind(st.st_mode)}; skipped")
        return work(fd, st.st_size)
    finally:
        os.close(fd)


def _read_at(fd: int, offset: int, n: int) -> bytes:
    parts, done = [], 0
    while done < n:
        block = os.pread(fd, n - done, offset + done)
        if not block:
            break   # shorter than fstat said (truncated meanwhile): the decoder reports what is missing
        parts.append(block)
        done += len(block)
    return b"".join(parts)


# -- the helper thread -----------------------------------------------------------------------------------------
class _Worker:
    """One daemon thread running read jobs in order; abandoned (never joined) when a job overruns.

    It ends itself after ``_IDLE_S`` without work, so a program that calls from many short-lived threads does
    not collect one parked helper per thread it ever had.
    """

    def __init__(self):
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()   # orders "submit" against "exit when idle"
        self.closed = False
        threading.Thread(target=self._loop, name="clip_mini-bounded-read", daemon=True).start()

    def submit(self, job) -> bool:
        """Queue ``job``; False when the thread has already ended (the caller makes a new worker)."""
        with self.lock:
            if not self.closed:
                self.jobs.put(job)
            return not self.closed

    def _loop(self) -> None:
        while True:
            try:
                fn, box, done = self.jobs.get(timeout=_IDLE_S)
            except queue.Empty:
                with self.lock:
                    if self.jobs.empty():
                        self.closed = True
                        return
                continue
            try:
                box.append((True, fn()))
            except BaseException as e:   # handed to the waiting caller, which re-raises it
                box.append((False, e))
            done.set()


_local = threading.local()   # one worker per calling thread, so one caller's stalled file never delays another


def run_bounded(path: str, fn: Callable[[], T], timeout: Optional[float] = None) -> T:
    """Run ``fn`` on a helper thread and wait at most ``timeout`` seconds (default ``READ_TIMEOUT_S``).

    Raises:
        UnreadableFileError: ``fn`` did not finish in time (naming ``path``); whatever ``fn`` raised otherwise.
    """
    timeout = READ_TIMEOUT_S if timeout is None else timeout
    box: list = []
    done = threading.Event()
    worker: Optional[_Worker] = getattr(_local, "worker", None)
    # Threads do not survive fork (DataLoader workers), and an idle helper ends itself.
    while worker is None or worker.pid != os.getpid() or not worker.submit((fn, box, done)):
        worker = _local.worker = _Worker()
    if not done.wait(timeout):
        _local.worker = None   # stuck in the kernel; leave it and start a fresh thread next time
        raise UnreadableFileError(path, f"not read within {timeout:g} s (a stalled network or FUSE mount?); "
                                        "skipped")
    ok, value = box[0]
    if ok:
        return value
    raise value


def iter_bounded(paths: Sequence[str], fn: Callable[[str], T], timeout: Optional[float] = None, ahead: int = 4
                 ) -> Iterator[tuple[str, bool, object]]:
    """``fn(path)`` for each path, in order, on one helper thread that runs at most ``ahead`` results ahead of the
    caller; yields ``(path, True, value)`` or ``(path, False, the exception)``.

    ``run_bounded`` per file hands every file to its helper and waits: two thread switches a file, a large share of
    indexing small photos with a small model. Here the helper reads ahead while the caller decodes. The bound is the
    same: a path gets at least ``timeout`` seconds (default ``READ_TIMEOUT_S``) from when the caller starts waiting
    for it, and one that overruns yields ``UnreadableFileError``; its helper is abandoned (told to stop once it wakes)
    and the paths after it go to a fresh one. A helper of its own, not ``run_bounded``'s: the caller may call
    ``run_bounded`` while iterating.
    """
    timeout = READ_TIMEOUT_S if timeout is None else timeout
    paths, i = list(paths), 0
    while i < len(paths):
        results: queue.Queue = queue.Queue(maxsize=ahead)   # bounded: a folder of large files is not held at once
        stop = threading.Event()

        def job(todo: list[str] = paths[i:], results: queue.Queue = results, stop: threading.Event = stop) -> None:
            for p in todo:
                if stop.is_set():
                    return
                try:
                    r = (True, fn(p))
                except BaseException as e:   # handed to the caller
                    r = (False, e)
                while not stop.is_set():
                    try:
                        results.put(r, timeout=0.1)
                        break
                    except queue.Full:
                        continue

        threading.Thread(target=job, name="clip_mini-bounded-read-ahead", daemon=True).start()
        try:
            while i < len(paths):
                try:
                    ok, value = results.get(timeout=timeout)
                except queue.Empty:
                    yield paths[i], False, UnreadableFileError(
                        paths[i], f"not read within {timeout:g} s (a stalled network or FUSE mount?); skipped")
                    i += 1
                    break   # the helper is stuck in the kernel on paths[i]: the rest on a fresh one
                i += 1
                yield paths[i - 1], ok, value
        finally:
            stop.set()   # done, stuck, or the caller stopped iterating: the helper ends at its next check
