"""The open_clip peer of the quality benchmark: open_clip's own CLIP, from scratch, under a wall-clock budget.

    python benchmarks/quality/openclip_peer.py --config configs/flickr8k.yaml [--set key=value ...] --budget-s 1800 \
        --result runs/quality/openclip/result.json

The model is ``open_clip.CLIP(embed_dim, vision_cfg, text_cfg)`` built from a custom tiny config (nothing is
downloaded): a ViT of width 192 and 4 blocks whose patch size gives an 8 x 8 grid at the data pipeline's
resolution (the issue's 64 px / patch 8 has the same grid), and a text transformer of width 192 and 4 layers
over open_clip's BPE tokenizer (``SimpleTokenizer``, whose vocabulary ships inside the package). It trains with
open_clip's ``ClipLoss``, AdamW as open_clip's trainer sets it up (no weight decay on biases, norms and
``logit_scale``; eps 1e-6), open_clip_train's warmup + cosine schedule, and ``logit_scale`` clamped to ln(100)
after every step.

Everything else is clip_mini's, so the comparison is of models and recipes only: the config's split, the image
pipeline (decoded-image cache, the same seeded random-resized crop and colour jitter), one caption per image
per epoch, the batch size, bf16 autocast, and the multi-caption metrics of ``clip_mini.eval.metrics``. Val is scored
after every epoch and the best state (``train.best_metric``) is kept, as the trainer keeps ``best/``; at the
end the best and the final state are scored on test (``--final`` only: races report val), inside one line of the
test ledger (``clip_mini.eval.ledger.record_test_scoring``: written before the test split is scored).

Budget: counted from this process's start. The schedule length is fitted during the warmup: the first steps
are timed, then the step count is fixed so that training, the per-epoch evaluations and the two test
evaluations end inside the budget. A run that still falls behind stops early, at an evaluation.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

START = time.time()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

WIDTH, LAYERS, HEAD_WIDTH, GRID = 192, 4, 64, 8
TIMED_STEPS = 8       # steps timed before the schedule is fixed (the first two, warm-up, are not counted)
SAFETY = 0.97         # share of the time left that the fitted schedule may plan for


class BpeTokenizer:
    """open_clip's ``SimpleTokenizer`` behind the call ``clip_mini.data.CaptionCollate`` makes."""

    def __init__(self, context_length: int):
        from open_clip.tokenizer import SimpleTokenizer

        self.tokenizer = SimpleTokenizer(context_length=context_length)
        self.vocab_size = self.tokenizer.vocab_size

    def __call__(self, texts, **_) -> dict[str, torch.Tensor]:
        # Padding to context_length and truncation (keeping the end-of-text token) are SimpleTokenizer's own.
        ids = self.tokenizer(list(texts))   # (B, context_length)
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def build_model(image_size: int, embed_dim: int, context_length: int, vocab_size: int):
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    if image_size % GRID:
        raise SystemExit(f"error: model.vision.image_size={image_size} is not a multiple of {GRID}: the open_clip "
                         f"peer uses an {GRID}x{GRID} patch grid")
    vision = CLIPVisionCfg(layers=LAYERS, width=WIDTH, head_width=HEAD_WIDTH, patch_size=image_size // GRID,
                           image_size=image_size)
    text = CLIPTextCfg(context_length=context_length, vocab_size=vocab_size, width=WIDTH,
                       heads=WIDTH // HEAD_WIDTH, layers=LAYERS)
    return CLIP(embed_dim=embed_dim, vision_cfg=vision, text_cfg=text)


def build_optimizer(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """open_clip_train's parameter groups: 1-d tensors, norms, biases and logit_scale get no weight decay."""
    def no_decay(name: str, p: torch.Tensor) -> bool:
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0},
              {"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": weight_decay}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6)


@torch.inference_mode()
def evaluate(model, df, tokenizer, transform, cache, batch_size: int, precision: str, workers: int) -> dict:
    """Multi-caption recall@K and median rank of the open_clip model on a split table."""
    from torch.utils.data import DataLoader

    from clip_mini.data import ImageDataset
    from clip_mini.eval.metrics import retrieval_metrics
    from clip_mini.train.accum import autocast
    from clip_mini.train.frozen import split_paths

    model.eval()
    cpu = torch.device("cpu")
    loader = DataLoader(ImageDataset(split_paths(df), transform, cache), batch_size=batch_size, num_workers=workers)
    image_features = []
    for pixels, _, ok in loader:
        with autocast(cpu, precision):
            feats = model.encode_image(pixels, normalize=True).float()
        image_features.append(feats * ok[:, None])   # an unreadable image: a zero row that never hits
    captions = df["caption"].astype(str).tolist()
    text_features = []
    for s in range(0, len(captions), batch_size):
        with autocast(cpu, precision):
            text_features.append(model.encode_text(tokenizer(captions[s:s + batch_size])["input_ids"],
                                                   normalize=True).float())
    model.train()
    return retrieval_metrics(torch.cat(image_features), torch.cat(text_features), df["image_id"].to_numpy().copy())


