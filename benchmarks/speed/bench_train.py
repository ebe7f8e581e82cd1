"""Speed of a full training step: clip_mini against open_clip at equal size, and the tiny and flickr8k configs.

    python benchmarks/speed/bench_train.py [--rounds 8] [--peer-batches 128 64]
        [--configs tiny flickr8k flickr8k-pixels flickr8k-compiled]

**Peer** (``peer`` in the JSON): clip_mini's own step (``forward_backward``, its AdamW groups, gradient clipping,
``optimizer.step``, the logit-scale clamp) against open_clip's (``open_clip.CLIP`` built as
``benchmarks/quality/openclip_peer.py`` builds it, open_clip's ``ClipLoss``, bf16 autocast as open_clip_train's
``amp_bf16``, AdamW, clamp) at open_clip's tiny-CLIP size: ViT 64 px / patch 8 / width 192 / 4 blocks / 3 heads,
text width 192 / 4 layers / 3 heads / MLP 768 / vocab 8192 / 32 tokens, embed 128, linear heads; random
tensors (model-only), same threads. The steps run interleaved, round by round, each round also timing this
CPU's fp32 and bf16 matmul peaks, so other processes on the cores slow every column alike; medians are reported.
Two clip_mini columns each leave out one lever (plain attention in the training pass, fused AdamW), one adds
``train.compile`` (the step's forward and backward through torch.compile; compiled during the warm-up rounds), two
hold the weights in bf16 with fp32 master copies in AdamW, eager and compiled (an experiment: what dropping
autocast's per-op casts would give; not a training option), and a last one runs open_clip under PyTorch's math
SDPA backend (``sdpa_kernel(SDPBackend.MATH)``) to show how much of the gap is the attention kernel (see
``clip_mini/model/layers/kernels.py``). Skipped with a message when ``open_clip_torch`` (extra ``bench``) is missing.

**Configs**: real batches from the real loader (cache on, as in training), ``forward_backward`` + gradient
clipping + ``optimizer.step`` timed step by step. ``flickr8k`` trains on precomputed features of its locked image
tower (``train.frozen_features``): its step is the image head, the text tower and the loss, and the one-time
pass over the images is timed separately; ``flickr8k-pixels`` is the same model running the tower every step;
``flickr8k-compiled`` the same step with ``train.compile`` (timed after 4 more warm-up steps, which compile);
``flickr8k-torch-dropout`` the same step with the text tower's dropout on torch's own mask instead of
``clip_mini/model/layers/dropout.py``'s (``--out benchmarks/results/speed/train_dropout.json``: what that lever gives).

**Allocator**: the whole process runs with freed memory kept (``clip_mini/runtime/allocator.py``, as ``train.py`` and
``clip-mini`` set it), open_clip's arms included; ``--plain-malloc`` leaves glibc's defaults
(``--out benchmarks/results/speed/train_plain_malloc.json``: what that lever gives); ``--trim-mib N`` keeps N MiB of free
heap top instead of the allocator's default (``--configs flickr8k-pixels --peer-batches --trim-mib 512 --out
benchmarks/results/speed/train_trim512.json``, and the default as ``benchmarks/results/speed/train_trim2047.json``: what the
larger default gives the step that runs the towers on pixels). Every timed step also records its
page faults and kernel CPU seconds (``page_faults_per_step``, ``kernel_cpu_s_per_step``), medians in the peer.

``step_profile_s``: where the eager step's time goes (matrix products, GELU, LayerNorm, copies and casts, softmax,
optimizer, other), per step, from ``torch.profiler`` after the timed rounds.

FLOPs of one step are counted by ``torch.utils.flop_counter`` (matrix products, convolutions and attention,
forward and backward; AdamW's element-wise work is not counted); achieved GFLOP/s are read against the fp32
matmul peak of the same run. Prints JSON and writes ``benchmarks/results/speed/train.json`` with the 1-minute load
average at start and end (``--out benchmarks/results/speed/train_noamx.json`` for the runs on a CPU without AMX).

The tiny config reads ``data/shapes`` (generated into a temporary folder if absent); flickr8k reads
``../shared/data/flickr8k`` and is skipped when that is absent.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, matmul_peak, write_result  # noqa: E402
FLICKR8K = ROOT.parent / "shared/data/flickr8k/captions.csv"


# -- the peer: clip_mini vs open_clip at open_clip's tiny-CLIP size, model-only -------------------------------
PEER_VOCAB, PEER_TOKENS, PEER_IMAGE = 8192, 32, 64


def _clip_mini_step(batch_size: int, lever_off: str | None = None, compiled: bool = False,
                    bf16_weights: bool = False, precision: str = "bf16"):
    """clip_mini's training step at the peer size, as ``train.loop`` runs it; returns (step, flop-counted pass).

    ``lever_off``: run it without one speed lever, to measure what that lever gives: ``"plain_attention"`` (the
    fused SDPA kernel in the training pass too) or ``"fused_adamw"`` (AdamW's default foreach implementation).
    ``compiled``: with ``train.compile`` on (the forward and backward through torch.compile, ``CompiledStep``).
    ``bf16_weights``: an experiment, not a training option: the model's weights held in bf16 (no autocast, so no
    per-op casts; the 0-d ``logit_scale`` stays fp32), AdamW on fp32 master copies of them (bf16 gradients
    widened into the masters' ``.grad``, clipped there, the stepped masters rounded back into the model), as
    mixed-precision training with master weights does. It measures what removing autocast's casts could give.
    ``precision``: the step's autocast, "bf16" or "fp32" (no autocast: what ``precision: auto`` trains at on a
    CPU without native bf16).
    """
    from contextlib import ExitStack
    from unittest import mock

    import torch.nn as nn

    from clip_mini.config import ModelConfig, TextConfig, TrainConfig, VisionConfig
    from clip_mini.model.loss import ClipLoss
    from clip_mini.model.clip import CLIPModel
    from clip_mini.train.accum import FeatureModel, forward_backward
    from clip_mini.train.optim import build_optimizer, param_groups, set_train_mode

    cfg = ModelConfig(vision=VisionConfig(image_size=PEER_IMAGE, patch_size=8, width=192, depth=4, heads=3),
                      text=TextConfig(dim=192, n_layers=4, n_heads=3, hidden_dim=768, dropout=0.0,
                                      max_length=PEER_TOKENS),
                      embed_dim=128, head="linear", head_dropout=0.0)
    t = TrainConfig(lr=5e-4, precision=precision)
    torch.manual_seed(0)
    model = CLIPModel(cfg, vocab_size=PEER_VOCAB)
    optimizer = build_optimizer(model, t)
    if lever_off == "fused_adamw":
        optimizer = torch.optim.AdamW(param_groups(model, t), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    if bf16_weights:
        groups = param_groups(model, t)
        master = {id(p): nn.Parameter(p.detach().float().clone()) for g in groups for p in g["params"]}
        pairs = [(p, master[id(p)]) for g in groups for p in g["params"]]
        optimizer = torch.optim.AdamW([{**g, "params": [master[id(p)] for p in g["params"]]} for g in groups],
                                      lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fused=True)
        for p in model.parameters():
            if p.ndim:
                p.data = p.data.to(torch.bfloat16)
    features, loss_fn, cpu = FeatureModel(model), ClipLoss(), torch.device("cpu")
    if compiled:
        from clip_mini.model.layers.compile_pass import CompiledStep

        features = CompiledStep(features)
    set_train_mode(model, True)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    batch = {"pixels": torch.randn(batch_size, 3, PEER_IMAGE, PEER_IMAGE, generator=g,
                                   dtype=torch.bfloat16 if bf16_weights else torch.float32),
             "input_ids": torch.randint(5, PEER_VOCAB, (batch_size, PEER_TOKENS), generator=g),
             "attention_mask": torch.ones(batch_size, PEER_TOKENS, dtype=torch.long),
             "image_ids": torch.arange(batch_size)}

    def kernels():
        stack = ExitStack()
        if lever_off == "plain_attention":   # the towers ask clip_mini.model.layers.kernels; answer "fused" every time
            for module in ("clip_mini.model.vision", "clip_mini.model.text"):
                stack.enter_context(mock.patch(f"{module}.fused_attention", lambda x: True))
        return stack

    precision = "fp32" if bf16_weights else t.precision   # bf16 weights: no autocast

    def step() -> None:
        with kernels():
            forward_backward(features, [batch], loss_fn, cpu, precision)
        if bf16_weights:
            for p, m in pairs:
                m.grad, p.grad = p.grad.float(), None
            torch.nn.utils.clip_grad_norm_([m for _, m in pairs], t.grad_clip)
            optimizer.step()
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        else:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            optimizer.step()
        model.clamp_logit_scale()
        optimizer.zero_grad(set_to_none=True)

    def counted() -> None:
        with kernels():
            forward_backward(features, [batch], loss_fn, cpu, precision)
        model.zero_grad(set_to_none=True)
    return step, counted


def _open_clip_step(batch_size: int, math_sdpa: bool = False, precision: str = "bf16"):
    """open_clip's step at the same size (bf16 autocast as open_clip_train's ``amp_bf16``, or fp32 as its
    ``--precision fp32``; its ClipLoss, AdamW as open_clip_train sets it up)."""
    from contextlib import nullcontext

    from open_clip.loss import ClipLoss
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.quality.openclip_peer import build_model, build_optimizer

    torch.manual_seed(0)
    model = build_model(PEER_IMAGE, 128, PEER_TOKENS, PEER_VOCAB)
    model.train()
    optimizer, loss_fn = build_optimizer(model, 5e-4, 0.1), ClipLoss()
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(batch_size, 3, PEER_IMAGE, PEER_IMAGE, generator=g)
    ids = torch.randint(1, PEER_VOCAB, (batch_size, PEER_TOKENS), generator=g)

    def forward_backward() -> None:
        with sdpa_kernel(SDPBackend.MATH) if math_sdpa else nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                image_features, text_features, logit_scale = model(pixels, ids)
                loss = loss_fn(image_features.float(), text_features.float(), logit_scale.float())
            loss.backward()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        forward_backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    def counted() -> None:
        forward_backward()
        optimizer.zero_grad(set_to_none=True)
    return step, counted


def _flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# torch.profiler op names, grouped: where an eager step's time goes (self time, so nothing is counted twice)
PROFILE_GROUPS = {
    "matrix_products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::mkldnn_convolution",
                        "aten::convolution_backward"),
    "gelu": ("aten::gelu", "aten::gelu_backward"),
    "layer_norm": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
    "copies_and_casts": ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous"),
    "softmax": ("aten::_softmax", "aten::_softmax_backward_data"),
    "optimizer_and_clipping": ("aten::_fused_adamw_", "aten::linalg_vector_norm", "aten::_foreach_norm",
                               "aten::_foreach_mul_", "aten::_foreach_copy_"),
}


def _profile(step, steps: int = 3) -> dict:
    """Seconds per step in each ``PROFILE_GROUPS`` group (and ``other``: sums for bias gradients, residual adds,
    the loss, the profiler's own cost) for an eager step, from ``torch.profiler``'s self CPU times."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    out = dict.fromkeys([*PROFILE_GROUPS, "other"], 0.0)
    for event in prof.key_averages():
        group = next((g for g, names in PROFILE_GROUPS.items() if event.key in names), "other")
        out[group] += event.self_cpu_time_total / 1e6 / steps
    out["total"] = sum(out.values())
    return {k: round(v, 4) for k, v in out.items()}


def bench_peer(batch_size: int, rounds: int, warmup: int, bf16: bool = True, compiled: bool = True) -> dict:
    """Interleaved rounds of: fp32 peak, bf16 peak, then one step of each arm. fp32 arms always (clip_mini, without
    its attention lever, compiled; open_clip): what every CPU without native bf16 trains at. bf16 arms when
    ``bf16`` (clip_mini, without each lever, compiled, bf16 weights; open_clip, open_clip under the math SDPA
    backend): where bf16 is emulated they would time the emulation, so the caller passes the hardware rule.
    ``compiled=False`` leaves the compiled arms out (inductor's compile of the step took over 15 minutes of one core
    on the 2-core AVX2 EPYC)."""
    import statistics

    fp32_arms = {"clip_mini_fp32": _clip_mini_step(batch_size, precision="fp32"),
                 "clip_mini_fp32_without_plain_attention": _clip_mini_step(batch_size, "plain_attention",
                                                                           precision="fp32"),
                 "clip_mini_fp32_compiled": _clip_mini_step(batch_size, compiled=True, precision="fp32"),
                 "open_clip_fp32": _open_clip_step(batch_size, precision="fp32")}
    bf16_arms = {"clip_mini": _clip_mini_step(batch_size),
                 "clip_mini_without_plain_attention": _clip_mini_step(batch_size, "plain_attention"),
                 "clip_mini_without_fused_adamw": _clip_mini_step(batch_size, "fused_adamw"),
                 "clip_mini_compiled": _clip_mini_step(batch_size, compiled=True),
                 "clip_mini_bf16_weights": _clip_mini_step(batch_size, bf16_weights=True),
                 "clip_mini_bf16_weights_compiled": _clip_mini_step(batch_size, compiled=True, bf16_weights=True),
                 "open_clip": _open_clip_step(batch_size),
                 "open_clip_math_sdpa": _open_clip_step(batch_size, math_sdpa=True)} if bf16 else {}
    arms = {name: arm for name, arm in {**fp32_arms, **bf16_arms}.items()
            if compiled or not name.endswith("_compiled")}
    # a compiled arm does its eager twin's arithmetic; FlopCounterMode cannot see inside an inductor graph
    flops = {name: _flops(counted) for name, (_, counted) in arms.items() if not name.endswith("_compiled")}
    for name in arms:
        if name.endswith("_compiled"):
            flops[name] = flops[name[:-len("_compiled")]]
    for _ in range(warmup):   # the compiled arm compiles here
        for step, _ in arms.values():
            step()
    times: dict[str, list] = {name: [] for name in arms}
    faults: dict[str, list] = {name: [] for name in arms}
    kernel: dict[str, list] = {name: [] for name in arms}
    peaks: dict[str, list] = {"fp32": [], "bf16": []}
    for _ in range(rounds):
        peaks["fp32"].append(matmul_peak(torch.float32, seconds=0.3))
        if bf16:   # without native bf16 one emulated 2048^3 product takes minutes of one core
            peaks["bf16"].append(matmul_peak(torch.bfloat16, seconds=0.3))
        for name, (step, _) in arms.items():
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            faults[name].append(r1.ru_minflt - r0.ru_minflt)
            kernel[name].append(r1.ru_stime - r0.ru_stime)
    fp32 = statistics.median(peaks["fp32"])
    bf16_peak = statistics.median(peaks["bf16"]) if bf16 else None
    out = {"batch_pairs": batch_size, "rounds": rounds, "compiled_arms": compiled, "fp32_matmul_peak_gflops": fp32,
           "bf16_matmul_peak_gflops": bf16_peak, "bf16_arms": bf16,
           "step_profile_s": {name: _profile(arms[name][0]) for name in
                              ("clip_mini_fp32", "clip_mini", "clip_mini_bf16_weights") if name in arms}}
    for name in arms:
        step_s = statistics.median(times[name])
        gflops = flops[name] / 1e9 / step_s
        out[name] = {"step_s": step_s, "pairs_per_s": batch_size / step_s, "gflop_per_step": flops[name] / 1e9,
                     "achieved_gflops": gflops, "fraction_of_fp32_peak": gflops / fp32,
                     "fraction_of_bf16_peak": gflops / bf16_peak if bf16_peak else None, "step_s_all": times[name],
                     "page_faults_per_step": statistics.median(faults[name]),
                     "kernel_cpu_s_per_step": statistics.median(kernel[name])}
    out["fp32_speedup_vs_open_clip_fp32"] = out["open_clip_fp32"]["step_s"] / out["clip_mini_fp32"]["step_s"]
    if compiled:
        out["fp32_compiled_speedup_vs_open_clip_fp32"] = (out["open_clip_fp32"]["step_s"]
                                                          / out["clip_mini_fp32_compiled"]["step_s"])
    out["fp32_plain_attention_gain"] = (out["clip_mini_fp32_without_plain_attention"]["step_s"]
                                        / out["clip_mini_fp32"]["step_s"])
    if not bf16:
        return out
    out["speedup_vs_open_clip"] = out["open_clip"]["step_s"] / out["clip_mini"]["step_s"]
    out["speedup_vs_open_clip_math_sdpa"] = out["open_clip_math_sdpa"]["step_s"] / out["clip_mini"]["step_s"]
    out["plain_attention_gain"] = out["clip_mini_without_plain_attention"]["step_s"] / out["clip_mini"]["step_s"]
    out["fused_adamw_gain"] = out["clip_mini_without_fused_adamw"]["step_s"] / out["clip_mini"]["step_s"]
    out["bf16_weights_gain"] = out["clip_mini"]["step_s"] / out["clip_mini_bf16_weights"]["step_s"]
    if compiled:
        out["compile_gain"] = out["clip_mini"]["step_s"] / out["clip_mini_compiled"]["step_s"]
        out["bf16_weights_compiled_gain"] = (out["clip_mini"]["step_s"]
                                             / out["clip_mini_bf16_weights_compiled"]["step_s"])
        out["compiled_speedup_vs_open_clip"] = out["open_clip"]["step_s"] / out["clip_mini_compiled"]["step_s"]
    return out


def _config(name: str, tmp: Path):
    from clip_mini.config import load_config

    overrides = [f"train.out_dir={tmp / name}"]
    if name == "tiny":
        captions = ROOT / "data/shapes/captions.csv"
        if not captions.is_file():
            from clip_mini.data import generate

            captions = generate(tmp / "shapes", n=1500) / "captions.csv"
        overrides.append(f"data.captions={captions}")
    elif name.startswith("flickr8k"):
        if not FLICKR8K.is_file():
            return None
        overrides.append(f"data.captions={FLICKR8K}")
        if name == "flickr8k-pixels":   # the same model with the locked tower run at every step
            overrides.append("train.frozen_features=0")
        if name == "flickr8k-compiled":   # the same step through torch.compile (train.compile)
            overrides.append("train.compile=true")
    return load_config(ROOT / f"configs/{name.split('-')[0]}.yaml", overrides)


def bench_config(cfg, tmp: Path, steps: int, warmup: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from clip_mini.model.loss import ClipLoss
    from clip_mini.train.accum import FeatureModel, forward_backward
    from clip_mini.train.build import build_model, save_tokenizer
    from clip_mini.train.inputs import build_train_inputs, load_splits, make_image_cache
    from clip_mini.train.optim import build_optimizer, freeze_towers, set_train_mode

    t = cfg.train
    splits = load_splits(cfg, progress=False)
    save_tokenizer(cfg, splits["train"]["caption"].tolist(), tmp / "tokenizer")
    torch.manual_seed(0)
    model = build_model(cfg, tmp / "tokenizer")
    freeze_towers(model)
    optimizer = build_optimizer(model, t)
    features, loss_fn, device = FeatureModel(model), ClipLoss(), torch.device("cpu")
    eager_features = features   # FLOPs are counted eagerly: FlopCounterMode cannot see inside an inductor graph
    if t.compile:
        from clip_mini.model.layers.compile_pass import CompiledStep

        features = CompiledStep(features)
        warmup += 4   # compiled at the first batch and again at the first other caption length
    cache = make_image_cache(cfg, model.preprocess, splits)
    feature_pass = None
    if t.frozen_features:
        inputs, feature_pass = _frozen_inputs(cfg, model, splits["train"], cache, device)
    else:
        inputs = build_train_inputs(cfg, splits["train"], model.preprocess, model.tokenizer,
                                    model.cfg.text.max_length, cache=cache)
    params = [p for p in model.parameters() if p.requires_grad]
    set_train_mode(model, True)

    def step(micro) -> None:
        forward_backward(features, micro, loss_fn, device, t.precision)
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    waits, totals, faults, kernel, epoch = [], [], [], [], 0
    batches = iter(inputs.loader(epoch))
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        try:
            micro = next(batches)
        except StopIteration:
            epoch += 1
            batches = iter(inputs.loader(epoch))
            micro = next(batches)
        t1, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        step(micro)
        if i >= warmup:
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            waits.append(t1 - t0)
            totals.append(time.perf_counter() - t0)
            faults.append(r1.ru_minflt - r0.ru_minflt)
            kernel.append(r1.ru_stime - r0.ru_stime)
    with FlopCounterMode(display=False) as counter:
        forward_backward(eager_features, micro, loss_fn, device, t.precision)
    optimizer.zero_grad(set_to_none=True)
    flops = counter.get_total_flops()
    pairs = t.batch_size * t.accum_freq
    step_s = sum(totals) / len(totals)
    return {
        "image_tower": f"{cfg.model.vision.backbone} {cfg.model.vision.image_size}px"
                       + (f" + {cfg.model.vision.concat} {cfg.model.vision.concat_size}px "
                          f"{cfg.model.vision.concat_pooling}" if cfg.model.vision.concat else "")
                       + ("" if cfg.model.vision.trainable else " (frozen)"),
        "text_tower": cfg.model.text.pretrained or f"distilbert dim {cfg.model.text.dim}",
        "batch_pairs": pairs, "precision": t.precision, "threads": torch.get_num_threads(),
        "trainable_params": sum(p.numel() for p in params), "step_s": step_s, "pairs_per_s": pairs / step_s,
        "gflop_per_step": flops / 1e9, "achieved_gflops": flops / 1e9 / step_s,
        "data_wait_fraction": sum(waits) / sum(totals), "image_cache": cache is not None,
        "data_workers": cfg.data.workers, "frozen_features": t.frozen_features, "compiled": t.compile,
        "frozen_feature_pass": feature_pass, "steps_timed": len(totals),
        "page_faults_per_step": sum(faults) / len(faults), "kernel_cpu_s_per_step": sum(kernel) / len(kernel),
    }


def _frozen_inputs(cfg, model, df, cache, device, images: int = 256):
    """Batches of precomputed tower features, and the images/s of the one-time pass that computes them.

    The step reads random rows of the right shape (what they hold does not change the step's cost); the one-time
    pass is timed on ``images`` real images through the tower, as ``train.frozen_features`` runs it.
    """
    from clip_mini.data import build_eval_transform
    from clip_mini.train import frozen as frozen_io

    n = df["image_id"].nunique()
    feats = torch.randn(cfg.train.frozen_features, n, model.visual.width)
    inputs = frozen_io.build_frozen_train_inputs(cfg, df, feats, torch.ones(n, dtype=torch.bool), model.tokenizer,
                                                 model.cfg.text.max_length)
    paths = frozen_io.split_paths(df)[:images]
    ds = frozen_io._ViewDataset(paths, build_eval_transform(model.preprocess), None, cache, cfg.train.seed)
    frozen_io.compute_view(model, ds, 0, 64, device, cfg.train.precision, cfg.data.workers, "warm-up")
    t0 = time.perf_counter()
    frozen_io.compute_view(model, ds, 0, cfg.train.eval_batch_size, device, cfg.train.precision, cfg.data.workers,
                           "feature pass")
    per_s = len(paths) / (time.perf_counter() - t0)
    return inputs, {"images_per_s": per_s, "images_timed": len(paths),
                    "train_split_pass_s": n * cfg.train.frozen_features / per_s}


def _torch_dropout(on: bool):
    """``*-torch-dropout`` configs: the text tower's dropout back on torch's own mask (``F.dropout``), to measure
    what ``clip_mini/model/layers/dropout.py``'s cheaper mask gives."""
    from contextlib import nullcontext
    from unittest import mock

    import torch.nn.functional as F

    return mock.patch("clip_mini.model.layers.dropout.fast_dropout", lambda x, p, training=True: F.dropout(x, p, training)) \
        if on else nullcontext()


def main(argv: list[str] | None = None) -> dict:
    import importlib.util

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="interleaved peer rounds per batch size")
    p.add_argument("--peer-batches", type=int, nargs="*", default=[128, 64], help="none: skip the peer")
    p.add_argument("--bf16-arms", choices=["auto", "on", "off"], default="auto",
                   help="the peer's bf16 arms: auto runs them where the CPU computes bf16 natively (AVX512-BF16, "
                        "AMX); elsewhere they would time the emulation")
    p.add_argument("--configs", nargs="*", default=["tiny", "flickr8k", "flickr8k-pixels"],
                   help="flickr8k-pixels: configs/flickr8k.yaml with train.frozen_features=0; "
                   "flickr8k-compiled: with train.compile=true; flickr8k-torch-dropout: the text tower's dropout on "
                   "torch's own mask")
    p.add_argument("--no-compile", action="store_true", help="leave the peer's compiled arms out")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--plain-malloc", action="store_true",
                   help="leave glibc's malloc thresholds alone (train.py sets them: clip_mini/runtime/allocator.py)")
    p.add_argument("--trim-mib", type=int, default=None,
                   help="the allocator's kept free heap top in MiB (default: clip_mini.runtime.allocator's own)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/train.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    from clip_mini.runtime.isa import cpu_native_bf16

    from clip_mini.runtime.allocator import DEFAULT_TRIM_MIB, keep_freed_memory

    # process-wide, as train.py sets it: every arm runs under it, open_clip's too
    trim_mib = args.trim_mib or DEFAULT_TRIM_MIB
    kept = False if args.plain_malloc else keep_freed_memory(trim_mib)
    result = {"machine": machine_info(),   # its load average: other processes on the cores slow every number here
              "allocator": "freed memory kept (clip_mini/runtime/allocator.py)" if kept else "glibc default",
              "trim_mib": trim_mib if kept else None,
              "peer": {}, "configs": {}}
    if args.peer_batches and importlib.util.find_spec("open_clip") is None:
        result["peer"] = {"skipped": "open_clip_torch is not installed (pip install -e '.[bench]')"}
        print(f"peer: {result['peer']['skipped']}", file=sys.stderr)
    elif args.peer_batches:
        bf16 = args.bf16_arms == "on" or (args.bf16_arms == "auto" and cpu_native_bf16())
        for batch in args.peer_batches:
            r = bench_peer(batch, args.rounds, args.warmup, bf16=bf16, compiled=not args.no_compile)
            result["peer"][str(batch)] = r
            c, o = r["clip_mini_fp32"], r["open_clip_fp32"]
            print(f"peer batch {batch} fp32: clip_mini {c['pairs_per_s']:.0f} pairs/s ({c['achieved_gflops']:.0f} "
                  f"GFLOP/s, {c['fraction_of_fp32_peak']:.2f}x fp32 peak {r['fp32_matmul_peak_gflops']:.0f}), "
                  f"open_clip {o['pairs_per_s']:.0f} pairs/s ({o['fraction_of_fp32_peak']:.2f}x peak): "
                  f"{r['fp32_speedup_vs_open_clip_fp32']:.2f}x", file=sys.stderr)
            if bf16:
                c, o = r["clip_mini"], r["open_clip"]
                print(f"peer batch {batch} bf16: clip_mini {c['pairs_per_s']:.0f} pairs/s, open_clip "
                      f"{o['pairs_per_s']:.0f} pairs/s: {r['speedup_vs_open_clip']:.2f}x "
                      f"({r['speedup_vs_open_clip_math_sdpa']:.2f}x vs open_clip with math SDPA)", file=sys.stderr)
    for name in args.configs:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(name, Path(tmp))
            if cfg is None:
                result["configs"][name] = {"skipped": f"{FLICKR8K} not found"}
                continue
            with _torch_dropout(name.endswith("-torch-dropout")):
                r = bench_config(cfg, Path(tmp), args.steps, args.warmup)
            # the peaks right after the steps, so they share the steps' contention
            fp32 = matmul_peak(torch.float32)
            bf16 = matmul_peak(torch.bfloat16) if cpu_native_bf16() else None   # emulated: minutes, not a peak
            r.update(fp32_matmul_peak_gflops=fp32, bf16_matmul_peak_gflops=bf16,
                     fraction_of_fp32_peak=r["achieved_gflops"] / fp32,
                     fraction_of_bf16_peak=r["achieved_gflops"] / bf16 if bf16 else None)
            result["configs"][name] = r
        print(f"{name}: {r['pairs_per_s']:.0f} pairs/s, {r['achieved_gflops']:.0f} GFLOP/s "
              f"({r['fraction_of_fp32_peak']:.2f}x fp32 peak {fp32:.0f}), data wait {r['data_wait_fraction']:.0%}",
              file=sys.stderr)
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
