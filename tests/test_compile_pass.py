"""train.compile_tower: the frozen-feature pass through torch.compile (clip_mini/model/layers/compile_pass.py) gives the eager
pass's features, compiles once for every batch size it meets (a short last batch is padded, a longer one runs
eagerly), and falls back to the eager pass with a warning when compiling fails."""
import shutil
import warnings

import pytest
import torch

from clip_mini.model.layers.compile_pass import CompiledPass
from clip_mini.config import load_config
from clip_mini.train import frozen as frozen_io
from clip_mini.train.optim import freeze_towers
from clip_mini.model.vision import ImageEncoder, inference_tower, tower_input

from test_train_frozen import _model
from conftest import tiny_model_config
from test_train_loop import TINY, shapes  # noqa: F401 (fixture)

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="inductor needs a C++ compiler")


def _tower():
    torch.manual_seed(0)
    return inference_tower(ImageEncoder(tiny_model_config().vision).eval(), "bf16")


class _Spy:
    """Records the batch shape each call to the compiled function sees."""

    def __init__(self, fn):
        self.fn, self.shapes = fn, []

    def __call__(self, x, *args):
        self.shapes.append(tuple(x.shape))
        return self.fn(x, *args)


@needs_compiler
def test_compiled_pass_matches_eager_and_compiles_one_shape():
    tower = _tower()
    x = tower_input(tower, torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    cp = CompiledPass(tower, "a test tower")
    spy = cp.compiled = _Spy(cp.compiled)
    with torch.inference_mode():
        eager = tower(x).float()
        first = cp(x[:4]).float()
        short = cp(x[4:]).float()    # 2 images: padded to 4, not a second compilation
        longer = cp(x).float()       # 6 > 4: eager
    assert cp.state == "compiled"
    assert spy.shapes == [(4, 3, 32, 32), (4, 3, 32, 32)]
    out = torch.cat([first, short])
    assert out.shape == eager.shape and torch.equal(longer, eager)
    cos = torch.nn.functional.cosine_similarity(out, eager)
    assert float(cos.min()) > 0.999, cos   # bf16 kernels fused differently: close, not bitwise


def test_failed_compilation_falls_back_to_eager_with_a_warning():
    tower = _tower()
    x = tower_input(tower, torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    cp = CompiledPass(tower, "a test tower")

    def broken(*_):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    cp.compiled = broken
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match=r"torch.compile of a test tower failed .*No working C\+\+ compiler"):
            out = cp(x)
        assert cp.state == "eager" and torch.equal(out, tower(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # warned once; later batches run eagerly in silence
            assert torch.equal(cp(x[:2]), tower(x[:2]))


@needs_compiler
def test_frozen_feature_pass_with_compile_tower(shapes, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, TINY + [f"data.captions={shapes / 'captions.csv'}", f"data.cache_dir={tmp_path / 'cache'}",
                                    f"train.out_dir={run}", "data.workers=0", "model.vision.trainable=false",
                                    "train.frozen_features=1", "train.precision=bf16", "train.eval_batch_size=16",
                                    "train.compile_tower=true"])
    model, splits = _model(cfg, run)
    freeze_towers(model)
    device = torch.device("cpu")
    n = len(frozen_io.split_paths(splits["val"]))
    assert n % 16, "the split should end in a short batch"
    compiled, ok = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device, write=False)
    cfg.train.compile_tower = False
    eager, _ = frozen_io.load_or_compute(model, cfg, splits["val"], "val", 1, run, None, device, write=False)
    assert compiled.shape == eager.shape == (1, n, model.visual.width) and bool(ok.all())
    cos = torch.nn.functional.cosine_similarity(compiled[0].float(), eager[0].float())
    assert float(cos.min()) > 0.999, cos
