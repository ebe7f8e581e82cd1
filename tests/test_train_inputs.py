"""Training batches depend only on (seed, epoch, position): a resumed epoch and a worker process see the same data."""
import pytest
import torch

from clip_mini.config import load_config
from clip_mini.model.text import train_tokenizer
from clip_mini.train.inputs import build_train_inputs, load_splits


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from clip_mini.data import generate

    shapes = generate(tmp_path_factory.mktemp("data") / "shapes", n=48, seed=1, size=32)
    cfg = load_config(None, [f"data.captions={shapes / 'captions.csv'}", "data.val=8", "data.cache=false",
                             "model.vision.image_size=32", "train.batch_size=4", "train.accum_freq=2"])
    splits = load_splits(cfg, progress=False)
    return cfg, splits, train_tokenizer(splits["train"]["caption"], 200)


def _inputs(data, workers=0):
    from clip_mini.config import PreprocessConfig

    cfg, splits, tok = data
    cfg.data.workers = workers
    return build_train_inputs(cfg, splits["train"], PreprocessConfig(image_size=32), tok, 16)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for sa, sb in zip(a, b) for x, y in zip(sa, sb)
                                    for k in x)


def test_steps_hold_accum_micro_batches_and_drop_the_incomplete_tail(data):
    inputs = _inputs(data)
    assert inputs.steps_per_epoch == 40 // 8
    steps = list(inputs.loader(0))
    assert len(steps) == 5 and all(len(s) == 2 and s[0]["pixels"].shape == (4, 3, 32, 32) for s in steps)
    ids = torch.cat([b["image_ids"] for s in steps for b in s])
    assert len(set(ids.tolist())) == len(ids)   # one caption per image: no image twice in an epoch


def test_resumed_epoch_sees_exactly_the_remaining_batches(data):
    inputs = _inputs(data)
    full = list(inputs.loader(3))
    assert _same(list(inputs.loader(3, start_step=2)), full[2:])
    assert _same(list(inputs.loader(3)), full)                     # reproducible, crops included
    assert not _same(list(inputs.loader(4)), full)                 # a new epoch: new order and crops


def test_a_worker_process_gives_the_same_batches_as_the_main_process(data):
    assert _same(list(_inputs(data, workers=1).loader(2)), list(_inputs(data, workers=0).loader(2)))


def test_loader_workers_persist_across_epochs_and_still_see_each_epochs_augmentation(data):
    # The training loader's worker processes start once for the run (persistent_workers), not every epoch; their
    # copy of the dataset never sees .epoch change, so the epoch travels with each index. Same batches as in-process.
    inputs, ref = _inputs(data, workers=1), _inputs(data)
    pids = []
    for epoch in (0, 1, 2):
        steps = list(inputs.loader(epoch))
        assert _same(steps, list(ref.loader(epoch))), epoch
        pids.append(tuple(w.pid for w in inputs._persistent.loader._iterator._workers))
    assert pids[0] == pids[1] == pids[2] and inputs._persistent.loader.persistent_workers
    # a resumed epoch (from step 2), and an epoch abandoned half-way (a pause) before the next one
    assert _same(list(inputs.loader(1, 2)), list(ref.loader(1, 2)))
    half = inputs.loader(2)
    next(half)
    half.close()
    assert _same(list(inputs.loader(3)), list(ref.loader(3)))
    assert not _same(list(ref.loader(3)), list(ref.loader(4)))   # epochs differ, so the check above can fail
