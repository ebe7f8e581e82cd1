"""WebDataset shards: convert the generated shapes data to shards, index and train from them, compare with the folder.

"Same results" means: (index) the shard index holds exactly the folder index's images, each with a bit-identical
float16 embedding and its first caption, and each image read back from its shard by offset is the file's bytes;
(training) with the same seed the untrained model's validation numbers are identical (the val shard holds the
folder run's val split, the tokenizer is trained on the same captions), and a paused and resumed shard run ends
with bit-identical weights to an uninterrupted one. Trained weights of shard and folder runs differ: the stream
visits samples in another order than the folder sampler.
"""
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from clip_mini.cli.main import main
from clip_mini.config import load_config
from clip_mini.data.convert import convert_to_webdataset
from clip_mini.data.dataset import load_splits
from clip_mini.data.webdataset import SkipLog, iter_shard
from clip_mini.data.wds_stream import plan_streams, stream_shards
from clip_mini.retrieval.build import sync_index
from clip_mini.retrieval.reader import IndexReader
from clip_mini.retrieval.wds_source import read_image

from test_train_loop import TINY


@pytest.fixture(scope="module")
def shapes_wds(tmp_path_factory):
    """Shapes data (150 images), its folder splits, and shards: train split in 4 shards, val split in one."""
    from clip_mini.data import generate

    root = tmp_path_factory.mktemp("wds")
    shapes = generate(root / "shapes", n=150, seed=0, size=32)
    base = TINY + [f"data.captions={shapes / 'captions.csv'}", f"data.cache_dir={root / 'cache'}", "data.val=30"]
    splits = load_splits(load_config(None, base), progress=False)
    train = convert_to_webdataset(splits["train"], root / "train", shard_size=30, progress=False)
    val = convert_to_webdataset(splits["val"], root / "val", shard_size=100, seed=None, progress=False)
    assert (train["shards"], train["samples"], val["samples"]) == (4, 120, 30)
    return dict(root=root, base=base, splits=splits, train=train["pattern"], val=val["pattern"])


def test_index_from_shards_equals_the_folder_index(shapes_wds, model_dir, tmp_path):
    # fp32 on both sides, so the rows can be compared bit for bit (the CLI's default is bf16 on a CPU with native
    # bf16; tests/test_speed_paths.py bounds that against fp32)
    assert main(["index", "--model", str(model_dir), "--shards", shapes_wds["train"], "--out",
                 str(tmp_path / "wds"), "--precision", "fp32", "--quiet"]) == 0
    import clip_mini

    df = shapes_wds["splits"]["train"]
    sync_index(tmp_path / "dir", clip_mini.load(model_dir), df["path"].unique().tolist(), progress=False)
    a, b = IndexReader.load(tmp_path / "wds"), IndexReader.load(tmp_path / "dir")
    assert len(a) == len(b) == 120
    row_of = {p: i for i, p in enumerate(b.items["path"])}
    first_caption = df.groupby("path", sort=False)["caption"].first()
    root = Path(df["path"].iloc[0]).parent
    for r in range(len(a)):
        assert a.items["path"][r] == f"{a.items['shard'][r]}#{a.items['key'][r]}"
        blob = read_image(a.items, r)   # by offset, from the tar
        name = next(p for p in row_of if Path(p).read_bytes() == blob)   # the file with these bytes
        assert np.array_equal(a.embeddings[r], b.embeddings[row_of[name]])
        assert a.items["caption"][r] == first_caption[name] and str(root) in name


