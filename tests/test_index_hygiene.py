"""An index that follows its folder: rows of files that are gone are dropped (atomically) and counted; junk
directories, hidden files and symlink loops are skipped. All on real files in tmp_path."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from clip_mini.cli.main import main
from clip_mini.retrieval.files import DEFAULT_EXCLUDE_DIRS, scan_images
from clip_mini.retrieval.index import EmbeddingIndex
from conftest import write_images
from timeouts import within


def _names(paths) -> list[str]:
    return sorted(Path(p).name for p in paths)


def _index(folder: Path, out: Path, model_dir: Path, capsys, *flags: str) -> str:
    capsys.readouterr()
    assert main(["index", "--model", str(model_dir), "--images", str(folder), "--out", str(out), "--quiet",
                 *flags]) == 0
    return capsys.readouterr().out


# -- gone files ------------------------------------------------------------------------------------------------
def test_reindexing_drops_the_rows_of_gone_files_and_says_how_many(tmp_path, model_dir, capsys):
    images = write_images(tmp_path / "photos", 6)
    out = tmp_path / "index"
    assert "6 images, generation 1; 6 added, 0 dropped" in _index(tmp_path / "photos", out, model_dir, capsys)
    images[1].unlink()
    images[4].unlink()
    write_images(tmp_path / "photos", 1, seed=9, prefix="new")
    line = _index(tmp_path / "photos", out, model_dir, capsys)
    assert "5 images, generation 2; 1 added, 2 dropped (files gone or no longer listed)" in line, line
    assert _names(EmbeddingIndex.load(out).items["path"]) == ["img000.png", "img002.png", "img003.png", "img005.png",
                                                              "new000.png"]
    # unchanged folder: nothing written, nothing dropped
    assert "5 images, generation 2; 0 added, 0 dropped\n" in _index(tmp_path / "photos", out, model_dir, capsys)
    # --add keeps rows whose files are not listed now
    images[0].unlink()
    assert "5 images, generation 2; 0 added, 0 dropped" in _index(tmp_path / "photos", out, model_dir, capsys,
                                                                  "--add")


def test_the_api_reports_added_and_dropped_rows(tmp_path, model_dir):
    images = write_images(tmp_path / "photos", 4)
    index = EmbeddingIndex.build(tmp_path / "index", model_dir, tmp_path / "photos", progress=False)
    assert index.changes == {"added": 4, "dropped": 0}
    images[2].unlink()
    index = EmbeddingIndex.build(tmp_path / "index", model_dir, tmp_path / "photos", progress=False)
    assert index.changes == {"added": 0, "dropped": 1} and len(index) == 3
    assert EmbeddingIndex.load(tmp_path / "index").changes is None   # only a build knows what it changed


def test_the_drop_is_atomic(tmp_path, model_dir, capsys, monkeypatch):
    """A build that dies before its commit leaves the previous generation whole: every old row, readable."""
    from clip_mini.retrieval import build

    images = write_images(tmp_path / "photos", 5)
    out = tmp_path / "index"
    _index(tmp_path / "photos", out, model_dir, capsys)
    before = EmbeddingIndex.load(out)
    images[0].unlink()
    images[3].unlink()

    def killed(*args, **kwargs):
        raise OSError("disk full (simulated) before the commit")

    monkeypatch.setattr(build, "commit", killed)
    assert main(["index", "--model", str(model_dir), "--images", str(tmp_path / "photos"), "--out", str(out),
                 "--quiet"]) == 2
    after = EmbeddingIndex.load(out)   # checksums verified
    assert after.manifest["generation"] == 1 and len(after) == 5
    assert list(after.items["path"]) == list(before.items["path"])
    assert (after.embeddings[:] == before.embeddings[:]).all()
    monkeypatch.undo()
    assert "3 images, generation 2; 0 added, 2 dropped" in _index(tmp_path / "photos", out, model_dir, capsys)


# -- which files a folder holds -----------------------------------------------------------------------------------
@pytest.fixture
def messy_folder(tmp_path) -> Path:
    """Photos beside the junk rclip skips by default, hidden files and a hidden folder."""
    root = tmp_path / "photos"
    write_images(root, 2, prefix="top")
    write_images(root / "2024" / "trip", 2, prefix="trip")
    for i, junk in enumerate(DEFAULT_EXCLUDE_DIRS):
        write_images(root / junk, 1, seed=i, prefix=f"junk{i}")
    write_images(root / "2024" / "site" / "node_modules" / "pkg", 1, prefix="deepjunk")   # at any depth
    write_images(root / ".thumbnails", 1, prefix="hiddendir")
    write_images(root / "2024", 1, prefix=".hidden")
    return root


def test_junk_directories_and_hidden_files_are_skipped_by_default(messy_folder):
    assert _names(scan_images(messy_folder)) == ["top000.png", "top001.png", "trip000.png", "trip001.png"]
    assert _names(scan_images(messy_folder, include_hidden=True)) == [
        ".hidden000.png", "hiddendir000.png", "top000.png", "top001.png", "trip000.png", "trip001.png"]
    # an explicit list replaces the defaults
    assert _names(scan_images(messy_folder, exclude_dirs=["trip", "@eaDir"])) == [
        "deepjunk000.png", "junk1000.png", "junk3000.png", "top000.png", "top001.png"]
    assert len(scan_images(messy_folder, exclude_dirs=[], include_hidden=True)) == 2 + 2 + 4 + 1 + 1 + 1
    with pytest.raises(Exception, match="a list of directory names"):
        scan_images(messy_folder, exclude_dirs="node_modules")


def test_index_exclude_dir_and_include_hidden_flags(messy_folder, tmp_path, model_dir, capsys):
    out = tmp_path / "index"
    assert "4 images" in _index(messy_folder, out, model_dir, capsys)
    line = _index(messy_folder, out, model_dir, capsys, "--exclude-dir", "trip", "--exclude-dir", "node_modules",
                  "--include-hidden")
    assert "7 images, generation 2; 5 added, 2 dropped" in line, line   # the other defaults are back in
    assert _names(EmbeddingIndex.load(out).items["path"]) == [
        ".hidden000.png", "hiddendir000.png", "junk0000.png", "junk2000.png", "junk3000.png", "top000.png",
        "top001.png"]
    code = main(["index", "--model", str(model_dir), "--captions", str(tmp_path / "c.csv"), "--out", str(out),
                 "--exclude-dir", "x"])
    assert code == 2 and "--exclude-dir and --include-hidden choose the files of --images" in capsys.readouterr().err


def test_symlink_loops_are_skipped_never_followed_forever(tmp_path, model_dir, capsys):
    root = tmp_path / "photos"
    write_images(root / "sub", 2, prefix="sub")
    outside = tmp_path / "elsewhere"
    write_images(outside, 1, prefix="ext")
    (root / "sub" / "back").symlink_to(root, target_is_directory=True)   # a loop through the parent
    (root / "self").symlink_to(root / "self")                           # a link to itself
    (root / "alias").symlink_to(root / "sub", target_is_directory=True)   # a second way into sub
    (root / "ext").symlink_to(outside, target_is_directory=True)          # a linked folder: walked, once
    (outside / "home").symlink_to(root, target_is_directory=True)         # ... which links back
    (root / "loop.png").symlink_to(root / "loop.png")                     # a file link to itself
    found = within(20, scan_images, root)
    rel = sorted(os.path.relpath(p, root) for p in found)
    assert rel == ["ext/ext000.png", "loop.png", "sub/sub000.png", "sub/sub001.png"], rel   # real paths first
    # the index embeds each image once; the file loop is reported, not followed
    out = tmp_path / "index"
    assert "3 images" in _index(root, out, model_dir, capsys)
    with open(out / "skipped.csv", newline="") as f:
        skipped = {Path(r["path"]).name: r["reason"] for r in csv.DictReader(f)}
    assert list(skipped) == ["loop.png"] and "symbolic links" in skipped["loop.png"], skipped
