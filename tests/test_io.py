"""Atomic writes: readable permissions, nothing left behind on failure, the old file intact."""
import os
import stat

import pytest

from clip_mini.fileio.atomic import OutputError, atomic_dir, atomic_write_text


def test_atomic_files_and_dirs_get_normal_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "hi")
        with atomic_dir(tmp_path / "d") as d:
            (d / "x").write_text("1")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "a.txt"
    atomic_write_text(target, "old")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OutputError, match="a.txt.*No space left"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_unwritable_folder_gives_clear_error(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        with pytest.raises(OutputError, match="cannot write"):
            atomic_write_text(blocker / "sub" / "a.txt", "x")  # parent is a file: fails even for root
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OutputError, match="cannot write"):
            atomic_write_text(ro / "a.txt", "x")
