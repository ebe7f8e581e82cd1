"""Reliability: a corpus of bad inputs through the real CLI, a full offline run, and full disks.

1. Bad-input corpus: each case is generated here (no committed binaries), run in-process through
   ``clip_mini.cli.main`` and must end with exit status 2 and one ``error: ...`` line on stderr naming the bad
   file, row or key -- never a traceback from deep inside a library.
2. No network: train -> index -> search with every socket connection refused in-process.
3. Disk full: ENOSPC while writing an index or a model directory gives a clear error and leaves the earlier
   index / model directory intact and loadable.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from clip_mini.cli.main import main
from conftest import tiny_sets, write_images

ROOT = Path(__file__).resolve().parents[1]


# -- shared material -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(model_dir, tmp_path_factory) -> dict:
    """Six images (with names the captions files below use) and an index of them built by ``model_dir``."""
    root = tmp_path_factory.mktemp("reliability")
    images = root / "data" / "images"
    write_images(images, 6)
    index = root / "index"
    assert main(["index", "--model", str(model_dir), "--images", str(images), "--out", str(index), "--quiet"]) == 0
    return {"images": images, "index": index, "model": model_dir}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and stderr of one in-process CLI call (argparse errors exit via SystemExit)."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@dataclass
class Case:
    """``make(tmp, base) -> (argv, expected substrings of stderr)``; every case expects exit status 2."""
    make: Callable[[Path, dict], tuple[list[str], list[str]]]


def _config(tmp: Path, text: str | bytes) -> Path:
    path = tmp / "config.yaml"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def _index_data(tmp: Path, base: dict, name: str, content: str | bytes, **data) -> tuple[list[str], Path]:
    """``clip-mini index --data CONFIG`` over a captions file ``name`` beside the shared images."""
    data_dir = tmp / "data"
    shutil.copytree(base["images"], data_dir / "images")
    captions = data_dir / name
    (captions.write_bytes if isinstance(content, bytes) else captions.write_text)(content)
    lines = [f"  captions: {captions}"] + [f"  {k}: {v}" for k, v in data.items()]
    config = _config(tmp, "data:\n" + "\n".join(lines) + "\n")
    return ["index", "--model", str(base["model"]), "--data", str(config), "--out", str(tmp / "idx"),
            "--quiet"], captions


def _captions_case(name: str, content: str | bytes, expect: list[str], **data) -> Case:
    def make(tmp, base):
        argv, captions = _index_data(tmp, base, name, content, **data)
        return argv, [str(captions)] + expect
    return Case(make)


def _train_config_case(text: str | bytes, expect: list[str], extra: tuple = (), names_file: bool = True) -> Case:
    def make(tmp, base):
        config = _config(tmp, text)
        return ["train", "--config", str(config), *extra], ([str(config)] if names_file else []) + expect
    return Case(make)


def _broken_model(tmp: Path, base: dict, edit: Callable[[Path], None]) -> Path:
    model = tmp / "model"
    shutil.copytree(base["model"], model)
    edit(model)
    return model


def _model_case(edit: Callable[[Path], None], expect: list[str], command: str = "index") -> Case:
    def make(tmp, base):
        model = _broken_model(tmp, base, edit)
        if command == "index":
            argv = ["index", "--model", str(model), "--images", str(base["images"]), "--out", str(tmp / "idx"),
                    "--quiet"]
        else:   # a text search with the broken model: the torch-free query encoder must refuse it too
            argv = ["search", "--index", str(base["index"]), "a red circle", "--model", str(model)]
        return argv, [str(model)] + expect
    return Case(make)


def _broken_index(tmp: Path, base: dict, edit: Callable[[Path], None]) -> Path:
    index = tmp / "index"
    shutil.copytree(base["index"], index)
    edit(index)
    return index


def _index_case(edit: Callable[[Path], None], expect: list[str]) -> Case:
    def make(tmp, base):
        index = _broken_index(tmp, base, edit)
        return ["search", "--index", str(index), "a red circle"], [str(index)] + expect
    return Case(make)


def _write(rel: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / rel).write_bytes(data)


def _unlink(rel: str) -> Callable[[Path], None]:
    return lambda d: (d / rel).unlink()


def _reseal_manifest(model: Path) -> None:
    """Recompute a model directory's manifest so its checksums match what is there now: the damage must then be
    caught by the loader itself, not by the checksum check."""
    from clip_mini.fileio.atomic import sha256_file
    from clip_mini.model.clip import _fingerprint

    manifest = json.loads((model / "manifest.json").read_text())
    manifest["files"] = {name: sha256_file(model / name) for name in manifest["files"] if (model / name).is_file()}
    manifest["fingerprint"] = _fingerprint(manifest["files"])
    (model / "manifest.json").write_text(json.dumps(manifest))


def _reseal(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda d: (edit(d), _reseal_manifest(d))


def _drop_tokenizer_and_reseal(model: Path) -> None:
    """A model directory whose manifest is consistent but lists no tokenizer (as if saved without one)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    _reseal_manifest(model)


