"""The command line's rough edges found by a new user (issue 41): each misuse gets one clear line naming what was
wrong, and nothing is created or scanned that the user did not ask for."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from clip_mini.cli.main import main
from conftest import write_images

ROOT = Path(__file__).resolve().parents[1]


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def small_index(model_dir, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli_edges")
    write_images(tmp / "photos", 5, seed=2)
    assert main(["index", "--model", str(model_dir), "--images", str(tmp / "photos"), "--out", str(tmp / "index"),
                 "--faiss", "none", "--quiet"]) == 0
    return tmp / "index"


# -- search ---------------------------------------------------------------------------------------------------
def test_k_over_the_index_size_lists_all_with_a_note(small_index, capsys):
    code, out, err = _run(["search", "--index", str(small_index), "a red circle", "-k", "100000"], capsys)
    assert code == 0 and len(out.strip().splitlines()) == 1 + 5   # header and every image
    assert f"note: -k 100000 is more than the 5 images in {small_index}: listing all of them" in err
    code, _, err = _run(["search", "--index", str(small_index), "a red circle", "-k", "5"], capsys)
    assert code == 0 and "note" not in err
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    assert "a larger k lists every image, with a note" in " ".join(capsys.readouterr().out.split())


def test_backend_faiss_without_a_faiss_file_is_an_error(small_index, capsys):
    code, out, err = _run(["search", "--index", str(small_index), "red", "--backend", "faiss"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: --backend faiss:") and "has no faiss index" in err and "--backend exact" in err


def test_a_wrong_model_directory_is_named(small_index, tmp_path, capsys):
    code, _, err = _run(["search", "--index", str(small_index), "red", "--model", str(tmp_path / "nope")], capsys)
    assert code == 2 and str(tmp_path / "nope") in err and "is gone" not in err


@pytest.mark.parametrize("command", ["search", "attention"])
def test_output_into_a_missing_folder_is_an_error(command, small_index, model_dir, tmp_path, capsys):
    target = tmp_path / "missing" / "deeper" / "out.png"
    if command == "search":
        argv = ["search", "--index", str(small_index), "red", "--grid", str(target)]
        option = "--grid"
    else:
        argv = ["attention", "--model", str(model_dir), str(next((small_index.parent / "photos").iterdir())),
                "--out", str(target)]
        option = "--out"
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert f"error: {option} {target}: the folder {target.parent} does not exist (create it first)" in err
    assert not (tmp_path / "missing").exists()   # nothing created


# -- index ----------------------------------------------------------------------------------------------------------
def test_index_out_naming_a_file_is_a_clear_error(model_dir, tmp_path, capsys):
    write_images(tmp_path / "photos", 2)
    (tmp_path / "notimage.txt").write_text("notes")
    code, _, err = _run(["index", "--model", str(model_dir), "--images", str(tmp_path / "photos"),
                         "--out", str(tmp_path / "notimage.txt")], capsys)
    assert code == 2 and "Errno" not in err
    assert f"index {tmp_path / 'notimage.txt'} is a file, not a directory" in err
    assert (tmp_path / "notimage.txt").read_text() == "notes"


def test_a_bad_image_while_indexing_is_reported_not_warned(model_dir, tmp_path, capsys):
    write_images(tmp_path / "photos", 3)
    (tmp_path / "photos" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = _run(["index", "--model", str(model_dir), "--images", str(tmp_path / "photos"),
                               "--out", str(tmp_path / "index")], capsys)
    assert code == 0, err
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert "Warning" not in err and ".py:" not in err   # no warning with a source file and line
    assert "skipped=1" in err   # the progress line counts it
    assert "skipped 1 unusable images" in out + err
    assert "bad.png" in (tmp_path / "index" / "skipped.csv").read_text()


# -- eval and --set -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["test", "val"])
def test_an_empty_split_is_refused_before_any_image_is_read(split, model_dir, tmp_path, capsys, monkeypatch):
    import clip_mini.data

    def scan(*args, **kwargs):
        raise AssertionError("the dataset was scanned")

    monkeypatch.setattr(clip_mini.data, "load_splits", scan)
    cfg = tmp_path / "nosplit.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"captions": str(tmp_path / "captions.csv"), "val": 0.1, "test": 0,
                                            **({"val": 0} if split == "val" else {})}}))
    code, _, err = _run(["eval", "--model", str(model_dir), "--data", str(cfg), "--split", split], capsys)
    assert code == 2 and f"split '{split}' of {cfg} is empty (data.{split}=0" in err, err


def test_a_bad_set_value_is_blamed_on_set(tmp_path, capsys):
    config = str(ROOT / "configs" / "tiny.yaml")
    code, _, err = _run(["train", "--config", config, "--set", "train.epochs=three", "--print-config"], capsys)
    assert code == 2 and err.strip() == "error: --set train.epochs=three: train.epochs must be an integer, got 'three'"
    code, _, err = _run(["train", "--config", config, "--set", "train.epochs=0", "--print-config"], capsys)
    assert code == 2 and err.startswith("error: --set train.epochs=0: train.epochs must be")
    bad = tmp_path / "bad.yaml"   # the same mistake in the file is still the file's
    bad.write_text("train:\n  epochs: three\n")
    code, _, err = _run(["train", "--config", str(bad), "--print-config"], capsys)
    assert code == 2 and err.startswith(f"error: {bad}: train.epochs must be an integer")


# -- the parser -----------------------------------------------------------------------------------------------------
def test_an_option_before_the_command(capsys):
    err = _usage_error(["--topk", "5", "red"], capsys)
    assert "--topk is not an option of clip-mini: options go after the command" in err
    assert "invalid choice: '5'" not in err
    err = _usage_error(["-k", "5", "red"], capsys)
    assert "-k goes after the command it is for: `clip-mini search ... -k ...`" in err
    err = _usage_error(["--json", "red"], capsys)
    assert "`clip-mini search ... --json ...` (also an option of eval, dupes)" in err


def test_a_command_typo_suggests_the_nearest(capsys):
    assert "unknown command 'serach'; did you mean 'search'?" in _usage_error(["serach", "red"], capsys)
    assert "did you mean 'index'?" in _usage_error(["indx"], capsys)
    assert "unknown command 'xyzzy' (commands: train, index, search" in _usage_error(["xyzzy"], capsys)


@pytest.mark.parametrize("command,texts", [
    ("serve", ["Serve an index over HTTP", "examples:\n  clip-mini serve --index", "(default: 8000)",
               "(default: 1)", "(default: 1.0)", "$CLIP_MINI_TOKEN"]),
    ("convert", ["WebDataset tar shards", "examples:\n  clip-mini convert --to-webdataset", "(default: 1000)",
                 "(default: auto)"])])
def test_serve_and_convert_help(command, texts, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for text in texts:
        assert text in out if "\n" in text else text in " ".join(out.split()), (text, out)
