"""train.compile: the training step's forward and backward through torch.compile (clip_mini/model/layers/compile_pass.py,
``CompiledStep``) give the eager step's loss and gradients within float tolerance (inductor fuses and reorders the
element-wise work, so not bitwise), keep accumulation equal to one big batch and dropout's masks replayed in the
re-forward, fall back to eager with a warning when compiling fails, and run inside ``train``."""
import warnings

import pytest
import torch

from clip_mini.model.layers.compile_pass import CompiledStep
from clip_mini.model.loss import ClipLoss
from clip_mini.train.accum import FeatureModel, forward_backward

from conftest import NARROW, tiny_sets
from test_compile_pass import needs_compiler
from test_train_accum import COMPILED_BATCH, _batch, _grads, _model, _split
from test_train_loop import TINY, shapes  # noqa: F401 (fixture)

B = COMPILED_BATCH   # every compiled call sees B pairs: one graph serves the plain step and the re-forwards


@pytest.fixture(autouse=True)
def _fresh_dynamo_one_thread():
    """Each test compiles from a fresh dynamo state (no shapes marked dynamic by the test before it), on one thread
    as test_train_accum.py's DDP ranks do: the same shapes and thread count generate the same kernels, which
    inductor's on-disk cache compiles once (compiling C++ dominates these tests)."""
    threads = torch.get_num_threads()
    torch._dynamo.reset()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()


def _step(module, model, batches, precision="fp32"):
    model.zero_grad(set_to_none=True)
    loss = forward_backward(module, batches, ClipLoss(), torch.device("cpu"), precision)
    return loss, _grads(model)


def _assert_close(a, b, atol=2e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.allclose(loss_a, loss_b, atol=atol)
    assert grads_a.keys() == grads_b.keys() and "logit_scale" in grads_a
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=atol, rtol=1e-3), name


@needs_compiler
def test_compiled_step_matches_eager_and_accumulates_like_one_batch():
    model, _ = _model()
    batch, big = _batch(B), _batch(2 * B)
    eager = _step(FeatureModel(model), model, [batch])
    compiled = CompiledStep(FeatureModel(model))
    _assert_close(_step(compiled, model, [batch]), eager)
    assert compiled.state == "compiled"
    # two micro-batches of B: a gradient-free first pass (its own graph) and re-forwards (the step's graph), still
    # one big batch of 2B
    _assert_close(_step(compiled, model, _split(big, 2)), _step(FeatureModel(model), model, [big]))
    # the weights stay the model's own: a step changes what the compiled module computes
    with torch.no_grad():
        model.logit_scale.add_(0.5)
    moved = _step(compiled, model, [batch])
    assert not torch.allclose(moved[0], eager[0], atol=1e-3)
    _assert_close(moved, _step(FeatureModel(model), model, [batch]))


@needs_compiler
def test_caption_lengths_do_not_recompile_every_step():
    # captions are padded to the longest of their batch: the second length compiles a graph for any length
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, _ = _model()
    compiled = CompiledStep(FeatureModel(model))
    graphs = []
    for length in (7, 5, 6, 4, 3):
        b = _batch(B)
        b["input_ids"], b["attention_mask"] = b["input_ids"][:, :length], b["attention_mask"][:, :length]
        eager = _step(FeatureModel(model), model, [b])
        _assert_close(_step(compiled, model, [b]), eager)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] > graphs[0] and graphs[-1] == graphs[1], graphs


@needs_compiler
def test_compiled_re_forward_replays_dropout_masks():
    model, _ = _model(overrides=["model.text.dropout=0.3", "model.head_dropout=0.3"])
    model.train()
    batch = _batch(3 * B)   # three micro-batches of B
    compiled = CompiledStep(FeatureModel(model))
    torch.manual_seed(5)
    loss_acc, _ = _step(compiled, model, _split(batch, 3))
    # the reported loss comes from the re-forwards' fresh features; it equals the first passes' loss only if the
    # re-forwards drew the same masks
    torch.manual_seed(5)
    with torch.no_grad():
        feats = [compiled(b["pixels"], b["input_ids"], b["attention_mask"]) for b in _split(batch, 3)]
    ref = ClipLoss()(torch.cat([f[0] for f in feats]), torch.cat([f[1] for f in feats]), feats[0][2],
                     batch["image_ids"])
    assert torch.allclose(loss_acc, ref, atol=1e-5)
    # and dropout is live: another seed gives another loss
    torch.manual_seed(6)
    assert not torch.allclose(_step(compiled, model, _split(batch, 3))[0], loss_acc, atol=1e-4)


def test_failed_compilation_falls_back_to_eager_with_a_warning():
    model, _ = _model()
    batch = _batch(8)
    step = CompiledStep(FeatureModel(model))

    def broken(*_):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    object.__setattr__(step, "compiled", broken)
    with pytest.warns(RuntimeWarning, match=r"torch.compile of the training step failed .*No working C\+\+ compiler"):
        got = _step(step, model, [batch])
    assert step.state == "eager"
    want = _step(FeatureModel(model), model, [batch])
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # warned once; later steps run eagerly in silence
        _step(step, model, [batch])
    # not a submodule: the parameters are reached once
    assert len(list(step.parameters())) == len(list(model.parameters()))


@needs_compiler
def test_train_with_compile(shapes, tmp_path):
    from clip_mini.config import load_config
    from clip_mini.train.loop import train

    run = tmp_path / "run"
    cfg = load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}", f"data.cache_dir={tmp_path / 'c'}",
                                    f"train.out_dir={run}", "data.workers=0", "train.epochs=1",
                                    "train.precision=auto", "train.compile=true", *tiny_sets(NARROW),
                                    # every caption is longer than 6 tokens: one caption length, one graph (a
                                    # second length's recompile is the test above's)
                                    "model.text.max_length=6"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # no fallback: it really compiled (at this CPU's precision)
        result = train(cfg)
    assert result["step"] > 1 and not result["stopped"]
    assert torch.isfinite(torch.tensor(result["val"]["loss"])) and (run / "final").is_dir()