def _other_models_index(tmp, base):
    # Search the shared index with a model of the same architecture but different weights.
    from conftest import make_model_dir

    other = make_model_dir(tmp / "other", seed=7)
    return ["search", "--index", str(base["index"]), "a red circle", "--model", str(other)], \
        [str(base["index"]), "built with model", "not comparable"]


def _index_into_other_models_index(tmp, base):
    from conftest import make_model_dir

    other = make_model_dir(tmp / "other", seed=7)
    index = _broken_index(tmp, base, lambda d: None)
    return ["index", "--model", str(other), "--images", str(base["images"]), "--out", str(index), "--quiet"], \
        [str(index), "built with model"]


def _only_bad_images(tmp, base):
    folder = tmp / "photos"
    folder.mkdir()
    (folder / "empty.png").write_bytes(b"")
    (folder / "text.jpg").write_text("this is not a JPEG")
    (folder / "truncated.png").write_bytes((base["images"] / "img000.png").read_bytes()[:40])
    return ["index", "--model", str(base["model"]), "--images", str(folder), "--out", str(tmp / "idx"),
            "--quiet"], ["none of the 3 images could be embedded", "skipped.csv"]


def _empty_image_folder(tmp, base):
    # Also in test_cli.test_user_errors_exit_2; kept here so the corpus is complete on its own.
    (tmp / "empty").mkdir()
    return ["index", "--model", str(base["model"]), "--images", str(tmp / "empty"), "--out", str(tmp / "idx")], \
        ["no images found", str(tmp / "empty")]


def _file_as_image_folder(tmp, base):
    return ["index", "--model", str(base["model"]), "--images", str(base["images"] / "img000.png"), "--out",
            str(tmp / "idx")], ["image folder is a file, not a folder", "img000.png"]


def _dir_as_query_image(tmp, base):
    return ["search", "--index", str(base["index"]), "--image", str(base["images"])], \
        ["query image is a directory", str(base["images"])]


def _corrupt_query_image(tmp, base):
    bad = tmp / "query.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 definitely not the rest of a JPEG")
    return ["search", "--index", str(base["index"]), "--image", str(bad)], [str(bad)]


def _dir_as_attention_image(tmp, base):
    return ["attention", "--model", str(base["model"]), str(base["images"]), "--out", str(tmp / "a.png")], \
        [str(base["images"])]


def _negative_k(tmp, base):
    # Also in test_cli.test_user_errors_exit_2 (argparse refuses it before any work).
    # -0 (NUL-separated paths) makes argparse read "-3" as an option: the error still names -k
    return ["search", "--index", str(base["index"]), "a red circle", "-k", "-3"], ["argument -k"]


def _zero_batch_size(tmp, base):
    return ["index", "--model", str(base["model"]), "--images", str(base["images"]), "--out", str(tmp / "idx"),
            "--batch-size", "0"], ["argument --batch-size", "must be >= 1"]


def _blank_query(tmp, base):
    return ["search", "--index", str(base["index"]), "   "], ["text query is empty"]


def _file_as_model_dir(tmp, base):
    return ["index", "--model", str(base["images"] / "img000.png"), "--images", str(base["images"]), "--out",
            str(tmp / "idx")], ["model directory is a file", "img000.png"]


