"""`clip-mini search` in a pipe: --paths prints paths and nothing else, -0 NUL-separates them, and the exit status is
1 when nothing is returned, as grep's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clip_mini.cli.main import main
from conftest import write_images

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def photo_index(model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pipes") / "photos"
    write_images(folder, 5)
    out = folder.parent / "index"
    assert main(["index", "--model", str(model_dir), "--images", str(folder), "--out", str(out), "--quiet"]) == 0
    return out


def _run(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_paths_prints_one_path_per_line_and_nothing_else(photo_index, capsys):
    code, table, _ = _run(["search", "--index", str(photo_index), "a red circle", "-k", "3"], capsys)
    ranked = [line.split()[2] for line in table.splitlines()[1:]]
    # -k above the index size: its note goes to stderr, not among the paths
    code, out, err = _run(["search", "--index", str(photo_index), "a red circle", "-k", "9", "--paths"], capsys)
    assert code == 0 and "note: -k 9 is more than the 5 images" in err
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) == 6 and lines[:3] == ranked
    assert all(os.path.isabs(p) and Path(p).is_file() for p in lines[:-1])
    code, out, _ = _run(["search", "--index", str(photo_index), "a red circle", "-", "blue", "-k", "2", "--paths"],
                        capsys)
    assert code == 0 and len(out.splitlines()) == 2


def test_nul_separated_paths(photo_index, capsys):
    code, out, _ = _run(["search", "--index", str(photo_index), "a red circle", "-k", "3", "--paths"], capsys)
    lines = out.splitlines()
    code, out, _ = _run(["search", "--index", str(photo_index), "a red circle", "-k", "3", "-0"], capsys)
    assert code == 0 and out == "".join(p + "\0" for p in lines) and "\n" not in out


def test_paths_in_a_real_pipe_with_progress_on_stderr(photo_index):
    """The command as a shell runs it: stdout holds only the paths, even with progress bars and notes on."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "clip_mini", "search", "--index", str(photo_index), "a red circle",
                           "+", "a blue square", "-k", "10", "-0"], capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    paths = proc.stdout.split(b"\0")
    assert paths[-1] == b"" and len(paths) == 6 and all(Path(p.decode()).is_file() for p in paths[:-1])
    assert b"note: -k 10" in proc.stderr


def test_exit_status_1_when_nothing_is_returned(model_dir, tmp_path, capsys):
    """An index with no rows (the empty shard of a sharded build) returns nothing: exit 1 and empty stdout, in
    every output format."""
    from clip_mini.embed import load
    from clip_mini.retrieval.build import sync_index
    from clip_mini.retrieval.format import shard_dir

    [image] = write_images(tmp_path / "photos", 1)
    embedder = load(model_dir, device="cpu")
    for i in range(2):
        sync_index(tmp_path / "index", embedder, [str(image)], shard=(i, 2), model_dir=str(model_dir),
                   progress=False)
    empty, full = sorted((shard_dir(tmp_path / "index", (i, 2)) for i in range(2)), key=_rows)
    assert (len(_rows(empty)), len(_rows(full))) == (0, 1)
    code, out, err = _run(["search", "--index", str(empty), "a red circle", "--paths", "-q"], capsys)
    assert (code, out, err) == (1, "", "")
    code, out, _ = _run(["search", "--index", str(empty), "a red circle", "--json"], capsys)
    assert code == 1 and '"results": []' in out
    code, out, _ = _run(["search", "--index", str(full), "a red circle", "--paths"], capsys)
    assert code == 0 and out == f"{image}\n"


def _rows(index_dir: Path) -> list:
    from clip_mini.retrieval.index import EmbeddingIndex

    return list(EmbeddingIndex.load(index_dir).items["path"])


def test_paths_and_json_are_one_output_format(photo_index, capsys):
    code, _, err = _run(["search", "--index", str(photo_index), "a red circle", "--paths", "--json"], capsys)
    assert code == 2 and "--paths (or -0) and --json" in err