def test_reindexing_keeps_unchanged_shards_and_embeds_only_new_ones(shapes_wds, model_dir, tmp_path, monkeypatch):
    from clip_mini.retrieval import wds_source

    shards = shapes_wds["train"].replace("{000000..000003}", "{000000..000001}")
    assert main(["index", "--model", str(model_dir), "--shards", shards, "--out", str(tmp_path), "--quiet"]) == 0
    first = IndexReader.load(tmp_path)
    seen = []
    real = wds_source.embed_local
    monkeypatch.setattr(wds_source, "embed_local", lambda e, todo, *a: (seen.extend(todo), real(e, todo, *a)))
    assert main(["index", "--model", str(model_dir), "--shards", shapes_wds["train"], "--out", str(tmp_path),
                 "--quiet"]) == 0
    second = IndexReader.load(tmp_path)
    assert [Path(s).name for s in seen] == ["000002.tar", "000003.tar"] and len(second) == 120
    old = {p: i for i, p in enumerate(second.items["path"])}
    for r, p in enumerate(first.items["path"]):
        assert np.array_equal(first.embeddings[r], second.embeddings[old[p]])


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_bad_samples_are_skipped_and_reported_with_shard_and_key(model_dir, tmp_path):
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        for key, files in [("good1", {"png": _png(1), "txt": b"a red circle"}), ("nocap", {"png": _png(2)}),
                           ("noimg", {"txt": b"a caption"}), ("undecodable", {"jpg": b"not a jpeg", "txt": b"x"}),
                           ("empty", {"png": _png(3), "txt": b"  "}), ("good2", {"png": _png(4), "txt": b"a star"})]:
            for ext, data in files.items():
                _member(tar, f"{key}.{ext}", data)
    with tarfile.open(tmp_path / "b.tar", "w") as tar:   # truncated below: 2 samples before the damage
        for i in range(4):
            _member(tar, f"s{i}.png", _png(10 + i))
            _member(tar, f"s{i}.txt", f"caption {i}".encode())
    data = (tmp_path / "b.tar").read_bytes()
    cut = data.index(b"s2.png") + 512 + 10   # inside sample s2's image data
    (tmp_path / "b.tar").write_bytes(data[:cut])

    log = SkipLog(show=0)
    assert [s.key for s in iter_shard(str(tmp_path / "b.tar"), log)] == ["s0", "s1"]
    assert log.rows[0][1] == "s2" and "truncated" in log.rows[0][2]

    out = tmp_path / "ix"
    assert main(["index", "--model", str(model_dir), "--shards", str(tmp_path / "{a,b}.tar"), "--out", str(out),
                 "--quiet"]) == 0
    ix = IndexReader.load(out)
    assert ix.items["key"] == ["good1", "good2", "s0", "s1"]
    skipped = (out / "skipped.csv").read_text()
    for key, why in [("a.tar#nocap", "missing caption"), ("a.tar#noimg", "missing image"),
                     ("a.tar#undecodable", "not an image"), ("a.tar#empty", "empty caption"),
                     ("b.tar#s2", "truncated")]:
        line = next(ln for ln in skipped.splitlines() if key in ln)
        assert why in line, line


def test_streams_read_disjoint_shards_and_cover_them_all():
    shards = [f"s{i}" for i in range(12)]
    for epoch in (0, 1):
        got = [stream_shards(shards, 0, epoch, r, 2, w, 3) for r in range(2) for w in range(3)]
        flat = [s for g in got for s in g]
        assert sorted(flat) == sorted(shards) and all(len(g) == 2 for g in got)
    assert stream_shards(shards, 0, 0, 0, 2, 0, 3) != stream_shards(shards, 0, 1, 0, 2, 0, 3)
    # micro-batch m comes from stream m % W: resuming at micro-batch 5 of 11, streams 0, 1, 2 have done 2, 2, 1
    # batches of 4 samples (m = 0..4) and owe 2 each (m = 5..10)
    assert plan_streams(11, 5, 3, 4) == [(2, 8), (2, 8), (2, 4)]
    assert sum(n for n, _ in plan_streams(11, 0, 3, 4)) == 11