def _model_dir_gone(tmp, base):
    from conftest import make_model_dir

    model = make_model_dir(tmp / "doomed", seed=0)
    index = tmp / "idx"
    assert main(["index", "--model", str(model), "--images", str(base["images"]), "--out", str(index),
                 "--quiet"]) == 0
    shutil.rmtree(model)
    return ["search", "--index", str(index), "a red circle"], [str(model), "is gone", "--model"]


def _file_as_index(tmp, base):
    return ["search", "--index", str(base["images"] / "img000.png"), "a red circle"], ["is a file, not an index directory", "img000.png"]


def _train_data_args(tmp: Path, base: dict, captions: str, *extra: str) -> list[str]:
    data = tmp / "data"
    shutil.copytree(base["images"], data / "images")
    (data / "captions.csv").write_text(captions)
    argv = ["train"]
    for item in (f"data.captions={data / 'captions.csv'}", f"train.out_dir={tmp / 'run'}", "data.val=2",
                 "train.max_steps=1", "train.batch_size=2", *extra):
        argv += ["--set", item]
    return argv


def _train_wrong_columns(tmp, base):
    return _train_data_args(tmp, base, "file,text\nimg000.png,a red circle\n"), \
        [str(tmp / "data" / "captions.csv"), "missing column(s)"]


def _train_out_dir_is_a_file(tmp, base):
    (tmp / "taken").write_text("not a folder")
    captions = "image,caption\n" + "".join(f"img{i:03d}.png,a thing number {i}\n" for i in range(6))
    return _train_data_args(tmp, base, captions, f"train.out_dir={tmp / 'taken'}"), [str(tmp / "taken")]


def _six_captions() -> str:
    return "image,caption\n" + "".join(f"img{i:03d}.png,a thing number {i}\n" for i in range(6))


def _train_fewer_than_one_batch(tmp, base):
    # 6 images, 2 held out for validation: 4 cannot fill a batch of 8 (this used to exit 1).
    return _train_data_args(tmp, base, _six_captions(), "train.batch_size=8"), \
        ["4 images", "fewer than one batch of 8", "train.batch_size"]


def _train_val_count_too_large(tmp, base):
    # data.val=300 is a count: it must read "300 images", never "300.0", and say what to change.
    return _train_data_args(tmp, base, _six_captions(), "data.val=300"), \
        ["val split of 300 images would take all 6 images", "smaller data.val", "at most 5"]


def _train_set_without_equals(tmp, base):
    return ["train", "--set", "train.lr"], ["train.lr", "key.sub=value"]


def _train_set_unknown_key(tmp, base):
    return ["train", "--set", "train.learning_rate=0.1"], ["unknown config key train.learning_rate"]


