"""The GPU path end to end, made to count: ``pytest tests/test_cuda_smoke.py`` on any CUDA machine is the whole
procedure (docs/gpu.md). Elsewhere every test is skipped with the reason.

It checks that the GPU did the work (memory was allocated there), that fp16 training really updated the weights
(a GradScaler can skip every step of a short run), that the index built on the GPU agrees with the CPU's (fp32
tightly, bf16 by cosine), and covers contrastive accumulation, frozen features, patch-drop, an EfficientNet tower,
a resume (within a tolerance: GPU kernels need not sum in the same order twice) and, with two GPUs, a torchrun
run. The last test prints a one-screen report: GPU, compute capability, precision chosen, steps/s, images/s.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import clip_mini
from clip_mini.cli.main import main
from clip_mini.config import load_config
from conftest import tiny_sets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here (torch.cuda.is_available() is False)")

ROOT = Path(__file__).resolve().parents[1]
TINY = tiny_sets() + ["data.val=40", "train.batch_size=16", "train.lr=2e-3", "train.warmup_steps=3",
                      "train.log_every=1", "train.eval_batch_size=64", "train.epochs=1", "train.device=cuda"]
REPORT: dict = {}   # filled by the tests, printed by the last one


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=200, seed=0, size=32)


def _cfg(shapes, out, *extra):
    return load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}",
                                     f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}", *extra])


def _initial_weights(cfg, run) -> dict:
    """The weights the run started from (rank 0 builds them from train.seed), on the CPU."""
    from clip_mini.train.build import build_model

    torch.manual_seed(cfg.train.seed)
    return {k: v.detach().float().cpu() for k, v in build_model(cfg, run / "tokenizer").state_dict().items()}


def _final(run) -> dict:
    return {k: v.float() for k, v in load_file(str(run / "final" / "model.safetensors")).items()}


def _steps_per_s(run, global_batch: int) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["pairs_per_s"] for r in rows if r["kind"] == "step"][1:]   # the first step warms the kernels up
    return float(np.median(rates)) / global_batch if rates else float("nan")


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def trained(request, shapes, tmp_path_factory):
    from clip_mini.train import train

    out = tmp_path_factory.mktemp(f"run-{request.param}")
    cfg = _cfg(shapes, out, f"train.precision={request.param}", "train.max_steps=8")
    torch.cuda.reset_peak_memory_stats()
    result = train(cfg)
    assert result["step"] == 8 and np.isfinite(result["val"]["loss"])
    assert torch.cuda.max_memory_allocated() > 0   # the GPU did the work, not a silent CPU fallback
    REPORT[f"train {request.param} steps/s"] = _steps_per_s(out, 16)
    return out, cfg


def test_training_ran_on_the_gpu_and_updated_the_weights(trained):
    from clip_mini.runtime.devices import loader_workers
    from clip_mini.train.checkpoint import load_checkpoint, read_index

    run, cfg = trained
    assert torch.get_float32_matmul_precision() == "high"   # TF32 on
    saved = yaml_config(run)
    assert saved["data"]["workers"] is None and loader_workers(None) >= 1   # auto: loader workers on a GPU
    ckpt = load_checkpoint(run / "checkpoints" / read_index(run / "checkpoints")["latest"])
    assert ckpt["rng_ranks"][0]["cuda"].numel() > 0   # this GPU's generator, for an exact-as-possible resume
    if saved["train"]["precision"] == "fp16":
        assert ckpt["scaler"]["scale"] > 0   # the GradScaler's state is checkpointed for exact resumes
    # the GradScaler may skip every step of a short fp16 run (inf gradients at its initial scale): the weights
    # must actually have moved
    start, end = _initial_weights(cfg, run), _final(run)
    moved = [k for k in end if k in start and not torch.allclose(start[k], end[k], atol=1e-6)]
    assert len(moved) > len(end) // 2, f"only {len(moved)} of {len(end)} tensors changed"


def yaml_config(run):
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())


def _index(model, images, out, *extra) -> "clip_mini.EmbeddingIndex":
    assert main(["index", "--model", str(model), "--images", str(images), "--out", str(out), "--quiet",
                 *extra]) == 0
    return clip_mini.EmbeddingIndex.load(out)


def test_index_search_and_embed_on_cuda_match_cpu(trained, shapes, tmp_path, capsys):
    from clip_mini.runtime.devices import resolve_precision

    model = trained[0] / "best"
    images = shapes / "images"
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    gpu = _index(model, images, tmp_path / "gpu", "--device", "cuda", "--precision", "fp32")
    REPORT["index fp32 images/s (incl. start-up)"] = len(gpu) / (time.perf_counter() - start)
    assert torch.cuda.max_memory_allocated() > 0
    cpu = _index(model, images, tmp_path / "cpu", "--device", "cpu", "--precision", "fp32")
    assert gpu.items["path"] == cpu.items["path"]
    # fp32 (TF32 on the GPU, float16 rows): close, not bitwise
    assert np.abs(gpu.embeddings.astype(np.float32) - cpu.embeddings.astype(np.float32)).max() < 2e-2
    # bf16 where the GPU has it (auto's choice), fp16 on older GPUs: by cosine against the CPU's fp32 rows
    auto = resolve_precision("auto", torch.device("cuda"))
    REPORT["index precision auto"] = auto
    low = "bf16" if auto == "bf16" else "fp16"
    start = time.perf_counter()
    half = _index(model, images, tmp_path / low, "--device", "cuda", "--precision", low)
    REPORT[f"index {low} images/s (incl. start-up)"] = len(half) / (time.perf_counter() - start)
    a, b = half.embeddings.astype(np.float32), cpu.embeddings.astype(np.float32)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() > 0.99, cos.min()
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
    paths = sorted(str(p) for p in images.glob("*.png"))[:5]
    on_gpu = embedder.encode_image(paths)
    on_cpu = clip_mini.load(model, device="cpu").encode_image(paths)
    np.testing.assert_allclose(on_gpu, on_cpu, atol=1e-2)
    half = clip_mini.load(model, precision="fp16").encode_image(paths)
    np.testing.assert_allclose(np.linalg.norm(half, axis=1), 1.0, atol=1e-5)


def test_attention_and_eval_on_cuda(trained, shapes, tmp_path, capsys):
    model = trained[0] / "best"
    image = sorted((shapes / "images").glob("*.png"))[0]
    assert main(["attention", "--model", str(model), str(image), "--out", str(tmp_path / "a.png"), "--mode",
                 "rollout", "--device", "cuda"]) == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  captions: {shapes / 'captions.csv'}\n  val: 40\n")
    capsys.readouterr()
    for precision in ("fp32", "fp16"):
        assert main(["eval", "--model", str(model), "--data", str(cfg), "--json", "--device", "cuda", "--quiet",
                     "--precision", precision]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["split"] == "val" and out["precision"] == precision and np.isfinite(out["loss"])


@pytest.mark.parametrize("name,extra", [
    ("accum", ["train.accum_freq=2", "train.batch_size=8"]),
    ("frozen", ["model.vision.trainable=false", "train.frozen_features=2", "data.workers=0"]),
    ("patch-drop", ["model.vision.patch_drop=0.25", "model.vision.drop_path=0.1"]),
    ("efficientnet", ["model.vision.backbone=efficientnet_lite0", "model.vision.image_size=64",
                      "train.batch_size=8"]),
])
def test_training_variants_run_on_the_gpu(shapes, tmp_path, name, extra):
    from clip_mini.train import train

    cfg = _cfg(shapes, tmp_path / name, "train.max_steps=4", "train.precision=bf16"
               if torch.cuda.get_device_capability() >= (8, 0) else "train.precision=fp16", *extra)
    torch.cuda.reset_peak_memory_stats()
    result = train(cfg)
    assert result["step"] == 4 and np.isfinite(result["val"]["loss"])
    assert torch.cuda.max_memory_allocated() > 0
    start, end = _initial_weights(cfg, tmp_path / name), _final(tmp_path / name)
    assert any(not torch.allclose(start[k], end[k], atol=1e-6) for k in end if k in start)


def test_pause_and_resume_on_the_gpu_matches_within_a_tolerance(shapes, tmp_path):
    # Bit-exact resume is a CPU property (tests/test_train_loop.py, pinned to train.device=cpu): on a GPU, atomics
    # in attention's backward and TF32 may sum in another order, so the resumed run is compared with a tolerance.
    from clip_mini.train import train

    extra = ["train.max_steps=8", "model.vision.patch_drop=0.25", "train.checkpoint_every=2"]
    train(_cfg(shapes, tmp_path / "ref", *extra))
    assert train(_cfg(shapes, tmp_path / "paused", *extra), stop_after=4)["stopped"]
    train(_cfg(shapes, tmp_path / "paused", *extra), resume="auto")
    ref, got = _final(tmp_path / "ref"), _final(tmp_path / "paused")
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-3, rtol=1e-3, msg=k)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for a torchrun run")
def test_torchrun_on_two_gpus(shapes, tmp_path):
    run = tmp_path / "ddp"
    sets = TINY + [f"data.captions={shapes / 'captions.csv'}", f"data.cache_dir={shapes.parent / 'cache'}",
                   f"train.out_dir={run}", "train.batch_size=8", "train.precision=bf16"
                   if torch.cuda.get_device_capability() >= (8, 0) else "train.precision=fp16"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py")] + [a for kv in sets for a in ("--set", kv)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es) on cuda:0" in done.stdout
    ckpt = torch.load(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert len(ckpt["rng_ranks"]) == 2   # both ranks' random states
    assert not torch.equal(ckpt["rng_ranks"][0]["cuda"], ckpt["rng_ranks"][1]["cuda"])
    assert (run / "final" / "model.safetensors").is_file()


def test_zz_report(capsys):
    """One screen for whoever ran this: what the GPU is, what was chosen, how fast it went."""
    from clip_mini.runtime.devices import resolve_precision

    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    lines = [f"GPU: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, "
             f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB), "
             f"{torch.cuda.device_count()} visible; torch {torch.__version__}, CUDA {torch.version.cuda}",
             f"precision auto: {resolve_precision('auto', device)}"]
    lines += [f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in REPORT.items()]
    with capsys.disabled():
        print("\n-- clip_mini CUDA smoke report " + "-" * 40 + "\n" + "\n".join(lines) + "\n" + "-" * 71)