def test_webdataset_config_errors_name_the_fix(shapes_wds):
    from clip_mini.data.readers import DataError
    from clip_mini.train.inputs import load_splits as train_splits

    cfg = load_config(None, shapes_wds["base"] + ["data.format=webdataset", f"data.shards={shapes_wds['train']}"])
    with pytest.raises(DataError, match="data.samples"):
        train_splits(cfg)
    cfg = load_config(None, shapes_wds["base"] + ["data.format=webdataset", "data.samples=10",
                                                  f"data.shards={shapes_wds['root']}/nope/{{0..3}}.tar"])
    with pytest.raises(DataError, match="do not exist"):
        train_splits(cfg)


def _wds_cfg(shapes_wds, out, *extra):
    return load_config(None, shapes_wds["base"] + [
        "data.format=webdataset", f"data.shards={shapes_wds['train']}", f"data.val_shards={shapes_wds['val']}",
        "data.samples=120", "train.batch_size=8", f"train.out_dir={out}", *extra])


def _rows(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_training_from_shards_matches_the_folder_at_step_0_and_resumes_exactly(shapes_wds, tmp_path):
    from safetensors.torch import load_file

    from clip_mini.train import train

    extra = ["train.epochs=2", "data.workers=2", "train.checkpoint_every=4"]
    ref = train(_wds_cfg(shapes_wds, tmp_path / "ref", *extra))
    assert ref["step"] == 30   # 120 samples / 8 per step, two epochs
    folder = train(load_config(None, shapes_wds["base"] + ["train.batch_size=8", "train.epochs=1",
                                                          f"train.out_dir={tmp_path / 'folder'}"]))
    assert folder["step"] == 15
    v_wds, v_dir = _rows(tmp_path / "ref")[0], _rows(tmp_path / "folder")[0]
    assert v_wds["kind"] == v_dir["kind"] == "epoch" and v_wds["epoch"] == 0
    assert {k: v for k, v in v_wds.items() if k.startswith("val_")} == \
        {k: v for k, v in v_dir.items() if k.startswith("val_")}
    # pause mid-epoch (step 7: off the stream round-robin), resume, finish: the same weights bit for bit
    run = tmp_path / "paused"
    assert train(_wds_cfg(shapes_wds, run, *extra), stop_after=7)["stopped"]
    train(_wds_cfg(shapes_wds, run, *extra), resume="auto")
    a, b = load_file(str(tmp_path / "ref/final/model.safetensors")), load_file(str(run / "final/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = [r["loss"] for r in _rows(tmp_path / "ref") if r["kind"] == "step"]
    assert first[-1] < first[0]   # it learns from the stream


def test_convert_command_writes_shards_and_bad_input_exits_2(shapes_wds, tmp_path, capsys):
    shapes = shapes_wds["root"] / "shapes"
    assert main(["convert", "--to-webdataset", "--captions", str(shapes / "captions.csv"), "--out",
                 str(tmp_path / "all"), "--shard-size", "64", "--quiet"]) == 0
    stats = json.loads((tmp_path / "all/stats.json").read_text())
    assert (stats["samples"], stats["shards"]) == (150, 3) and "wrote 150 samples" in capsys.readouterr().out
    keys = [s.key for s in iter_shard(str(tmp_path / "all/000000.tar"), SkipLog(show=0))]
    assert keys == [f"{i:09d}" for i in range(64)]
    assert main(["convert", "--to-webdataset", "--captions", str(tmp_path / "nope.csv"), "--out",
                 str(tmp_path / "x"), "--quiet"]) == 2
    assert main(["convert", "--to-webdataset", "--captions", str(shapes / "captions.csv"), "--split", "val",
                 "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert "--split needs --data" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_ray_flag_without_ray_says_how_to_install(shapes_wds, model_dir, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)   # as if Ray were not installed: `import ray` raises
    assert main(["index", "--model", str(model_dir), "--shards", shapes_wds["train"], "--out", str(tmp_path / "ix"),
                 "--ray", "--quiet"]) == 2
    assert "pip install 'clip-mini[ray]'" in capsys.readouterr().err and not (tmp_path / "ix/manifest.json").exists()


def test_serve_shows_shard_rows_read_back_by_offset(shapes_wds, model_dir, tmp_path):
    pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (test extra)")
    from fastapi.testclient import TestClient

    from clip_mini.serve.app import ServeConfig, create_app

    assert main(["index", "--model", str(model_dir), "--shards", shapes_wds["train"], "--out", str(tmp_path / "ix"),
                 "--quiet"]) == 0
    ix = IndexReader.load(tmp_path / "ix")
    with TestClient(create_app(ServeConfig(index=str(tmp_path / "ix"), allowed_hosts=["testserver"]))) as client:
        got = client.get("/image/5")
        assert got.status_code == 200 and got.content == read_image(ix.items, 5)   # the tar member's bytes
        thumb = client.get("/thumb/5")
        assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"


def test_shard_paths_are_relative_so_moved_shards_are_read_back(shapes_wds, model_dir, tmp_path):
    """Shards and their index moved together: rows still name the shard files, at their new place, and read back
    by offset; the items file holds no absolute shard path."""
    import shutil

    src = tmp_path / "a"
    shutil.copytree(Path(shapes_wds["train"]).parent, src / "train")
    pattern = str(src / "train" / Path(shapes_wds["train"]).name)
    assert main(["index", "--model", str(model_dir), "--shards", pattern, "--out", str(src / "ix"), "--quiet"]) == 0
    before = IndexReader.load(src / "ix")
    blobs = [read_image(before.items, r) for r in (0, 57, 119)]
    raw = next((src / "ix").glob("items-*.cols")).read_bytes()
    assert str(src).encode() not in raw   # neither the paths nor the shard column is stored absolute
    shutil.move(src, tmp_path / "b")
    moved = IndexReader.load(tmp_path / "b" / "ix")
    assert all(s.startswith(str(tmp_path / "b" / "train")) for s in moved.items["shard"])
    assert moved.items["path"][0] == f"{moved.items['shard'][0]}#{moved.items['key'][0]}"
    assert [read_image(moved.items, r) for r in (0, 57, 119)] == blobs


def test_eval_reads_a_webdataset_config(shapes_wds, model_dir, tmp_path, capsys):
    """`clip-mini eval --data` on a WebDataset config scores its validation shards: the same images and captions
    as the folder config's val split, so the same numbers; another split is refused naming the fix."""
    import yaml

    shapes = shapes_wds["root"] / "shapes"
    common = {"captions": str(shapes / "captions.csv"), "cache_dir": str(shapes_wds["root"] / "cache"), "val": 30}
    (tmp_path / "folder.yaml").write_text(yaml.safe_dump({"data": common}))
    (tmp_path / "wds.yaml").write_text(yaml.safe_dump({"data": {
        **common, "format": "webdataset", "shards": shapes_wds["train"], "val_shards": shapes_wds["val"],
        "samples": 120}}))
    scores = {}
    for name in ("folder", "wds"):
        args = ["eval", "--model", str(model_dir), "--data", str(tmp_path / f"{name}.yaml"), "--json",
                "--precision", "fp32"] + (["--split", "val"] if name == "folder" else [])
        assert main(args) == 0
        out = capsys.readouterr()
        scores[name] = json.loads(out.out)
        if name == "wds":
            assert "scoring the val split" in out.err
    a, b = scores["wds"], scores["folder"]
    assert a["split"] == "val" and a["n_images"] == b["n_images"] == 30 and a["n_captions"] == b["n_captions"]
    for k in ("t2i_r1", "t2i_r10", "i2t_r1", "i2t_r10", "t2i_medr", "i2t_medr", "rsum"):
        assert a[k] == pytest.approx(b[k], abs=1e-6), k
    assert main(["eval", "--model", str(model_dir), "--data", str(tmp_path / "wds.yaml"), "--split", "test"]) == 2
    assert "its one scored split is val" in capsys.readouterr().err