CSV_OK_HEADER = "image,caption\n"
CORPUS: dict[str, Case] = {
    # captions files (through `clip-mini index --data CONFIG`)
    "csv-wrong-columns": _captions_case("captions.csv", "file,text\nimg000.png,a red circle\n",
                                        ["missing column(s)", "'image'", "file"]),
    "csv-non-utf8": _captions_case("captions.csv", CSV_OK_HEADER.encode() + b"img000.png,a caf\xe9 sign\n",
                                   ["line 2", "not valid UTF-8"]),
    "csv-unquoted-comma": _captions_case("captions.csv", CSV_OK_HEADER + "img000.png,a red, round circle\n",
                                         ["row 1", "3 fields"]),
    "csv-unterminated-quote": _captions_case("captions.csv", CSV_OK_HEADER + 'img000.png,"a red circle\n',
                                             ["cannot parse"]),
    "csv-image-outside-root": _captions_case("captions.csv", CSV_OK_HEADER + "img000.png,ok\n../../etc/passwd,x\n",
                                             ["row 2", "outside the image root", "../../etc/passwd"]),
    "csv-absolute-image-outside-root": _captions_case("captions.csv", CSV_OK_HEADER + "/etc/hostname,a host\n",
                                                      ["row 1", "outside the image root"]),
    "csv-header-only": _captions_case("captions.csv", CSV_OK_HEADER, ["header only"]),
    "csv-only-empty-captions": _captions_case("captions.csv", CSV_OK_HEADER + "img000.png,\nimg001.png,  \n",
                                              ["no usable rows"]),
    "csv-images-missing": _captions_case("captions.csv", CSV_OK_HEADER + "nope1.png,a\nnope2.png,b\n",
                                         ["none of its 2 images is usable", "missing file"]),
    "csv-wrong-caption-col-setting": _captions_case("captions.csv", CSV_OK_HEADER + "img000.png,a red circle\n",
                                                    ["missing column(s)", "'text'"], caption_col="text"),
    "flickr8k-malformed-line": _captions_case("captions.txt", "img000.png#0\ta red circle\nimg001.png a blue one\n",
                                              ["line 2", "name.jpg#n"]),
    "coco-missing-annotations": _captions_case("captions.json", json.dumps(
        {"images": [{"id": 1, "file_name": "img000.png"}]}), ["'annotations'"]),
    "coco-unknown-image-id": _captions_case("captions.json", json.dumps(
        {"images": [{"id": 1, "file_name": "img000.png"}],
         "annotations": [{"image_id": 1, "caption": "a"}, {"image_id": 9, "caption": "b"}]}),
        ["annotations[1]", "image_id 9"]),
    "coco-not-json": _captions_case("captions.json", '{"images": [', ["line 1", "not valid JSON"]),
    "captions-path-is-a-directory": Case(lambda tmp, base: (
        ["index", "--model", str(base["model"]), "--data",
         str(_config(tmp, f"data:\n  captions: {base['images']}\n")), "--out", str(tmp / "idx")],
        ["captions file is a directory", str(base["images"])])),
    "train-captions-wrong-columns": Case(_train_wrong_columns),
    "train-out-dir-is-a-file": Case(_train_out_dir_is_a_file),
    "train-fewer-than-one-batch": Case(_train_fewer_than_one_batch),
    "train-val-count-too-large": Case(_train_val_count_too_large),
    # configs (through `clip-mini train --config`: refused before any data is read)
    "config-unknown-key": _train_config_case("train:\n  epocs: 3\n", ["unknown config key train.epocs"]),
    "config-wrong-type": _train_config_case("train:\n  epochs: three\n", ["train.epochs", "integer"]),
    "config-out-of-range": _train_config_case("train:\n  lr: -1\n", ["train.lr", "> 0"]),
    "config-bad-yaml": _train_config_case("model: [unclosed\n", ["not valid YAML"]),
    "config-non-utf8": _train_config_case(b"train:\n  out_dir: caf\xe9\n", ["not valid YAML"]),
    "config-top-level-list": _train_config_case("- model\n- data\n", ["top level must be a mapping"]),
    "config-section-not-mapping": _train_config_case("train: 5\n", ["train must be a mapping"]),
    # a bad --set value is blamed on --set, not on the config file it overrides
    "config-bad-override": _train_config_case("train:\n  epochs: 1\n", ["--set train.batch_size=lots", "integer"],
                                              extra=("--set", "train.batch_size=lots"), names_file=False),
    "set-without-equals": Case(_train_set_without_equals),
    "set-unknown-key": Case(_train_set_unknown_key),
    # CLI arguments
    "negative-k": Case(_negative_k),
    "zero-batch-size": Case(_zero_batch_size),
    "blank-text-query": Case(_blank_query),
    "empty-image-folder": Case(_empty_image_folder),
    "only-unreadable-images": Case(_only_bad_images),
    "file-as-image-folder": Case(_file_as_image_folder),
    "directory-as-query-image": Case(_dir_as_query_image),
    "corrupt-query-image": Case(_corrupt_query_image),
    "directory-as-attention-image": Case(_dir_as_attention_image),
    # model directories
    "model-missing-tokenizer": _model_case(_unlink("tokenizer.json"), ["missing tokenizer.json"]),
    "model-missing-tokenizer-text-search": _model_case(_unlink("tokenizer.json"), ["tokenizer.json"],
                                                       command="search"),
    "model-without-tokenizer-resealed": _model_case(_drop_tokenizer_and_reseal, ["tokenizer"], command="search"),
    "model-zero-byte-safetensors": _model_case(_write("model.safetensors", b""), ["model.safetensors", "corrupt"]),
    "model-zero-byte-safetensors-resealed": _model_case(_reseal(_write("model.safetensors", b"")),
                                                        ["model.safetensors", "cannot load weights"]),
    "model-manifest-not-json": _model_case(_write("manifest.json", b"{not json"), ["manifest.json", "JSON"]),
    "model-missing-config": _model_case(_unlink("config.json"), ["config.json"]),
    "model-path-is-a-file": Case(_file_as_model_dir),
    "model-dir-gone": Case(_model_dir_gone),
    # index directories
    "index-built-by-another-model": Case(_other_models_index),
    "index-into-another-models-index": Case(_index_into_other_models_index),
    "index-manifest-not-json": _index_case(_write("manifest.json", b"\x00\x01garbage"), ["manifest.json"]),
    "index-embeddings-missing": _index_case(lambda d: next(d.glob("embeddings-*.npy")).unlink(),
                                            ["embeddings-"]),
    "index-items-truncated": _index_case(lambda d: next(d.glob("items-*.cols")).write_text("path\n"),
                                         ["items-", "corrupt"]),
    "index-path-is-a-file": Case(_file_as_index),
}


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 20


