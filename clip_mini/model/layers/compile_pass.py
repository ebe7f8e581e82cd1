"""``torch.compile`` for a long gradient-free tower pass (``train.compile_tower``: the frozen-feature pass), and for
the training step's forward and backward (``train.compile``, ``CompiledStep`` below).

Inductor with ``freezing``: the tower's weights are folded into the graph as constants, which lets it prepack the
linear layers' weights for oneDNN and fuse the element-wise work around them (norms, activations, residual adds)
into generated loops. The gain per image is modest and compiling takes seconds, so it pays only over a long pass
(thousands of images); a short pass loses, which is why it is a setting and off by default
(``benchmarks/results/speed/compile_noamx.json``).

Two things keep it from costing more than it gives:

* one graph: the pass is compiled for the batch size of its first call, and a shorter (last) batch is padded
  with zeros up to it and the padding cut from the output (a tower in eval mode treats every image on its own),
  so the last batch never triggers a second compilation; a longer one runs eagerly;
* a fallback: inductor needs a C++ compiler at run time; if the first compiled call fails for that or any other
  reason, a warning names the reason and the pass carries on eagerly, with the same results.
"""
from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn as nn


def _warn_failed(what: str, e: Exception, then: str) -> None:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    warnings.warn(f"torch.compile of {what} failed ({type(e).__name__}: {first}); {then}", RuntimeWarning,
                  stacklevel=3)


class CompiledPass:
    """``fn(x, *args)`` (a tower's forward or ``forward_prefix``) compiled once for ``x``'s first batch size."""

    def __init__(self, fn: Callable[..., torch.Tensor], what: str = "the tower pass"):
        self.eager, self.what = fn, what
        self.compiled = torch.compile(fn, dynamic=False, options={"freezing": True})
        self.batch: int | None = None
        self.state = "new"   # new -> compiled (the first call worked) | eager (it failed)

    def __call__(self, x: torch.Tensor, *args) -> torch.Tensor:
        n = x.shape[0]
        if self.state == "eager" or (self.batch is not None and n > self.batch):
            return self.eager(x, *args)
        if self.batch is None:
            self.batch = n
        padded = x if n == self.batch else torch.cat([x, x.new_zeros((self.batch - n, *x.shape[1:]))])
        try:
            out = self.compiled(padded, *args)[:n]
        except Exception as e:   # no C++ compiler, an inductor limitation: the eager pass gives the same results
            if self.state == "compiled":   # it compiled and ran before: a real error, not a missing compiler
                raise
            _warn_failed(self.what, e, "running it eagerly")
            self.state = "eager"
            return self.eager(x, *args)
        self.state = "compiled"
        return out


class CompiledStep(nn.Module):
    """The trainer's feature module (``FeatureModel``, or DDP around it) through ``torch.compile`` (``train.compile``).

    Inductor fuses the element-wise work between the matrix products (norms, GELU, residual adds, the autocast
    casts) in the forward and in the backward AOTAutograd derives from it. The gain per step is small
    (``benchmarks/results/speed/train_noamx.json``, arm ``clip_mini_compiled``); it costs seconds to tens of
    seconds of compilation for the first batch, again for the first batch of another shape (then compiled for any
    length), and for accumulation's gradient-free first pass, so it pays only over a run of many steps and is off by
    default.

    The same fallback as ``CompiledPass``: if the first compiled call fails (no C++ compiler, an inductor
    limitation) a warning names the reason and training carries on eagerly; the weights are the module's own, so
    checkpoints and the optimiser see no difference. Dropout under inductor draws its masks from a seed taken
    from torch's generator, so accumulation's restore-the-RNG re-forward still reproduces them
    (``tests/test_train_compile.py``)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.eager = module
        # Not a submodule: the same parameters must not be reached twice (DDP, parameters()). Shapes are not
        # fixed: captions are padded to the longest of their batch, so the sequence length changes from step to
        # step. torch.compile's automatic dynamic shapes recompile once, on the first change, for any length;
        # dynamic=False would recompile for every new length (seconds each).
        object.__setattr__(self, "compiled", torch.compile(module))
        self.state = "new"   # new -> compiled (the first call worked) | eager (it failed)

    def forward(self, *args):
        if self.state == "eager":
            return self.eager(*args)
        try:
            out = self.compiled(*args)
        except Exception as e:
            if self.state == "compiled":   # it compiled and ran before: a real error, not a missing compiler
                raise
            _warn_failed("the training step", e, "training eagerly")
            self.state = "eager"
            return self.eager(*args)
        self.state = "compiled"
        return out

    def no_sync(self):
        """DDP's ``no_sync`` when the compiled module is DDP (accumulation's non-final micro-batches), else nothing."""
        return self.eager.no_sync() if hasattr(self.eager, "no_sync") else nullcontext()
