"""Contrastive accumulation and DDP give the update of one big batch.

* accumulation: 2 micro-batches of B (features cached, each re-forwarded) == one batch of 2B, within 1e-6;
* DDP: 2 gloo processes on CPU, each with half the batch == one process on the whole batch, within 1e-5;
* both again with several captions per image (train.captions_per_image): text rows and their image ids split too;
* DDP once more through torch.compile (train.compile), within 3e-5.
"""
import shutil

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from clip_mini.config import load_config
from clip_mini.model.loss import ClipLoss, SigLipLoss
from clip_mini.model.clip import CLIPModel
from clip_mini.train.accum import FeatureModel, forward_backward
from clip_mini.train.optim import build_optimizer
from conftest import NARROW, tiny_sets

TINY = tiny_sets(NARROW) + ["model.text.dropout=0", "model.head_dropout=0", "train.weight_decay=0.1"]
TINY += ["train.device=cpu"]   # bit-exact checks are a CPU property: pinned there on a GPU host too
VOCAB = 60
# The micro-batch of every compiled step here and in test_train_compile.py (on one thread, as a DDP rank runs):
# the same shapes give the same generated kernels, which inductor's cache then compiles once per machine.
COMPILED_BATCH = 8


def _model(seed: int = 0, overrides=()):
    cfg = load_config(None, TINY + list(overrides))
    torch.manual_seed(seed)
    return CLIPModel(cfg.model, vocab_size=VOCAB, pad_token_id=0), cfg