# Known bugs in code this file does not own: strict, so the fix makes the test fail until the mark is removed.
KNOWN_BUGS: dict[str, str] = {}   # kind -> reason; such cases run as strict xfail until fixed


@pytest.mark.parametrize("case", [pytest.param(c, id=k, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[k])]
                                               if k in KNOWN_BUGS else []) for k, c in CORPUS.items()])
def test_bad_input_exits_2_and_names_it(case, base, tmp_path, capsys):
    argv, expect = case.make(tmp_path, base)
    rc, err = _run(argv, capsys)
    assert rc == 2, f"exit {rc}; stderr:\n{err}"
    assert "Traceback" not in err
    # Ours ("error: ...") or argparse's (usage, then "prog: error: argument ..."). Warnings about skipped files may
    # come first: Python prints each warning once per process, so whether they appear depends on earlier tests.
    lines = err.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("error: ") or "error: argument" in line), None)
    assert at is not None, err
    assert all("Warning: " in line or line.startswith(("usage: ", " ")) for line in lines[:at]), err
    for piece in expect:
        assert piece in err, f"{piece!r} not in stderr:\n{err}"
    assert ".0 images" not in err, err   # counts print as integers


# -- over-long input is truncated, not fatal ---------------------------------------------------------------------
def test_ten_thousand_word_caption_is_truncated(base, tmp_path, capsys):
    words = " ".join(["red", "circle", "blue", "square"] * 2500)   # 10,000 words
    rc, err = _run(["search", "--index", str(base["index"]), words, "-k", "2", "--json"], capsys)
    assert rc == 0, err
    import clip_mini

    emb = clip_mini.load(base["model"])
    feats = emb.encode_text([words, "red circle"])
    assert feats.shape == (2, emb.dim)
    assert emb.model.tokenize([words])["input_ids"].shape == (1, emb.model.cfg.text.max_length)
    # As a caption in a captions file: stored whole in the index, truncated only when embedded.
    argv, _ = _index_data(tmp_path, base, "captions.csv", CSV_OK_HEADER + f"img000.png,{words}\nimg001.png,a b\n")
    rc, err = _run(argv, capsys)
    assert rc == 0, err
    from clip_mini.retrieval.index import EmbeddingIndex

    captions = EmbeddingIndex.load(tmp_path / "idx").items["caption"]
    assert words in captions


