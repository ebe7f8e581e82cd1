"""What users of open_clip / sentence-transformers expect of the command line and the index API: --version, help
with examples and defaults, --print-config, config-key suggestions, the default eval split, --quiet and log-friendly
progress, index --captions, portable (relative) item paths, --device, normalised queries, rounded output."""
import json
import shutil
import sys
import time

import numpy as np
import pytest
import yaml

import clip_mini
from clip_mini import EmbeddingIndex
from clip_mini.cli.main import main


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_version_and_help_with_examples_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"clip-mini {clip_mini.__version__}"
    for command, default in (("index", "(default: 64)"), ("search", "(default: 10)"), ("eval", "(default: auto)"),
                             ("attention", "(default: 448)")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "examples:\n  clip-mini " + command in text, text
        assert default in " ".join(text.split()), (command, text)
        assert "--device" in text and "--quiet" in text


def test_train_print_config_and_key_suggestions(tmp_path, capsys):
    code, out, _ = _run(["train", "--print-config", "--set", "train.epochs=7", "--set", "data.val=0.2"], capsys)
    cfg = yaml.safe_load(out)
    assert code == 0 and set(cfg) == {"model", "data", "train"}
    assert cfg["train"]["epochs"] == 7 and cfg["data"]["val"] == 0.2 and "lr" in cfg["train"]
    code, _, err = _run(["train", "--print-config", "--set", "train.epohcs=3"], capsys)
    assert code == 2 and "--set train.epohcs=3" in err and "did you mean train.epochs?" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  captoins: x.csv\n")
    code, _, err = _run(["train", "--config", str(bad), "--print-config"], capsys)
    assert code == 2 and str(bad) in err and "unknown config key data.captoins; did you mean data.captions?" in err


def test_eval_defaults_to_val_and_says_so(model_dir, shapes_dir, tmp_path, ledger_path, capsys):
    cfg = tmp_path / "shapes.yaml"
    for test in (0, 20):   # a config with a test split too: test is scored only when named
        cfg.write_text(yaml.safe_dump({"data": {"captions": str(shapes_dir / "captions.csv"), "val": 20,
                                                "test": test, "cache": False}}))
        code, out, err = _run(["eval", "--model", str(model_dir), "--data", str(cfg), "--json"], capsys)
        assert code == 0, err
        assert json.loads(out)["split"] == "val" and "no --split given: scoring the val split" in err
    assert not ledger_path.exists()
    code, out, err = _run(["eval", "--model", str(model_dir), "--data", str(cfg), "--json", "--quiet", "--split",
                           "test"], capsys)
    assert code == 0 and json.loads(out)["split"] == "test" and err == ""
    assert [line["status"] for line in _ledger_lines(ledger_path)] == ["done"]


def _ledger_lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_quiet_index_writes_no_progress_and_captions_file_is_indexed(model_dir, shapes_dir, tmp_path, capsys):
    out_dir = tmp_path / "idx"
    code, out, err = _run(["index", "--model", str(model_dir), "--captions", str(shapes_dir / "captions.csv"),
                           "--out", str(out_dir), "--quiet"], capsys)
    assert code == 0 and err == "" and "3000 images" in out
    index = EmbeddingIndex.load(out_dir)
    row = index.items["path"].index(str(shapes_dir / "images" / "train_00000.png"))
    assert len(index.items["caption"][row]) > 5   # its captions came along


def test_bars_become_periodic_lines_off_a_terminal(capsys):
    from tqdm import tqdm

    from clip_mini.cli.progress import console

    with console(quiet=False, interval=3600):   # capsys' stderr is not a terminal
        for _ in tqdm(range(500), desc="work", mininterval=0):
            pass
        print("an info line", file=sys.stderr)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[-1] == "an info line" and "500/500" in lines[-2]
    assert len(lines) <= 3   # the first draw, the final state, the info line: not 500 redraws
    with console(quiet=True):
        for _ in tqdm(range(50), desc="work", mininterval=0):
            pass
        time.sleep(0)
    assert capsys.readouterr().err == ""


def test_moved_folder_and_index_keep_working(model_dir, tmp_path, capsys):
    from conftest import write_images

    home = tmp_path / "a"
    write_images(home / "photos", 5)
    assert main(["index", "--model", str(model_dir), "--images", str(home / "photos"),
                 "--out", str(home / "photos-index"), "--quiet"]) == 0
    items = (home / "photos-index" / "items-1.cols").read_bytes()
    assert str(home).encode() not in items and b"img000.png" in items   # relative; the folder once in the manifest
    shutil.move(home, tmp_path / "b")
    capsys.readouterr()
    code, out, err = _run(["search", "--index", str(tmp_path / "b" / "photos-index"), "a red circle", "--json"],
                          capsys)
    assert code == 0, err
    paths = [r["path"] for r in json.loads(out)["results"]]
    assert paths and all(p.startswith(str(tmp_path / "b" / "photos")) for p in paths)
    # an update of the moved folder re-embeds nothing: the rows are recognised at their new place
    index = EmbeddingIndex.load(tmp_path / "b" / "photos-index")
    again = EmbeddingIndex.build(tmp_path / "b" / "photos-index", model_dir, tmp_path / "b" / "photos")
    assert again.manifest["generation"] == index.manifest["generation"]


def test_format_version_1_indexes_are_still_read(model_dir, tmp_path):
    from conftest import write_images

    from clip_mini.fileio.atomic import atomic_write_json, atomic_write_text, sha256_file
    from clip_mini.retrieval import format as F

    write_images(tmp_path / "photos", 3)
    index = EmbeddingIndex.build(tmp_path / "idx", model_dir, tmp_path / "photos")
    assert index.manifest["format_version"] == 4 and index.manifest["files"]["items"] == "items-1.cols"
    want = {c: list(index.items[c]) for c in F.ITEM_COLUMNS}
    # version 2 (and 3): an items CSV with paths relative to the manifest's root
    m = dict(index.manifest)
    rel, _ = F.relative_items(want, tmp_path / "idx")
    atomic_write_text(tmp_path / "idx" / "items-1.csv", F.items_csv(rel))
    m["files"] = {**m["files"], "items": "items-1.csv"}
    m.update(format_version=2, checksums={n: sha256_file(tmp_path / "idx" / n) for n in m["files"].values()})
    m["manifest_sha256"] = F._manifest_digest(m)
    atomic_write_json(tmp_path / "idx" / "manifest.json", m)
    old = EmbeddingIndex.load(tmp_path / "idx")
    assert {c: list(old.items[c]) for c in F.ITEM_COLUMNS} == want
    assert old.search_text("a red circle", k=2) == index.search_text("a red circle", k=2)
    # version 1: absolute paths, no root
    atomic_write_text(tmp_path / "idx" / "items-1.csv", F.items_csv(want))
    m.update(format_version=1, checksums={n: sha256_file(tmp_path / "idx" / n) for n in m["files"].values()})
    m.pop("root")
    m["manifest_sha256"] = F._manifest_digest(m)
    atomic_write_json(tmp_path / "idx" / "manifest.json", m)
    old = EmbeddingIndex.load(tmp_path / "idx")
    assert old.items["path"] == index.items["path"]
    m["format_version"] = 5
    m["manifest_sha256"] = F._manifest_digest(m)
    atomic_write_json(tmp_path / "idx" / "manifest.json", m)
    with pytest.raises(clip_mini.EmbeddingIndexError,
                       match="format version 5, this clip_mini reads versions 1, 2, 3, 4"):
        EmbeddingIndex.load(tmp_path / "idx")


def test_build_with_a_loaded_model_records_it_and_searches_lists(model_dir, image_folder, tmp_path):
    embedder = clip_mini.load(model_dir, device="cpu")
    index = EmbeddingIndex.build(tmp_path / "idx", embedder, image_folder)
    assert index.manifest["model_dir"] == str(model_dir.resolve())
    reopened = EmbeddingIndex.load(tmp_path / "idx")
    one = reopened.search_text("a red circle", k=3)
    both = reopened.search_text(["a red circle", "a blue square"], k=3)
    assert len(both) == 2 and len(one) == 3 and [h[0] for h in both[0]] == [h[0] for h in one]
    np.testing.assert_allclose([h[1] for h in both[0]], [h[1] for h in one], atol=1e-5)
    assert reopened.engine() is reopened.engine()   # the encoder is loaded once per index
    images = reopened.search_image([str(p) for p in sorted(image_folder.glob("*.png"))[:2]], k=1)
    assert [hits[0][0] for hits in images] == [str(p) for p in sorted(image_folder.glob("*.png"))[:2]]


def test_search_normalises_queries(model_dir, image_folder, tmp_path):
    index = EmbeddingIndex.build(tmp_path / "idx", model_dir, image_folder)
    q = np.random.default_rng(0).normal(size=(2, index.dim)).astype(np.float32) * 7
    scores, ids = index.search(q, k=4)
    unit_scores, unit_ids = index.search(q / np.linalg.norm(q, axis=1, keepdims=True), k=4)
    assert scores.max() <= 1.0 + 1e-3
    np.testing.assert_allclose(scores, unit_scores, atol=1e-6)
    np.testing.assert_array_equal(ids, unit_ids)
    with pytest.raises(clip_mini.EmbeddingIndexError, match="query row 1 is all zeros"):
        index.search(np.stack([q[0], np.zeros(index.dim, np.float32)]), k=2)


def test_second_writer_is_refused(tmp_path):
    from clip_mini.retrieval.format import writer_lock

    with writer_lock(tmp_path / "idx"):
        with pytest.raises(clip_mini.EmbeddingIndexError, match="being written by another process"):
            with writer_lock(tmp_path / "idx"):
                pass
    with writer_lock(tmp_path / "idx"):   # released
        pass


def test_device_errors_and_attention_refuses_non_vit_before_loading(model_dir, tmp_path, capsys):
    import torch

    if not torch.cuda.is_available():
        code, _, err = _run(["attention", "--model", str(model_dir), "x.png", "--out", str(tmp_path / "a.png"),
                             "--device", "cuda"], capsys)
        assert code == 2 and "CUDA is not available" in err
    code, _, err = _run(["eval", "--model", str(model_dir), "--data", "x.yaml", "--device", "tpu"], capsys)
    assert code == 2 and "unknown device 'tpu'" in err
    fake = tmp_path / "effnet"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"model": {"vision": {"backbone": "efficientnet_lite0"}}}))
    code, _, err = _run(["attention", "--model", str(fake), "missing.png", "--out", str(tmp_path / "a.png")], capsys)
    assert code == 2 and "need a ViT image tower" in err and "efficientnet_lite0" in err


def test_json_numbers_are_rounded(capsys):
    from clip_mini.cli.printing import print_json

    print_json({"score": 0.002222222276031971, "rows": [1.0000000001, 3, 0.1], "n": 5, "nan": float("nan")})
    out = json.loads(capsys.readouterr().out)
    assert out == {"score": 0.0022222223, "rows": [1.0, 3, 0.1], "n": 5, "nan": out["nan"]}
    # lossless for float32 values (what scores and metrics are): each reads back as the same float32
    values = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    from clip_mini.cli.printing import short_float

    assert all(np.float32(short_float(float(v))) == v for v in values)