def fit_steps(time_left: float, step_s: float, eval_s: float, steps_per_epoch: int, done: int) -> int:
    """Total steps whose training and evaluations fit ``time_left`` seconds (the steps ``done`` included).

    Whole epochs, each followed by a val evaluation, when one fits; else as many steps as fit before one.
    """
    left = time_left * SAFETY
    epochs = int((left + done * step_s) // (steps_per_epoch * step_s + eval_s))
    if epochs >= 1:
        return epochs * steps_per_epoch
    return max(done, done + int((left - eval_s) // step_s))


def _key(metric: str) -> str:
    return metric[4:] if metric.startswith("val_") else metric


def train_peer(cfg, budget_s: float, final: bool = False, config: str | os.PathLike | None = None) -> dict:
    """Train and score the peer as the module docstring says; returns the result dict.

    ``config``: the file ``cfg`` was read from, for the test ledger's line (``--final``)."""
    from open_clip.loss import ClipLoss
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    from open_clip_train.scheduler import cosine_lr

    from clip_mini.config import PreprocessConfig
    from clip_mini.data import build_eval_transform
    from clip_mini.train.accum import autocast
    from clip_mini.train.inputs import build_train_inputs, load_splits, make_image_cache

    t, deadline, cpu = cfg.train, START + budget_s, torch.device("cpu")
    if t.accum_freq != 1:
        raise SystemExit(f"error: the open_clip peer trains without accumulation; got train.accum_freq={t.accum_freq}")
    torch.set_num_threads(t.threads or len(os.sched_getaffinity(0)))
    splits = load_splits(cfg, progress=False)
    if not len(splits["val"]) or (final and not len(splits["test"])):
        raise SystemExit("error: the open_clip peer needs non-empty val (and, with --final, test) splits "
                         "(set data.val and data.test)")
    pre = PreprocessConfig(image_size=cfg.model.vision.image_size, mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD,
                           resize_mode=cfg.model.vision.resize_mode)
    cache = make_image_cache(cfg, pre, splits)
    tokenizer = BpeTokenizer(cfg.model.text.max_length)
    torch.manual_seed(t.seed)
    model = build_model(pre.image_size, cfg.model.embed_dim, cfg.model.text.max_length, tokenizer.vocab_size)
    optimizer = build_optimizer(model, t.lr, t.weight_decay)
    loss_fn = ClipLoss()
    inputs = build_train_inputs(cfg, splits["train"], pre, tokenizer, cfg.model.text.max_length, cache=cache)
    spe = inputs.steps_per_epoch
    if spe == 0:
        raise SystemExit(f"error: the train split has fewer images than one batch of {t.batch_size}")
    transform = build_eval_transform(pre)
    scoring = dict(tokenizer=tokenizer, transform=transform, cache=cache, batch_size=t.eval_batch_size,
                   precision=t.precision, workers=cfg.data.workers)
    tick = time.time()
    baseline = evaluate(model, splits["val"], **scoring)
    eval_s = time.time() - tick
    n_img = {k: df["image_id"].nunique() for k, df in splits.items()}
    # the test scoring of best and final at the end (--final only)
    reserve = 2 * eval_s * n_img["test"] / n_img["val"] if final else 0.0
    print(f"openclip: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {spe} steps/epoch; "
          f"val eval {eval_s:.1f} s; untrained val rsum {baseline['rsum']:.3f}", flush=True)

    best_key = _key(t.best_metric)
    lower_better = best_key.endswith("medr")
    step, epoch, total, scheduler, step_s, stopped_early = 0, 0, None, None, None, False
    best, best_state, epochs_log, timed = None, None, [], []
    while total is None or step < total:
        for micro in inputs.loader(epoch):
            batch = micro[0]
            tick = time.time()
            # lr: linear warmup until the schedule is fixed, then open_clip_train's warmup + cosine
            if scheduler:
                scheduler(step)
            else:
                for g in optimizer.param_groups:
                    g["lr"] = t.lr * min(1.0, (step + 1) / max(1, t.warmup_steps))
            with autocast(cpu, t.precision):
                image_features, text_features, logit_scale = model(batch["pixels"], batch["input_ids"])
                loss = loss_fn(image_features.float(), text_features.float(), logit_scale.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            timed.append(time.time() - tick)
            if total is None and step == TIMED_STEPS:
                # fix the schedule: the time per step from the timed steps (the first two warm up the kernels)
                step_s = sum(timed[2:]) / len(timed[2:])
                total = fit_steps(deadline - time.time() - reserve, step_s, eval_s, spe, step)
                scheduler = cosine_lr(optimizer, t.lr, t.warmup_steps, total)
                print(f"openclip: {step_s:.3f} s/step; schedule fitted to {total} steps "
                      f"({total / spe:.1f} epochs)", flush=True)
            if total is not None and step >= total:
                break
            if time.time() + eval_s + reserve > deadline:   # behind the plan: stop at an evaluation
                stopped_early = True
                break
        epoch += 1
        tick = time.time()
        val = evaluate(model, splits["val"], **scoring)
        epochs_log.append({"epoch": epoch, "step": step, "loss": loss.item(), "eval_s": round(time.time() - tick, 1),
                           "time_s": round(time.time() - START, 1), **{f"val_{k}": v for k, v in val.items()}})
        print(f"openclip: epoch {epoch} step {step}: val rsum {val['rsum']:.3f} t2i R@5 {val['t2i_r5']:.3f}",
              flush=True)
        if best is None or (val[best_key] < best["val"][best_key] if lower_better else
                            val[best_key] > best["val"][best_key]):
            best, best_state = {"epoch": epoch, "step": step, "val": val}, copy.deepcopy(model.state_dict())
        if stopped_early:
            break

    # -- test (--final only): the final state, then the best one (the same state when the last epoch was the best)
    last = {"epoch": epoch, "step": step, "val": val}
    if final:
        from clip_mini.eval.ledger import config_hash, record_test_scoring

        # the variant's name in quality_flickr8k.py, the only caller that passes --final
        with record_test_scoring(variant="openclip", source="benchmarks/quality/openclip_peer.py --final",
                                 config=config, config_hash=config_hash(cfg.to_dict())) as line:
            last["test"] = evaluate(model, splits["test"], **scoring)
            if best["epoch"] == epoch:
                best["test"] = last["test"]
            else:
                model.load_state_dict(best_state)
                best["test"] = evaluate(model, splits["test"], **scoring)
            line.test = {"best": best["test"], "final": last["test"]}
            line.test_images = n_img["test"]
    return {"model": {"embed_dim": cfg.model.embed_dim, "width": WIDTH, "layers": LAYERS, "grid": GRID,
                      "image_size": pre.image_size, "patch_size": pre.image_size // GRID,
                      "context_length": cfg.model.text.max_length, "vocab_size": tokenizer.vocab_size,
                      "params": sum(p.numel() for p in model.parameters())},
            "tokenizer": "open_clip SimpleTokenizer (BPE, shipped with open_clip)",
            "optimizer": {"lr": t.lr, "weight_decay": t.weight_decay, "betas": [0.9, 0.98], "eps": 1e-6,
                          "warmup_steps": t.warmup_steps, "schedule": "open_clip_train cosine_lr"},
            "steps_per_epoch": spe, "steps_planned": total, "steps_done": step, "epochs_done": epoch,
            "step_s": step_s and round(step_s, 4), "val_eval_s": round(eval_s, 1), "stopped_early": stopped_early,
            "split_images": n_img, "untrained_val": baseline, "epochs": epochs_log, "best": best, "final": last,
            "wall_s": round(time.time() - START, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/flickr8k.yaml"))
    p.add_argument("--set", action="append", default=[], help="config override (data.*, train.* are used)")
    p.add_argument("--budget-s", type=float, required=True, help="wall-clock budget from this process's start")
    p.add_argument("--result", required=True, help="JSON written here (atomically)")
    p.add_argument("--final", action="store_true", help="also score the best and final states on the test split")
    args = p.parse_args(argv)
    from clip_mini.config import load_config
    from clip_mini.fileio.atomic import atomic_write_json

    result = train_peer(load_config(args.config, args.set), args.budget_s, args.final, args.config)
    atomic_write_json(args.result, result)
    split = "test" if args.final else "val"
    print(f"openclip: best epoch {result['best']['epoch']}: {split} t2i R@5 {result['best'][split]['t2i_r5']:.3f}; "
          f"final: {result['final'][split]['t2i_r5']:.3f}; {result['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