# -- no network ----------------------------------------------------------------------------------------------
@pytest.fixture
def no_network(monkeypatch):
    """Every outgoing network connection (and name lookup) fails in this process; records the attempts. Local
    Unix sockets still connect: DataLoader workers hand their batches over them (configs/tiny.yaml uses one)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] or args)
        raise OSError(errno.ENETUNREACH, "network disabled by test")

    def local_only(original):
        def connect(sock, address, *args, **kwargs):
            if sock.family == socket.AF_UNIX:
                return original(sock, address, *args, **kwargs)
            return refuse(sock, address)
        return connect

    monkeypatch.setattr(socket.socket, "connect", local_only(socket.socket.connect))
    monkeypatch.setattr(socket.socket, "connect_ex", local_only(socket.socket.connect_ex))
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def test_train_index_search_without_network(no_network, tmp_path, capsys, monkeypatch):
    from clip_mini.data.synthetic import generate

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = generate(tmp_path / "shapes", n=100, seed=0, size=32)
    run = tmp_path / "run"
    tiny = tiny_sets() + ["train.batch_size=16", "train.max_steps=3",
            "train.epochs=1", "train.warmup_steps=1", "train.precision=fp32", "train.threads=1",
            "train.eval_batch_size=64", "data.val=10", f"data.captions={data / 'captions.csv'}",
            f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={run}"]
    argv = ["train", "--config", str(ROOT / "configs/tiny.yaml")]
    for item in tiny:
        argv += ["--set", item]
    rc, err = _run(argv, capsys)
    assert rc == 0, err
    model = run / "final"
    assert (model / "manifest.json").is_file()
    index = tmp_path / "index"
    rc, err = _run(["index", "--model", str(model), "--images", str(data / "images"), "--out", str(index),
                    "--quiet"], capsys)
    assert rc == 0, err
    capsys.readouterr()
    assert main(["search", "--index", str(index), "a red circle", "-k", "3", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 3
    assert no_network == [], f"connection attempts: {no_network}"


def test_no_network_fixture_blocks_connections(no_network):
    """The guard itself works (so the offline test above can fail)."""
    with pytest.raises(OSError):
        socket.create_connection(("example.com", 80), timeout=1)
    with pytest.raises(OSError):
        socket.socket().connect(("127.0.0.1", 9))
    assert len(no_network) == 2


# -- disk full -----------------------------------------------------------------------------------------------
@pytest.fixture
def disk_full(monkeypatch):
    """Make every fsync of a file fail with ENOSPC (what a full disk reports for delayed allocation), and every
    ``np.save`` too; atomic writes fsync each file before renaming it in, so each write fails."""
    import numpy as np

    real_fsync = os.fsync

    def fsync(fd):
        import stat

        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    def save(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    def arm():
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(np, "save", save)
    return arm


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_index_on_full_disk_keeps_previous_index(base, tmp_path, capsys, disk_full):
    from clip_mini.retrieval.index import EmbeddingIndex

    index = tmp_path / "index"
    shutil.copytree(base["index"], index)
    images = tmp_path / "images"
    shutil.copytree(base["images"], images)
    write_images(images, 3, seed=5, prefix="new")
    before = _snapshot(index)
    disk_full()
    rc, err = _run(["index", "--model", str(base["model"]), "--images", str(images), "--out", str(index),
                    "--quiet"], capsys)
    assert rc == 2, err
    assert "No space left on device" in err and str(index) in err and "Traceback" not in err
    after = _snapshot(index)
    assert {k: v for k, v in after.items() if k in before} == before   # nothing published was touched
    assert not any(k.endswith(".tmp") or ".tmp." in k for k in after), sorted(after)
    old = EmbeddingIndex.load(index, verify=True)
    assert len(old) == 6
    rc, err = _run(["search", "--index", str(index), "a red circle", "-k", "2"], capsys)
    assert rc == 0, err


def test_model_save_on_full_disk_keeps_previous_model(base, tmp_path, disk_full):
    from clip_mini.fileio.atomic import OutputError
    from clip_mini.model.clip import CLIPModel

    target = tmp_path / "model"
    shutil.copytree(base["model"], target)
    before = _snapshot(target)
    model = CLIPModel.from_pretrained(target)
    disk_full()
    with pytest.raises(OutputError, match="No space left on device") as e:
        model.save_pretrained(target)
    assert str(target) in str(e.value)
    assert _snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]   # no temporary directory left behind
    assert CLIPModel.from_pretrained(target).fingerprint == model.fingerprint