def _batch(n: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, 7), generator=g)
    mask = torch.ones_like(ids)
    for i in range(n):   # ragged captions: padding must be handled identically in every split
        cut = 3 + i % 5
        ids[i, cut:], mask[i, cut:] = 0, 0
    image_ids = torch.arange(n)
    image_ids[n // 2 + 1] = 0   # two captions of image 0 in different halves (masked as negatives)
    return {"pixels": torch.randn(n, 3, 32, 32, generator=g), "input_ids": ids, "attention_mask": mask,
            "image_ids": image_ids}


def _split(batch: dict, parts: int) -> list[dict]:
    n = batch["pixels"].shape[0] // parts
    return [{k: v[i * n * (len(v) // len(batch["pixels"])):(i + 1) * n * (len(v) // len(batch["pixels"]))]
             for k, v in batch.items()} for i in range(parts)]


def _captions_batch(n: int, per_image: int = 3) -> dict:
    """``_batch`` with a locked text tower's rows for ``per_image`` captions of each image (train.captions_per_image)."""
    b = _batch(n)
    g = torch.Generator().manual_seed(2)
    return {**b, "text_tower": torch.randn(n * per_image, 32, generator=g),
            "text_ids": b["image_ids"].repeat_interleave(per_image)}


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, batches, precision="fp32", loss_fn=None):
    model.zero_grad(set_to_none=True)
    loss = forward_backward(FeatureModel(model), batches, loss_fn or ClipLoss(), torch.device("cpu"), precision)
    return loss, _grads(model)


def _assert_accumulation_is_one_batch(model, batch, loss_fn=None) -> tuple[dict, dict]:
    """Two micro-batches give the big batch's loss and gradients (the logit parameters' counted once)."""
    loss_big, grads_big = _run(model, [batch], loss_fn=loss_fn)
    loss_acc, grads_acc = _run(model, _split(batch, 2), loss_fn=loss_fn)
    assert torch.allclose(loss_big, loss_acc, atol=1e-6)
    assert grads_big.keys() == grads_acc.keys() and "logit_scale" in grads_big
    for name in grads_big:   # logit_scale included: its gradient must be counted once, not twice
        assert torch.allclose(grads_big[name], grads_acc[name], atol=1e-6, rtol=1e-5), name
    return grads_big, grads_acc


def test_siglip_accumulation_counts_the_bias_and_scale_gradients_once():
    model, _ = _model(overrides=["model.init_logit_bias=-10", "model.init_logit_scale=2.302585"])
    grads_big, _ = _assert_accumulation_is_one_batch(model, _batch(16), SigLipLoss())
    assert "logit_bias" in grads_big


def test_accumulated_micro_batches_equal_one_big_batch():
    model, cfg = _model()
    batch = _batch(16)
    grads_big, grads_acc = _assert_accumulation_is_one_batch(model, batch)

    # ... and so the AdamW update is the same. Adam's first step is about lr * sign(grad), so entries whose
    # exact gradient is zero (the attention key bias: softmax ignores a constant shift) carry only rounding
    # noise of either sign; they are left out of the comparison: an entry counts when its gradient is clearly
    # above Adam's eps and far above the difference between the two ways of computing it.
    states = []
    for batches in ([batch], _split(batch, 2)):
        m, _ = _model()
        opt = build_optimizer(m, cfg.train)
        _run(m, batches)
        opt.step()
        states.append(dict(m.named_parameters()))
    compared = 0
    for name, g in grads_big.items():
        noise = (g - grads_acc[name]).abs()
        exact_zero = (g == 0) & (noise == 0)   # tokens absent from the batch: no update either way
        well_defined = ((g.abs() > 1e-6) & (g.abs() > 100 * noise)) | exact_zero
        diff = (states[0][name] - states[1][name]).abs()[well_defined]
        assert diff.numel() == 0 or diff.max() <= 1e-6, name
        compared += diff.numel()
    assert compared > 0.9 * sum(g.numel() for g in grads_big.values())


def test_accumulation_with_several_captions_per_image_equals_one_big_batch():
    model, _ = _model()
    _assert_accumulation_is_one_batch(model, _captions_batch(16))


def test_accumulation_adds_negatives_unlike_gradient_averaging():
    model, _ = _model()
    batch = _batch(16)
    loss_big, grads_big = _run(model, [batch])
    # Averaging two independent small-batch losses is a different (easier) objective.
    halves = [_run(model, [b])[0] for b in _split(batch, 2)]
    assert not torch.allclose(loss_big, sum(halves) / 2, atol=1e-3)


def test_dropout_masks_are_replayed_in_the_re_forward():
    model, _ = _model(overrides=["model.text.dropout=0.3", "model.head_dropout=0.3"])
    model.train()
    batch = _batch(12)
    torch.manual_seed(5)
    loss_acc, _ = _run(model, _split(batch, 3))
    # The re-forwards used the first pass's masks, so the reported loss equals a fresh no-grad evaluation of
    # the same features under the same RNG stream.
    torch.manual_seed(5)
    feats = []
    with torch.no_grad():
        for b in _split(batch, 3):
            i, t, s = FeatureModel(model)(b["pixels"], b["input_ids"], b["attention_mask"])
            feats.append((i, t))
    ref = ClipLoss()(torch.cat([f[0] for f in feats]), torch.cat([f[1] for f in feats]), s, batch["image_ids"])
    assert torch.allclose(loss_acc, ref, atol=1e-6)


def _ddp_worker(rank: int, world: int, store: str, out: str, compiled: bool = False) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        shard = _split(_batch(16), world)[rank]
        for accum in (1, 2):   # plain, and contrastive accumulation inside each process
            model, _ = _model()
            ddp = torch.nn.parallel.DistributedDataParallel(FeatureModel(model), broadcast_buffers=False)
            loss = forward_backward(ddp, _split(shard, accum), ClipLoss(), torch.device("cpu"))
            torch.save({"loss": loss, "grads": _grads(model)}, f"{out}.{accum}.{rank}")
        # several captions per image: the text rows and their image ids are gathered too
        shard = _split(_captions_batch(16), world)[rank]
        for accum in (1, 2):
            model, _ = _model()
            ddp = torch.nn.parallel.DistributedDataParallel(FeatureModel(model), broadcast_buffers=False,
                                                            find_unused_parameters=True)   # the text tower idles
            loss = forward_backward(ddp, _split(shard, accum), ClipLoss(), torch.device("cpu"))
            torch.save({"loss": loss, "grads": _grads(model)}, f"{out}.captions{accum}.{rank}")
        if compiled:   # train.compile: the DDP module through torch.compile (no_sync passed through)
            from clip_mini.model.layers.compile_pass import CompiledStep

            # Every micro-batch has COMPILED_BATCH pairs (accumulation: a rank's 2 x 8 of a batch of 32): one shape,
            # so the re-forward runs the graph the plain step compiled, and only the gradient-free pass compiles
            # anew (compiling dominates this test). test_train_compile.py compiles the same shapes on one thread.
            model, _ = _model()
            step = CompiledStep(torch.nn.parallel.DistributedDataParallel(FeatureModel(model),
                                                                          broadcast_buffers=False))
            for accum in (1, 2):
                model.zero_grad(set_to_none=True)   # no optimiser step: the weights stay the initial ones
                shard = _split(_batch(COMPILED_BATCH * world * accum), world)[rank]
                loss = forward_backward(step, _split(shard, accum), ClipLoss(), torch.device("cpu"))
                assert step.state == "compiled"
                torch.save({"loss": loss, "grads": _grads(model)}, f"{out}.compiled{accum}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_equal_one_process_on_the_whole_batch(tmp_path):
    # One spawn for both cases: starting a process (imports of torch, timm, transformers) dominates the time.
    compiled = shutil.which("g++") is not None or shutil.which("c++") is not None   # inductor needs one
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "out"), compiled), nprocs=2, join=True)
    for case, batch in (("", _batch(16)), ("captions", _captions_batch(16))):
        _check_ddp(tmp_path, case, batch)
    if compiled:   # inductor reorders float sums: close, not to the eager tolerance
        for accum in (1, 2):
            _check_ddp(tmp_path, "compiled", _batch(COMPILED_BATCH * 2 * accum), atol=3e-5, accums=(accum,))


def _check_ddp(tmp_path, case: str, batch: dict, atol: float = 1e-5, accums=(1, 2)) -> None:
    model, _ = _model()
    loss_ref, grads_ref = _run(model, [batch])
    for accum in accums:
        for rank in range(2):
            got = torch.load(tmp_path / f"out.{case}{accum}.{rank}", weights_only=True)
            assert torch.allclose(got["loss"], loss_ref, atol=atol), (accum, rank)
            assert got["grads"].keys() == grads_ref.keys()
            for name, g in grads_ref.items():
                assert torch.allclose(got["grads"][name], g, atol=atol, rtol=1e-4), (accum, rank, name)
