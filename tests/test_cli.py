"""`clip-mini index / search / eval / attention` end to end, and their error handling."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clip_mini.cli.main import main
from clip_mini.pictures.draw import grid_size

ROOT = Path(__file__).resolve().parents[1]


def _labels(shapes_dir: Path) -> dict[str, set]:
    out = {}
    for r in csv.DictReader(open(shapes_dir / "labels.csv")):
        out[r["image"]] = {(r["colour"], r["shape"]), (r["colour2"], r["shape2"])}
    return out


def _png_size(path) -> tuple[int, int]:
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.load()
        return im.size


@pytest.fixture(scope="module")
def shapes_index(trained_model_dir, heldout_images, tmp_path_factory) -> Path:
    # Only images the trained fixture never saw: search quality here is generalisation, not memorisation.
    out = tmp_path_factory.mktemp("indexes") / "shapes"
    assert main(["index", "--model", str(trained_model_dir), "--images", str(heldout_images),
                 "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def small_index(model_dir, tmp_path_factory) -> Path:
    from conftest import write_images

    folder = tmp_path_factory.mktemp("photos")
    write_images(folder, 6)
    out = folder.parent / (folder.name + "-index")
    assert main(["index", "--model", str(model_dir), "--images", str(folder), "--out", str(out), "--quiet"]) == 0
    return out


def _search(index, query, k, capsys) -> list[dict]:
    assert main(["search", "--index", str(index), query, "-k", str(k), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["results"]


@pytest.mark.slow
def test_search_puts_red_circles_on_top(shapes_index, shapes_dir, capsys):
    from clip_mini.data.synthetic import COLOURS, HELD_OUT, SHAPES

    labels = _labels(shapes_dir)
    # Every generated caption names size and place too, so the query does (any red circle counts as a hit).
    results = _search(shapes_index, "a large red circle in the center", 10, capsys)
    hits = [("red", "circle") in labels[Path(r["path"]).name] for r in results]
    # About 4% of the images hold a red circle. Circles and squares of one colour are the pair a 25-second
    # model still confuses at 32 px (on these held-out images its top two can be red squares: seen after the
    # training step's attention kernel changed), so the bar is a hit in the top 3 plus 4 of 10, ten times chance.
    assert any(hits[:3]) and sum(hits) >= 4, hits
    assert [r["rank"] for r in results] == list(range(1, 11))
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    # Over every colour and shape seen in training, precision@10 averages well above chance (~0.04).
    precision = []
    for colour in COLOURS:
        for shape in SHAPES:
            if (colour, shape) not in HELD_OUT:
                res = _search(shapes_index, f"a large {colour} {shape} in the center", 10, capsys)
                precision.append(np.mean([(colour, shape) in labels[Path(r["path"]).name] for r in res]))
    assert np.mean(precision) >= 0.4, precision


@pytest.mark.slow
def test_search_table_grid_and_image_query(shapes_index, heldout_images, tmp_path, capsys):
    grid = tmp_path / "hits.png"
    assert main(["search", "--index", str(shapes_index), "a yellow triangle", "-k", "7", "--grid", str(grid)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["rank", "score", "path"] and len(lines) == 1 + 7 + 1
    assert _png_size(grid) == grid_size(7)
    query = str(sorted(heldout_images.iterdir())[10])
    assert main(["search", "--index", str(shapes_index), "--image", query, "-k", "3", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["results"][0]
    assert best["path"] == query and best["score"] == pytest.approx(1.0, abs=2e-3)


@pytest.mark.slow
def test_eval_retrieval_and_zero_shot(trained_model_dir, shapes_dir, tmp_path, capsys):
    config = tmp_path / "shapes.yaml"
    config.write_text(f"data:\n  captions: {shapes_dir / 'captions.csv'}\n  val: 0.1\n  test: 0.1\n  cache: false\n")
    assert main(["eval", "--model", str(trained_model_dir), "--data", str(config), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["split"] == "val" and m["n_images"] == 300 and m["n_captions"] == 900   # val unless test is named
    assert all(0 <= m[k] <= 1 for k in ("t2i_r1", "t2i_r5", "i2t_r10"))
    assert m["t2i_r10"] > 0.2   # chance is 10/300
    # Zero-shot colour with a prompt ensemble over shapes (the label is the first object's colour).
    templates = [a for s in ("circle", "square", "triangle", "star") for a in ("--template", f"a {{}} {s}")]
    assert main(["eval", "--model", str(trained_model_dir), "--labels", str(shapes_dir / "labels.csv"),
                 "--label-col", "colour", *templates, "--json"]) == 0
    z = json.loads(capsys.readouterr().out)
    assert z["n_classes"] == 6 and z["n_images"] == 3300 and z["top1"] > 0.5   # chance is 1/6
    assert main(["eval", "--model", str(trained_model_dir), "--data", str(config), "--split", "test"]) == 0
    out = capsys.readouterr().out
    assert "t2i_r1" in out and "split=test" in out


@pytest.mark.parametrize("mode", ["mean", "rollout"])
def test_attention_png(model_dir, tmp_path, mode, capsys):
    img = tmp_path / "photo.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(img)
    out = tmp_path / "attn.png"
    assert main(["attention", "--model", str(model_dir), str(img), "--out", str(out), "--mode", mode,
                 "--size", "200"]) == 0
    assert _png_size(out) == (200, 120)


def test_user_errors_exit_2(small_index, model_dir, other_model_dir, tmp_path, capsys):
    def run(*argv):
        rc = main(list(argv))
        return rc, capsys.readouterr().err

    rc, err = run("search", "--index", str(tmp_path / "missing"), "a dog")
    assert rc == 2 and err.startswith("error: index") and "does not exist" in err
    rc, err = run("search", "--index", str(small_index), "a dog", "--model", str(other_model_dir))
    assert rc == 2 and "built with model" in err
    (tmp_path / "empty").mkdir()
    rc, err = run("index", "--model", str(model_dir), "--images", str(tmp_path / "empty"), "--out",
                  str(tmp_path / "idx"))
    assert rc == 2 and "no images found" in err
    rc, err = run("search", "--index", str(small_index))
    assert rc == 2 and "needs a text query or --image" in err
    rc, err = run("attention", "--model", str(model_dir), str(tmp_path / "nope.jpg"), "--out", str(tmp_path / "a.png"))
    assert rc == 2 and "missing file" in err
    rc, err = run("train", "--config", str(tmp_path / "nope.yaml"))
    assert rc == 2 and "config file not found" in err
    for k in ("0", "-2", "x"):
        with pytest.raises(SystemExit) as e:
            main(["search", "--index", str(small_index), "a dog", "-k", k])
        assert e.value.code == 2
        assert "argument -k" in capsys.readouterr().err


def test_corrupt_index_exit_2(small_index, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(small_index, broken)
    emb = next(broken.glob("embeddings-*.npy"))
    data = bytearray(emb.read_bytes())
    data[-1] ^= 0x55
    emb.write_bytes(bytes(data))
    assert main(["search", "--index", str(broken), "a dog"]) == 2
    assert "is corrupt" in capsys.readouterr().err


def test_text_search_does_not_import_torch_and_infer_wrapper(small_index):
    code = ("import sys; from clip_mini.cli.main import main; rc = main(['search', '--index', sys.argv[1], 'a dog', "
            "'-k', '2', '--json']); print('torch' in sys.modules, file=sys.stderr); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(small_index)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().endswith("False")
    assert len(json.loads(r.stdout)["results"]) == 2
    r = subprocess.run([sys.executable, "infer.py", "search", "--index", str(small_index), "a dog", "-k", "1"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stderr
    r = subprocess.run([sys.executable, "infer.py", "train"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "unknown command 'train' (commands: index, search, eval, attention)" in r.stderr
    r = subprocess.run([sys.executable, "-m", "clip_mini", "train", "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("usage: clip-mini train"), r.stdout + r.stderr


def test_index_from_data_config_stores_captions(model_dir, tmp_path, capsys):
    from conftest import write_images

    write_images(tmp_path / "data" / "images", 3)
    (tmp_path / "data" / "captions.csv").write_text(
        "image,caption\nimg000.png,a red thing\nimg000.png,\"a thing, red\"\nimg001.png,a blue thing\n"
        "img002.png,a green thing\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  captions: {tmp_path / 'data' / 'captions.csv'}\n")
    out = tmp_path / "idx"
    assert main(["index", "--model", str(model_dir), "--data", str(config), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["search", "--index", str(out), "thing", "-k", "3", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    captions = {Path(r["path"]).name: r["caption"] for r in results}
    assert captions["img000.png"] == "a red thing | a thing, red"
    assert captions["img001.png"] == "a blue thing"


@pytest.mark.slow
def test_torchrun_shards_then_merge(model_dir, image_folder, tmp_path):
    out = tmp_path / "idx"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533", "-m",
           "clip_mini.cli.main", "index", "--model", str(model_dir), "--images", str(image_folder), "--out", str(out),
           "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    from clip_mini.retrieval.index import EmbeddingIndex

    merged = EmbeddingIndex.load(out)
    assert len(merged) == 12 and merged.items["path"] == sorted(merged.items["path"])
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["0-of-2", "1-of-2"]


def test_default_workers_decode_in_process_on_a_cpu(monkeypatch):
    import torch

    from clip_mini.runtime import devices

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert (devices.default_workers(None, cpu), devices.default_workers(None, gpu)) == (0, 2)
    assert devices.default_workers(None, "cpu") == 0 and devices.default_workers(None, "cuda:0") == 2
    assert devices.default_workers(1, cpu) == 1 and devices.default_workers(3, cpu) == 3   # --workers wins
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert (devices.default_workers(None, cpu), devices.default_workers(None, gpu)) == (0, 4)


def test_index_in_process_default_matches_a_decoding_worker(model_dir, image_folder, tmp_path, monkeypatch):
    from clip_mini.runtime import devices
    from clip_mini.retrieval.index import EmbeddingIndex

    used = []
    real = devices.default_workers
    monkeypatch.setattr(devices, "default_workers", lambda w, d: used.append(real(w, d)) or used[-1])
    for name, extra in (("default", []), ("worker", ["--workers", "1"])):
        assert main(["index", "--model", str(model_dir), "--images", str(image_folder), "--out",
                     str(tmp_path / name), "--quiet", *extra]) == 0
    assert used == [0, 1]   # the CPU default (in-process decoding), then --workers 1
    api = EmbeddingIndex.build(tmp_path / "api", model=str(model_dir), images=str(image_folder), progress=False)
    assert len(api) == 12 and used[-1] == used[0]   # the Python API decodes as the command line does
    a, b = EmbeddingIndex.load(tmp_path / "default"), EmbeddingIndex.load(tmp_path / "worker")
    assert a.items["path"] == b.items["path"] and len(a) == 12
    np.testing.assert_array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
