"""Distributed training on CPU (2 gloo processes), issue 44: each rank draws its own dropout / drop-path /
patch-drop masks, checkpoints gather every rank's random state, and a paused and resumed 2-process run is bitwise
the uninterrupted one. Also: ``train.device`` and the per-rank checkpoint random states on their own."""
import random
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from clip_mini.config import ConfigError, load_config
from conftest import tiny_sets

TINY = tiny_sets() + [
    "model.text.vocab_size=120",
    # every kind of random mask a step draws: text and head dropout, drop-path, ViT patch-drop
    "model.text.dropout=0.1", "model.head_dropout=0.1", "model.vision.drop_path=0.1", "model.vision.patch_drop=0.25",
    "data.val=16", "data.scale_min=0.9", "train.batch_size=8", "train.lr=2e-3", "train.warmup_steps=1",
    "train.log_every=1", "train.threads=1", "train.eval_batch_size=64", "train.epochs=1", "train.device=cpu"]


def _cfg(shapes, out):
    return load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}",
                                     f"data.cache_dir={shapes.parent / 'cache'}", f"train.out_dir={out}"])


def _scramble(rank: int) -> None:
    """Move every generator somewhere else: a resume must restore them, not find them where they were."""
    torch.manual_seed(1000 + rank)
    np.random.seed(1000 + rank)
    random.seed(1000 + rank)


def _worker(rank: int, world: int, store: str, shapes, root) -> None:
    import timm.layers.patch_dropout as pd

    from clip_mini.train import train

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    kept = []   # patch-drop's kept token indices, one entry per training forward
    real = pd.patch_dropout_forward

    def recording(x, *args, **kwargs):
        out, keep = real(x, *args, **kwargs)
        if keep is not None:
            kept.append(keep.clone())
        return out, keep

    pd.patch_dropout_forward = recording
    try:
        train(_cfg(shapes, root / "ref"))
        torch.save(kept[:], root / f"kept-ref-{rank}.pt")
        kept.clear()
        _scramble(rank)
        assert train(_cfg(shapes, root / "paused"), stop_after=2)["stopped"]
        _scramble(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # no "random states will not match" warning
            train(_cfg(shapes, root / "paused"), resume="auto")
        torch.save(kept[:], root / f"kept-resumed-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=80, seed=0, size=32)


def test_two_rank_pause_and_resume_is_bitwise_the_uninterrupted_run_with_per_rank_masks(shapes, tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), shapes, tmp_path), nprocs=2, join=True)
    ref = load_file(str(tmp_path / "ref" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "paused" / "final" / "model.safetensors"))
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k   # bitwise
    kept = {(run, r): torch.load(tmp_path / f"kept-{run}-{r}.pt") for run in ("ref", "resumed") for r in (0, 1)}
    steps = len(kept["ref", 0])
    assert steps == 4 and all(len(v) == steps for v in kept.values())   # 64 train images / (2 x 8): 4 steps
    for r in (0, 1):   # each rank's masks after the resume are the ones it drew uninterrupted
        assert all(torch.equal(a, b) for a, b in zip(kept["ref", r], kept["resumed", r])), r
    # and the two ranks draw different masks at every step (they used to seed identically)
    assert all(not torch.equal(a, b) for a, b in zip(kept["ref", 0], kept["ref", 1]))
    # every checkpoint of the 2-process run holds both ranks' states, and they differ
    from clip_mini.train.checkpoint import load_checkpoint, read_index

    index = read_index(tmp_path / "paused" / "checkpoints")
    ckpt = load_checkpoint(tmp_path / "paused" / "checkpoints" / index["latest"])
    assert len(ckpt["rng_ranks"]) == 2 and torch.equal(ckpt["rng"]["torch"], ckpt["rng_ranks"][0]["torch"])
    assert not torch.equal(ckpt["rng_ranks"][0]["torch"], ckpt["rng_ranks"][1]["torch"])


def test_rank_rng_picks_each_ranks_own_state_and_never_repeats_rank0_elsewhere():
    from clip_mini.train.checkpoint import rank_rng

    states = [{"torch": torch.tensor([r])} for r in range(2)]
    ckpt = {"rng": states[0], "rng_ranks": states}
    assert rank_rng(ckpt, 1, 2) is states[1] and rank_rng(ckpt, 0, 2) is states[0]
    old = {"rng": states[0]}   # a checkpoint from before rng_ranks
    assert rank_rng(old, 0, 1) is states[0]
    with pytest.warns(RuntimeWarning, match="will not match"):
        assert rank_rng(ckpt, 0, 4) is states[0]
    assert rank_rng(ckpt, 3, 4) is None   # keeps its own seeding rather than rank 0's masks


def test_an_old_checkpoints_gpu_states_resume_onto_fewer_gpus_with_a_warning_not_an_index_error(monkeypatch):
    from clip_mini.train import checkpoint as ckpt_io

    state = ckpt_io.rng_state()
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: set_to.append((s, d)))
    state["cuda"] = [torch.tensor([0], dtype=torch.uint8), torch.tensor([1], dtype=torch.uint8)]
    ckpt_io.set_rng_state(state, torch.device("cuda", 1))
    assert torch.equal(set_to[-1][0], state["cuda"][1]) and set_to[-1][1] == torch.device("cuda", 1)
    with pytest.warns(RuntimeWarning, match="none for cuda:3"):
        ckpt_io.set_rng_state(state, torch.device("cuda", 3))   # was: a raw IndexError
    assert len(set_to) == 1
    ckpt_io.set_rng_state(state, torch.device("cpu"))   # a CPU run ignores GPU states
    assert len(set_to) == 1


def test_rank_seeds_differ_and_rank0_keeps_the_single_process_seed():
    from clip_mini.train.distributed import rank_seed

    assert rank_seed(7, 0) == 7
    assert len({rank_seed(7, r) for r in range(8)}) == 8 and rank_seed(7, 1) != rank_seed(8, 1)


def test_train_device_choices(monkeypatch):
    from clip_mini.train.build import check_train_config
    from clip_mini.train.distributed import train_device

    assert train_device("cpu") == torch.device("cpu")
    assert train_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="train.device: unknown device 'gpu'"):
        check_train_config(load_config(None, ["train.device=gpu"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device.*CUDA is not available.*train.device=cpu"):
        check_train_config(load_config(None, ["train.device=cuda"]))
    assert train_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert train_device("auto", local_rank=2, world_size=4) == torch.device("cuda", 2)
    assert train_device("cuda", local_rank=3, world_size=4) == torch.device("cuda", 3)
    assert train_device("cuda:1") == torch.device("cuda", 1)
    assert train_device("cpu", local_rank=3, world_size=4) == torch.device("cpu")   # gloo DDP on CPU
    with pytest.raises(ConfigError, match="names one GPU, but 4 processes"):
        train_device("cuda:1", local_rank=0, world_size=4)
    with pytest.raises(ConfigError, match="4 CUDA device"):
        train_device("cuda:5")
