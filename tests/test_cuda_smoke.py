"""The GPU path end to end: train a few steps (fp16 + GradScaler and bf16), index, search and embed on CUDA.

Runs only where a CUDA device is present (``pytest tests/test_cuda_smoke.py``); elsewhere every test is skipped
with the reason. It checks that nothing on the way silently falls back to the CPU and that the GPU results agree
with the CPU's.
"""
import json

import numpy as np
import pytest
import torch

import clip_mini
from clip_mini.cli.main import main
from clip_mini.config import load_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here (torch.cuda.is_available() is False)")

TINY = ["model.vision.image_size=32", "model.vision.patch_size=8", "model.vision.width=64", "model.vision.depth=2",
        "model.vision.heads=2", "model.text.dim=64", "model.text.n_layers=1", "model.text.n_heads=2",
        "model.text.hidden_dim=128", "model.text.vocab_size=120", "model.text.max_length=16", "model.embed_dim=32",
        "data.val=40", "train.batch_size=16", "train.lr=2e-3", "train.warmup_steps=3", "train.log_every=1",
        "train.eval_batch_size=64", "train.epochs=1"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=200, seed=0, size=32)


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def trained(request, shapes, tmp_path_factory):
    from clip_mini.train import train

    out = tmp_path_factory.mktemp(f"run-{request.param}")
    cfg = load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}", f"train.out_dir={out}",
                                    f"train.precision={request.param}", "train.max_steps=8"])
    result = train(cfg)
    assert result["step"] == 8 and np.isfinite(result["val"]["loss"])
    return out


def test_training_ran_on_the_gpu_with_tf32_and_workers(trained):
    from clip_mini.train.checkpoint import load_checkpoint, read_index

    assert torch.get_float32_matmul_precision() == "high"   # TF32 on
    from clip_mini.runtime.devices import loader_workers

    saved = yaml_config(trained)
    assert saved["data"]["workers"] is None and loader_workers(None) >= 1   # auto: loader workers on a GPU
    ckpt = load_checkpoint(trained / "checkpoints" / read_index(trained / "checkpoints")["latest"])
    if saved["train"]["precision"] == "fp16":
        assert ckpt["scaler"]["scale"] > 0   # the GradScaler's state is checkpointed for exact resumes


def yaml_config(run):
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())


def test_index_search_and_embed_on_cuda_match_cpu(trained, shapes, tmp_path, capsys):
    model = trained / "best"
    assert main(["index", "--model", str(model), "--images", str(shapes / "images"), "--out", str(tmp_path / "gpu"),
                 "--device", "cuda", "--quiet"]) == 0
    assert main(["index", "--model", str(model), "--images", str(shapes / "images"), "--out", str(tmp_path / "cpu"),
                 "--device", "cpu", "--quiet"]) == 0
    gpu, cpu = clip_mini.EmbeddingIndex.load(tmp_path / "gpu"), clip_mini.EmbeddingIndex.load(tmp_path / "cpu")
    assert gpu.items["path"] == cpu.items["path"]
    # TF32 and a different kernel order: close, not bitwise (float16 rows)
    assert np.abs(gpu.embeddings.astype(np.float32) - cpu.embeddings.astype(np.float32)).max() < 2e-2
    capsys.readouterr()
    assert main(["search", "--index", str(tmp_path / "gpu"), "a red circle", "-k", "3", "--json",
                 "--device", "cuda"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 3
    assert main(["search", "--index", str(tmp_path / "gpu"), "--image", gpu.items["path"][0], "-k", "1", "--json",
                 "--device", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["path"] == gpu.items["path"][0]

    embedder = clip_mini.load(model)   # device="auto" picks the GPU
    assert embedder.device.type == "cuda" and next(embedder.model.parameters()).is_cuda
    t = embedder.encode_text(["a red circle", "a blue square"], output="torch")
    assert t.is_cuda and t.shape == (2, 32)
    images = sorted(str(p) for p in (shapes / "images").glob("*.png"))[:5]
    on_gpu = embedder.encode_image(images)
    on_cpu = clip_mini.load(model, device="cpu").encode_image(images)
    np.testing.assert_allclose(on_gpu, on_cpu, atol=1e-2)
    half = clip_mini.load(model, precision="fp16").encode_image(images)
    np.testing.assert_allclose(np.linalg.norm(half, axis=1), 1.0, atol=1e-5)


def test_attention_and_eval_on_cuda(trained, shapes, tmp_path, capsys):
    model = trained / "best"
    image = sorted((shapes / "images").glob("*.png"))[0]
    assert main(["attention", "--model", str(model), str(image), "--out", str(tmp_path / "a.png"), "--mode",
                 "rollout", "--device", "cuda"]) == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  captions: {shapes / 'captions.csv'}\n  val: 40\n")
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--data", str(cfg), "--json", "--device", "cuda", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["split"] == "val"
