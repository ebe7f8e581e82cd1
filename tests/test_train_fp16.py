"""fp16 training with a GradScaler (for GPUs without bf16), exercised on the CPU: it trains, never counts the
scaler's overflow steps as bad steps, checkpoints the scaler and resumes from it."""
import numpy as np
import pytest

from clip_mini.config import load_config
from conftest import NARROW, tiny_sets

TINY = tiny_sets(NARROW) + [
    "model.text.vocab_size=120", "model.text.max_length=16", "data.val=12", "train.batch_size=16", "train.lr=2e-3",
    "train.warmup_steps=2", "train.log_every=1", "train.threads=1", "train.eval_batch_size=64", "train.precision=fp16",
    "train.epochs=2"]
TINY += ["train.device=cpu"]   # bit-exact checks are a CPU property: pinned there on a GPU host too


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=60, seed=0, size=32)


@pytest.mark.slow   # fp16 arithmetic is emulated on this CPU: ~30 s for a few steps
def test_fp16_trains_checkpoints_the_scaler_and_resumes(shapes, tmp_path):
    from clip_mini.train import train
    from clip_mini.train.checkpoint import load_checkpoint, read_index

    cfg = load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}", f"train.out_dir={tmp_path / 'run'}"])
    paused = train(cfg, stop_after=2)
    assert paused["stopped"] and paused["step"] == 2
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints" / read_index(tmp_path / "run" / "checkpoints")["latest"])
    assert ckpt["scaler"]["scale"] > 0 and "_growth_tracker" in ckpt["scaler"]
    done = train(cfg, resume="auto")
    assert not done["stopped"] and done["step"] > 2 and np.isfinite(done["val"]["loss"])
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
