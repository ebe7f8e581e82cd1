"""Inputs that are not regular files, and reads that stall: nothing may block without bound.

A named pipe, a socket and ``/dev/zero`` are put under image names (and under a captions file's name) and fed
through ``clip-mini index`` (in a subprocess, with a timeout) and through the dataset reader (in a thread that the
test waits on for a bounded time), so a regression fails instead of hanging the suite. A stalled network mount is
simulated by a read that never returns.
"""
from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from clip_mini.fileio import bounded_read
from clip_mini.config import DataConfig
from clip_mini.data.dataset import CaptionDataset, load_table
from clip_mini.data.images import ImageError, check_images, load_image
from clip_mini.data.readers import DataError, read_captions
from clip_mini.data.splits import read_name_list
from conftest import write_images
from timeouts import within

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 20   # far above what any of these calls needs; only a hang gets near it
SPECIAL = {"fifo.jpg": "named pipe", "sock.png": "socket", "zero.jpg": "character device"}




@pytest.fixture
def weird_folder(tmp_path, monkeypatch):
    """Three PNGs, a link to one of them, and a FIFO, a socket and a link to /dev/zero under image names."""
    folder = tmp_path / "photos"
    write_images(folder, 3)
    (folder / "link.png").symlink_to(folder / "img000.png")
    os.mkfifo(folder / "fifo.jpg")
    (folder / "zero.jpg").symlink_to("/dev/zero")
    monkeypatch.chdir(folder)   # a relative bind: AF_UNIX paths are limited to ~108 bytes
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("sock.png")
    yield folder
    sock.close()


