"""Shared fixtures: a generated shapes dataset, a tiny trained model, untrained models for index mechanics.

The trained model is made by a short direct loop (pixels decoded once, no augmentation, the real
``CLIPModel`` and ``clip_loss``): about 25 s on one core. The trainer's own end-to-end behaviour is tested in its
own test files; these fixtures only need a model that has learnt colours and shapes, quickly. It trains on the
train split of ``SHAPES_SPLIT`` only, so the val and test images (``heldout_images``) and the generator's
compositional split are images it never saw: tests that score those measure generalisation, not memorisation.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

FLICKR8K = Path(__file__).resolve().parents[1].parent / "shared/data/flickr8k"
# The split of the shapes data the trained fixture is trained on (train) and scored on (val, test): the same
# numbers in a config's data section (`val: 0.1`, `test: 0.1`, default seed) give the same split to `clip-mini eval`.
SHAPES_SPLIT = dict(val=0.1, test=0.1, seed=0)

TINY = dict(vision=dict(image_size=32, patch_size=8, width=64, depth=2, heads=2),
            text=dict(dim=64, n_layers=1, n_heads=2, hidden_dim=128, dropout=0.0, max_length=16, vocab_size=300),
            embed_dim=32, head_dropout=0.0)
# Narrower still, one block a tower: trainer tests where a step's cost matters and what the model learns does not.
# The text tower's dropout, max_length and vocabulary and the head dropout stay ModelConfig's unless a test sets them.
NARROW = dict(vision=dict(image_size=32, patch_size=8, width=32, depth=1, heads=2),
              text=dict(dim=32, n_layers=1, n_heads=2, hidden_dim=64), embed_dim=16)


def cpu_runs_bf16_convolutions() -> bool:
    """Whether oneDNN runs a fused bf16 convolution (``model/layers/conv_act.ConvAct``) on this CPU: it needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT, and an AVX2-only CPU refuses. Asked of the CPU, never assumed."""
    import torch

    from clip_mini.model.layers.conv_act import ConvAct

    x = torch.ones(1, 8, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(8, 8, 1).to(torch.bfloat16).to(memory_format=torch.channels_last)
    try:
        with torch.inference_mode():
            ConvAct(conv, torch.nn.ReLU6())(x)
        return True
    except RuntimeError:
        return False


def tiny_model_config(**changes):
    from clip_mini.config import ModelConfig, from_dict

    return from_dict(ModelConfig, {**TINY, **changes})


def tiny_sets(base: dict | None = None, **changes) -> list[str]:
    """``tiny_model_config(**changes)`` (or ``base``, e.g. ``NARROW``, with ``changes``) as config overrides
    (``model.vision.width=64``, ...) for ``load_config`` or ``--set``; settings of the test's own follow them (a
    later override of a key wins)."""
    sets = []
    for key, value in {**(TINY if base is None else base), **changes}.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        sets += [f"model.{key}{'' if k is None else '.' + k}={'null' if v is None else v}" for k, v in items]
    return sets


def make_model_dir(out: Path, seed: int = 0, captions=None, **changes) -> Path:
    """An untrained tiny model saved as a model directory."""
    import torch

    from clip_mini.model.clip import CLIPModel

    torch.manual_seed(seed)
    captions = captions or ["a red circle", "a blue square", "a green star", "a yellow triangle"] * 4
    CLIPModel.build(tiny_model_config(**changes), captions=captions).save_pretrained(out)
    return out


def write_images(folder: Path, n: int, seed: int = 0, size: int = 24, prefix: str = "img") -> list[Path]:
    """``n`` small random PNG images (distinct contents) under ``folder``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"{prefix}{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


@pytest.fixture(scope="session", autouse=True)
def _scratch_test_ledger(tmp_path_factory):
    """No test writes the repository's test ledger: test scorings in this session land in a scratch file (a test
    that reads its lines takes ``ledger_path``). In-process only: a test that scores test in a child process
    patches the child itself."""
    import clip_mini.eval.ledger as ledger

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ledger, "LEDGER", tmp_path_factory.mktemp("ledger") / "test_ledger.jsonl")
        yield


@pytest.fixture
def ledger_path(tmp_path, monkeypatch) -> Path:
    """A fresh test ledger for one test (``clip_mini.eval.ledger.LEDGER`` points at it)."""
    import clip_mini.eval.ledger as ledger

    path = tmp_path / "ledger" / "test_ledger.jsonl"
    monkeypatch.setattr(ledger, "LEDGER", path)
    return path


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory) -> Path:
    from clip_mini.data.synthetic import generate

    # 3000 images: with fewer, 1000 steps memorise single images instead of learning "red" and "circle".
    return generate(tmp_path_factory.mktemp("data") / "shapes", n=3000)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """Untrained tiny model (index mechanics need a fingerprint and a forward pass, not quality)."""
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models") / "other", seed=1)


@pytest.fixture(scope="session")
def shapes_splits(shapes_dir) -> dict:
    """``{"train", "val", "test"}`` caption tables of the shapes data, split as ``clip-mini eval`` splits them."""
    from clip_mini.config import DataConfig
    from clip_mini.data import load_table, split_by_image

    df = load_table(DataConfig(captions=str(shapes_dir / "captions.csv"), cache=False), progress=False)
    return split_by_image(df, **SHAPES_SPLIT)


@pytest.fixture(scope="session")
def heldout_images(shapes_splits, tmp_path_factory) -> Path:
    """A folder with copies of the val and test images of the shapes data: none was in the fixture's training."""
    import shutil

    folder = tmp_path_factory.mktemp("heldout") / "images"
    folder.mkdir()
    for split in ("val", "test"):
        for p in shapes_splits[split]["path"].unique():
            shutil.copy2(p, folder / Path(p).name)
    return folder


@pytest.fixture(scope="session")
def trained_model_dir(shapes_splits, tmp_path_factory) -> Path:
    """Tiny model trained for 1000 steps of 64 pairs on the train split of the shapes data (one thread: see below)."""
    import torch

    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.model.loss import clip_loss
    from clip_mini.model.clip import CLIPModel

    df = shapes_splits["train"]
    torch.manual_seed(0)
    model = CLIPModel.build(tiny_model_config(), captions=df["caption"].tolist())
    transform = build_eval_transform(model.preprocess)
    images = df.drop_duplicates("image_id").sort_values("image_id")["path"].tolist()
    pixels = torch.stack([transform(load_image(p)) for p in images])  # (N, 3, 32, 32)
    captions = df.groupby("image_id")["caption"].apply(list).tolist()
    steps, lr = 1000, 2e-3
    # One thread: for a model this small, a second thread only adds synchronisation, and on a busy machine
    # OpenMP's spin-waiting makes the same loop many times slower. It also makes the run independent of the core count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng = np.random.default_rng(0)
    model.train()
    try:
        for _ in range(steps):
            ids = rng.choice(len(images), 64, replace=False)  # one caption per image: no same-image negatives
            tokens = model.tokenize([captions[i][rng.integers(len(captions[i]))] for i in ids])
            loss = clip_loss(model.encode_image(pixels[ids]),
                             model.encode_text(tokens["input_ids"], tokens["attention_mask"]), model.scale())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            model.clamp_logit_scale()
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("models") / "trained"
    model.eval().save_pretrained(out)
    return out


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """12 random PNGs, 4 of them in a subfolder."""
    folder = tmp_path / "photos"
    write_images(folder, 8, seed=0)
    write_images(folder / "sub", 4, seed=1, prefix="sub")
    return folder