def test_index_cli_skips_pipes_sockets_and_devices(weird_folder, model_dir, tmp_path):
    out = tmp_path / "index"
    cmd = [sys.executable, "-m", "clip_mini", "index", "--model", str(model_dir), "--images", str(weird_folder),
           "--out", str(out), "--quiet"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("clip-mini index hung on a folder with a FIFO, a socket and /dev/zero")
    assert proc.returncode == 0, proc.stderr
    with open(out / "skipped.csv", newline="") as f:
        skipped = {Path(row["path"]).name: row["reason"] for row in csv.DictReader(f)}
    assert set(skipped) == set(SPECIAL), skipped
    for name, kind in SPECIAL.items():
        assert kind in skipped[name], skipped
    from clip_mini.retrieval.index import EmbeddingIndex

    indexed = sorted(Path(p).name for p in EmbeddingIndex.load(out).items["path"])
    assert indexed == ["img000.png", "img001.png", "img002.png", "link.png"]   # a link to a file is a file


def test_load_image_and_check_images_refuse_special_files(weird_folder):
    for name, kind in SPECIAL.items():
        with pytest.raises(ImageError, match=kind) as err:
            within(LIMIT_S, load_image, str(weird_folder / name))
        assert err.value.path == str(weird_folder / name)
    bad = within(LIMIT_S, check_images, [str(weird_folder / n) for n in [*SPECIAL, "img001.png", "link.png"]])
    assert sorted(Path(p).name for p in bad) == sorted(SPECIAL)
    for p, reason in bad.items():
        assert SPECIAL[Path(p).name] in reason, reason


def test_dataset_reader_skips_and_reports_special_files(weird_folder, tmp_path):
    captions = weird_folder / "captions.csv"
    names = ["img000.png", "img001.png", "img002.png", "link.png", *SPECIAL]
    captions.write_text("image,caption\n" + "".join(f"{n},a picture called {n}\n" for n in names))
    report = tmp_path / "run"
    report.mkdir()
    df = within(LIMIT_S, load_table, DataConfig(captions=str(captions), cache=False), report, False)
    assert sorted(Path(p).name for p in df["path"].unique()) == ["img000.png", "img001.png", "img002.png",
                                                                 "link.png"]
    with open(report / "skipped.csv", newline="") as f:
        skipped = {Path(row["path"]).name: row["reason"] for row in csv.DictReader(f)}
    assert {n: kind in skipped.get(n, "") for n, kind in SPECIAL.items()} == dict.fromkeys(SPECIAL, True), skipped

    # A file that turns into a pipe after the check: the training reader substitutes the next row, warns, goes on.
    os.unlink(weird_folder / "img001.png")
    os.mkfifo(weird_folder / "img001.png")
    ds = CaptionDataset(df, transform=lambda a: a.shape)
    row = df.index[df["image"] == "img001.png"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, caption, _ = within(LIMIT_S, ds.__getitem__, row)
    assert caption != "a picture called img001.png"
    assert any("named pipe" in str(w.message) for w in caught)


@pytest.mark.parametrize("name", ["fifo.jpg", "zero.jpg", "sock.png"])
def test_captions_and_split_files_that_are_not_regular_files(weird_folder, name):
    with pytest.raises(DataError, match=f"captions file {weird_folder / name}: not a regular file"):
        within(LIMIT_S, read_captions, weird_folder / name)
    with pytest.raises(DataError, match=f"split file {weird_folder / name}: not a regular file"):
        within(LIMIT_S, read_name_list, weird_folder / name)


def test_pipe_swapped_in_after_the_stat_does_not_block_the_open(weird_folder, monkeypatch):
    # Simulate the race: the name passes the stat check, then a FIFO is what gets opened. O_NONBLOCK keeps open()
    # from waiting for a writer, and fstat on the descriptor refuses it.
    monkeypatch.setattr(bounded_read, "check_regular", lambda path: None)
    with pytest.raises(bounded_read.UnreadableFileError, match="named pipe") as err:
        within(LIMIT_S, bounded_read.read_file, weird_folder / "fifo.jpg", None, 0, None, LIMIT_S / 2)
    assert "not read within" not in str(err.value)   # refused at once, not after the time limit


def test_stalled_read_is_skipped_after_the_time_limit(tmp_path, monkeypatch):
    """A read that never returns (a hung NFS/FUSE mount) is abandoned after ``READ_TIMEOUT_S``."""
    good, stalled = write_images(tmp_path, 2)
    release = threading.Event()
    real_read_at = bounded_read._read_at

    def read_at(fd, offset, n):
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(stalled.resolve()):
            release.wait(LIMIT_S)
        return real_read_at(fd, offset, n)

    monkeypatch.setattr(bounded_read, "_read_at", read_at)
    monkeypatch.setattr(bounded_read, "READ_TIMEOUT_S", 0.3)
    try:
        with pytest.raises(ImageError, match=r"not read within 0.3 s") as err:
            within(LIMIT_S, load_image, str(stalled))
        assert err.value.path == str(stalled)
        assert "not read within 0.3 s" in within(LIMIT_S, check_images, [str(stalled)])[str(stalled)]
        # The stuck helper thread is left behind; the next read gets a fresh one and succeeds.
        assert within(LIMIT_S, load_image, str(good)).shape == (24, 24, 3)
    finally:
        release.set()


def test_stalled_read_inside_a_read_ahead_batch_is_skipped_and_the_rest_read(tmp_path, monkeypatch):
    """The batched path (``ImageDataset.__getitems__`` -> ``load_images`` -> ``iter_bounded``, and the index's
    hashing): a stalled file in the middle of a batch is reported after the limit, the files after it are read
    on a fresh helper, and no helper is left running once the stalled read returns."""
    import time

    import torch

    from clip_mini.data import ImageDataset

    paths = [str(p) for p in write_images(tmp_path, 4)]
    stalled = paths[1]
    release = threading.Event()
    real_read_at = bounded_read._read_at

    def read_at(fd, offset, n):
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(Path(stalled).resolve()):
            release.wait(LIMIT_S)
        return real_read_at(fd, offset, n)

    real_sha = bounded_read._sha256_unbounded

    def sha(path, *args):   # hashing reads with os.pread itself
        if path == stalled:
            release.wait(LIMIT_S)
        return real_sha(path, *args)

    monkeypatch.setattr(bounded_read, "_read_at", read_at)
    monkeypatch.setattr(bounded_read, "_sha256_unbounded", sha)
    monkeypatch.setattr(bounded_read, "READ_TIMEOUT_S", 0.3)
    ds = ImageDataset(paths, lambda a: torch.from_numpy(a).float())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            items = within(LIMIT_S, ds.__getitems__, [0, 1, 2, 3])
        assert [(i, ok) for _, i, ok in items] == [(0, True), (1, False), (2, True), (3, True)]
        assert torch.equal(items[2][0], ds[2][0])   # the same pixels as one by one
        assert any("not read within 0.3 s" in str(w.message) and stalled in str(w.message) for w in caught)
        digests = within(LIMIT_S, list, bounded_read.sha256_regular_files([paths[0], stalled, paths[3]]))
        assert [p for p, _ in digests] == [paths[0], stalled, paths[3]]
        assert isinstance(digests[1][1], bounded_read.UnreadableFileError) and "not read within" in str(digests[1][1])
        assert digests[0][1] == bounded_read.sha256_regular_file(paths[0])
    finally:
        release.set()
    deadline = time.monotonic() + LIMIT_S
    while any(t.name == "clip_mini-bounded-read-ahead" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a read-ahead helper is still running"
        time.sleep(0.05)


def test_read_ahead_helper_stops_when_the_caller_stops(tmp_path):
    paths = [str(p) for p in write_images(tmp_path, 3)] * 20
    results = bounded_read.read_files(paths)
    first = next(results)
    assert first[0] == paths[0] and isinstance(first[1], bytes) and first[1]
    results.close()   # the caller is done after one file: the helper must not read on
    import time

    deadline = time.monotonic() + LIMIT_S
    while any(t.name == "clip_mini-bounded-read-ahead" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the read-ahead helper kept running after the caller stopped"
        time.sleep(0.05)
    with pytest.raises(ValueError, match="boom"):   # not a bad file but a bug: raised, as run_bounded does
        list(bounded_read._only_os_errors(bounded_read.iter_bounded(paths[:2], lambda p: int("boom"))))


def test_oversized_file_is_refused_before_reading(tmp_path):
    big = tmp_path / "huge.png"
    with open(big, "wb") as f:
        f.truncate((1 << 30) + 1)   # sparse: no disk space, and nothing is read
    with pytest.raises(ImageError, match="more than the limit"):
        within(LIMIT_S, load_image, str(big))
    assert "more than the limit" in check_images([str(big)])[str(big)]


def test_reads_work_in_forked_dataloader_workers(tmp_path):
    """The helper thread does not survive fork: a DataLoader worker must start its own."""
    import torch
    from torch.utils.data import DataLoader

    from clip_mini.data import ImageDataset

    paths = [str(p) for p in write_images(tmp_path, 4)]
    load_image(paths[0])   # the parent's helper thread exists before the fork
    ds = ImageDataset(paths, lambda a: torch.from_numpy(a).float())
    loader = DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="fork")
    batches = within(60, list, loader)
    assert [bool(ok) for _, _, oks in batches for ok in oks] == [True] * 4


def test_helper_threads_end_when_idle(tmp_path, monkeypatch):
    """Callers on many short-lived threads must not leave one parked helper thread each behind."""
    import time

    monkeypatch.setattr(bounded_read, "_IDLE_S", 0.2)
    path = write_images(tmp_path, 1)[0]
    before = {t.ident for t in threading.enumerate()}
    callers = [threading.Thread(target=load_image, args=(str(path),)) for _ in range(20)]
    for t in callers:
        t.start()
        t.join(LIMIT_S)
    assert load_image(str(path)).shape == (24, 24, 3)   # and this thread's helper ends too, then is replaced
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        helpers = [t for t in threading.enumerate() if t.name == "clip_mini-bounded-read" and t.ident not in before]
        if not helpers:
            break
        time.sleep(0.05)
    assert not helpers, f"{len(helpers)} helper threads still alive"
    assert load_image(str(path)).shape == (24, 24, 3)
