"""The training loop: ``train(cfg)`` reads top to bottom, one commented stage after another (as nanoGPT's).

Stages: set-up (processes, run dir, data, tokenizer, model, optimiser), resume, then per step: set lr,
forward/backward (with contrastive accumulation), clip, guard against non-finite values, step (and ``train.ema``'s
average), log, checkpoint; per epoch: evaluate (every ``train.eval_every``-th epoch and the last), keep the best
model, checkpoint; at the end ``final/`` and a summary table. With ``train.ema`` the average of the weights is the
model the run evaluates, keeps and ships.

``curves.png`` is drawn (matplotlib: a fraction of a second) when the run ends, finished or paused, and at an epoch
end when this process last drew it ``CURVES_EVERY_S`` or more before: a long run's picture follows it, and short
runs draw it once.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from clip_mini.config import Config, save_config
from clip_mini.runtime.devices import loader_workers
from clip_mini.model.loss import ClipLoss, SigLipLoss
from clip_mini.model.text import report_truncation
from clip_mini.train import checkpoint as ckpt_io
from clip_mini.train import init_from
from clip_mini.train.accum import FeatureModel, forward_backward
from clip_mini.train.build import (TrainError, build_model, check_run_dir, check_train_config, prepare_tokenizer,
                                   resolve_train_precision, warn_config_changes)
from clip_mini.train.clock import RunClock
from clip_mini.train.distributed import barrier, cleanup, default_threads, gather, init_distributed, rank_seed
from clip_mini.train.ema import build_ema, ema_state, load_ema_state
from clip_mini.eval.validation import evaluate_model
from clip_mini.train.inputs import load_splits
from clip_mini.train.pace import Pace
from clip_mini.train.prepare import prepare
from clip_mini.train.logbook import MetricsLog, is_better, metric_key, summary_table, write_curves
from clip_mini.train.optim import build_optimizer, freeze_towers, set_lr, set_train_mode

CURVES_EVERY_S = 60.0   # curves.png during a run: rewritten at an epoch end at most this often


def train(cfg: Config, resume: Optional[str] = None, stop_after: Optional[int] = None,
          started: Optional[float] = None) -> dict:
    """Train a model as ``cfg`` says, writing the run directory ``cfg.train.out_dir``.

    Args:
        cfg: a validated ``Config``.
        resume: None (fresh run), ``"auto"`` (newest intact checkpoint of the run, fresh if none) or a path.
        stop_after: checkpoint and return once this many steps are done (a pause; resume continues exactly).
        started: when the run's wall clock started (``time.time()``; the programs pass their process's start),
            for ``train.budget``; None: now.

    Returns:
        ``{"run_dir", "step", "epoch", "best_metric", "best_value", "val", "stopped", "time_s",
        "truncated_captions"}`` (train captions cut by model.text.max_length), and ``"ema"`` (the decay) when
        ``train.ema`` is set.
    """
    check_train_config(cfg)
    owns_group = not torch.distributed.is_initialized()
    info = init_distributed(cfg.train.device)
    with ExitStack() as stack:
        if owns_group:
            stack.callback(cleanup)
        if not info.is_main:   # rank 0 alone prints (the data loaders' messages too); errors still reach stderr
            stack.enter_context(redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        return _train(cfg, info, resume, stop_after, started)


def _train(cfg: Config, info, resume: Optional[str], stop_after: Optional[int], started: Optional[float]) -> dict:
    # -- set-up: threads, run directory, resume point, the run's precision ------------------------------------
    main, device, clock = info.is_main, info.device, RunClock(started)
    torch.set_num_threads(cfg.train.threads or default_threads(info))
    t0 = time.time()
    cfg, run, ckpt, ckpt_path = _open_run(cfg, info, resume)
    t = cfg.train
    start_dir = init_from.init_dir(cfg) if t.init_from and not ckpt else None   # train.init_from: a model directory

    # -- data and tokenizer (trained on the TRAIN captions only; saved once, read by every rank) -------------
    splits = load_splits(cfg, report_dir=run if main else None, progress=main)
    if main:
        if start_dir is not None:   # the starting model's tokenizer: its token ids are what its weights read
            init_from.copy_tokenizer(start_dir, run / "tokenizer")
        else:
            prepare_tokenizer(cfg, run, splits["train"]["caption"].tolist(), ckpt_path)
    barrier()

    # -- model, optimiser, one-time work, the run's length -----------------------------------------------------
    model, optimizer, features, scaler, frozen, ema = _build(cfg, info, run, ckpt, ckpt_path, start_dir)
    out = ema.module if ema is not None else model   # what is evaluated and saved: train.ema's average, if set
    loss_fn = SigLipLoss() if t.loss == "siglip" else ClipLoss(t.label_smoothing)
    truncated = report_truncation(model.tokenizer, splits["train"]["caption"].astype(str).tolist(),
                                  model.cfg.text.max_length, "train")   # one line if any caption is cut
    prep = prepare(cfg, model, splits, run, info, clock, deadline=Pace.deadline(cfg, clock, ckpt))
    spe, global_batch = prep.steps_per_epoch, t.batch_size * t.accum_freq * info.world_size
    pace = Pace.build(cfg, spe, clock, ckpt, device, main)
    eval_transform = _eval_transform(model)

    curves_at = [t0]   # when this process last drew curves.png (the start of train() until it has)

    def draw_curves() -> None:
        if log.rows:
            with clock("curves"):
                write_curves(log.rows, run / "curves.png")
            curves_at[0] = time.time()

    def evaluate(epoch_done: int) -> dict:
        with clock("evaluation"):
            val = _evaluate(out, splits["val"], eval_transform, prep.cache, cfg, device, log, state, epoch_done,
                            t0, prep.frozen_feats)
        if time.time() - curves_at[0] >= CURVES_EVERY_S:
            draw_curves()
        return val

    # -- resume or evaluate the untrained model --------------------------------------------------------------
    state = {"step": 0, "epoch": 0, "pos": 0, "best": None, "bad_steps": 0, "epoch_loss": [0.0, 0]}
    log = MetricsLog(run / "metrics.jsonl")
    if ckpt:
        log = _restore(ckpt, ckpt_path, state, info, clock, run)
    if main:
        print(f"train: {len(splits['train'])} captions / {splits['train']['image_id'].nunique()} images, "
              f"{spe} steps/epoch of {global_batch} pairs"
              f"{f' ({global_batch // 2} sources beside their mirrors)' if cfg.data.mirror_pairs else ''}, "
              f"{pace.total} steps; "
              f"frozen: {', '.join(frozen) or 'none'}; {info.world_size} process(es) on {device}")
        if not ckpt:   # the untrained model's numbers: the baseline every later evaluation is read against
            evaluate(0)
    barrier()   # the other ranks wait here (long-wait group), not in the first step's all_gather

    saved_at = [-1]   # step of the last checkpoint written by this process

    def save_state() -> None:
        """Write a checkpoint (every rank's random state, the plan) and wait for rank 0's write."""
        with clock("checkpoints"):
            saved_at[0] = state["step"]
            rngs = gather(ckpt_io.rng_state(device))   # every rank's own random state, for each to resume its own
            if main:
                ckpt_io.save_checkpoint(run / "checkpoints", {
                    **state, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": rngs[0], "rng_ranks": rngs, "config": cfg.to_dict(), "total_steps": pace.total,
                    **pace.state, **({"scaler": scaler.state_dict()} if scaler.is_enabled() else {}),
                    **({"ema": ema_state(ema, model)} if ema is not None else {})},
                    t.keep_checkpoints)
            barrier()   # a slow write on rank 0 is waited for here, not in the next step's collectives

    params = [p for p in model.parameters() if p.requires_grad]
    if pace.fitting and not ckpt:   # one checkpoint write timed before the fit (and a state to resume from)
        save_state()
    stopped = False
    while state["epoch"] < pace.epochs() and state["step"] < pace.total and not stopped:
        epoch = state["epoch"]
        set_train_mode(model, True)
        bar = tqdm(total=spe, initial=state["pos"], desc=f"epoch {epoch + 1}/{pace.epochs()}",
                   disable=not main, dynamic_ncols=True, leave=True)
        window = _Window()
        clock.start_laps()
        for micro in prep.inputs.loader(epoch, state["pos"]):
            clock.add("data_wait", window.data_ready())
            # set lr: warmup + cosine (its anchors move only when a budget re-fits)
            lr = set_lr(optimizer, pace.factor(state["step"]))
            # forward / backward over the whole accumulated (and, distributed, global) batch
            micro = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in micro]
            loss = forward_backward(features, micro, loss_fn, device, t.precision, scaler)
            # clip (true gradient units: unscaled first), and guard: a non-finite loss or gradient is never applied
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip or math.inf)
            if torch.isfinite(loss) and torch.isfinite(grad_norm):
                scaler.step(optimizer)   # optimizer.step() unless fp16
                model.clamp_logit_scale()
                if ema is not None:   # the average takes applied steps only; the step count sets its warm-up
                    ema.update(model, step=state["step"] + 1)
                state["bad_steps"] = 0
                state["epoch_loss"] = [state["epoch_loss"][0] + loss.item(), state["epoch_loss"][1] + 1]
            elif not (scaler.is_enabled() and torch.isfinite(loss)):
                _skip_step(state, loss, grad_norm, t.max_bad_steps, main)
            # (an fp16 gradient overflow under a finite loss is the scaler's to handle: it lowers the scale)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            state["pos"] += 1
            clock.add("steps", window.step_done(loss.item(), global_batch))
            # pace: fit, re-fit or stop at the deadline (a budget's; nothing without one)
            pace.after_step(state["step"], clock.lap())
            # log
            if main and (state["step"] % t.log_every == 0 or state["pos"] == spe
                         or state["step"] == pace.total):   # the last step's row too: the schedule's end
                row = window.row(state, lr, model.scale().item(), grad_norm.item())
                bar.set_postfix(loss="nan" if row["loss"] is None else f"{row['loss']:.3f}", lr=f"{lr:.1e}",
                                scale=f"{row['logit_scale']:.1f}", pairs_s=f"{row['pairs_per_s']:.0f}")
                log.add(row)
                log.flush()
            bar.update(1)
            # checkpoint; pause; stop
            if t.checkpoint_every and state["step"] % t.checkpoint_every == 0:
                save_state()
                window.skip_wait()   # the checkpoint's time is not a wait for data
            if stop_after is not None and stop_after <= state["step"] < pace.total:
                stopped = True
                break
            if state["step"] >= pace.total:
                break
        bar.close()
        if stopped:
            break
        # -- end of epoch: evaluate (every train.eval_every-th and the last), keep the best model, checkpoint ------
        if main and pace.evaluates(epoch + 1, state["step"]):
            val = evaluate(epoch + 1)
            if is_better(t.best_metric, val[metric_key(t.best_metric)], state["best"]):
                state["best"] = val[metric_key(t.best_metric)]
                with clock("model_save"):
                    out.save_pretrained(run / "best",
                                        extra={"trained": _provenance(state["step"], epoch + 1, val, t)})
        barrier()
        set_train_mode(model, True)
        state.update(epoch=epoch + 1, pos=0, epoch_loss=[0.0, 0])
        pace.after_epoch(state["step"])   # the measured epoch end: fit again
        save_state()

    # -- finish: final model directory and summary (or, when pausing, just the checkpoint) --------------------
    if stopped and saved_at[0] != state["step"]:
        save_state()
    if main and not stopped:
        with clock("model_save"):
            out.save_pretrained(run / "final", extra={"trained": _provenance(state["step"], state["epoch"],
                                                                             _last_val(log), t)})
    if main:
        draw_curves()
    barrier()
    result = {"run_dir": str(run), "step": state["step"], "epoch": state["epoch"], "best_metric": t.best_metric,
              "best_value": state["best"], "val": _last_val(log), "stopped": stopped, "time_s": time.time() - t0,
              "truncated_captions": truncated, "time_breakdown": clock.breakdown(time.time() - t0),
              "precision": t.precision, **pace.state, **({"ema": t.ema} if t.ema else {})}
    if main:
        _report(result, log, pace.summary(state["step"]))
    return result


def _report(result: dict, log: MetricsLog, budget_line: Optional[str]) -> None:
    """The closing summary (a finished run), and ``summary.json``: where this process's minutes went, for the user
    and ``benchmarks/speed/bench_e2e.py``."""
    from clip_mini.fileio.atomic import atomic_write_json

    if not result["stopped"]:
        run, best = Path(result["run_dir"]), result["best_value"]
        print(summary_table(log.rows, result["best_metric"]))
        print(f"best {result['best_metric']} = {'none' if best is None else f'{best:.4g}'}; model directories: "
              f"{run / 'best'}, {run / 'final'} ({result['time_s']:.0f} s)")
        print(budget_line or "", end="")
    atomic_write_json(Path(result["run_dir"]) / "summary.json", {k: v for k, v in result.items() if k != "run_dir"})


def _open_run(cfg: Config, info, resume: Optional[str]) -> tuple[Config, Path, Optional[dict], Optional[Path]]:
    """The run directory and the checkpoint to resume from; the run's precision decided (and kept on resume), its
    resolved config saved."""
    run = Path(cfg.train.out_dir)
    ckpt_path = ckpt_io.resolve_resume(resume, run)
    ckpt = ckpt_io.load_checkpoint(ckpt_path) if ckpt_path else None
    cfg = resolve_train_precision(cfg, info.device, ckpt, say=info.is_main)
    check_run_dir(run, resuming=ckpt is not None)
    if info.is_main:
        run.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run / "config.yaml")
        if ckpt:
            print(f"resuming from {ckpt_path} (step {ckpt['step']})")
            warn_config_changes(ckpt["config"], cfg)
    return cfg, run, ckpt, ckpt_path


def _restore(ckpt: dict, ckpt_path, state: dict, info, clock: RunClock, run: Path) -> MetricsLog:
    """A resumed run's training state, this rank's random state and the metrics rows up to the checkpoint."""
    try:
        state.update({k: ckpt[k] for k in state})
    except KeyError as e:
        raise ckpt_io.CheckpointError(f"{ckpt_path} lacks the training state {e}") from None
    rng = ckpt_io.rank_rng(ckpt, info.rank, info.world_size)   # this rank's own (CPU and GPU) state
    if rng is not None:
        ckpt_io.set_rng_state(rng, info.device)   # last: building the model drew from the RNG
    log = MetricsLog.resume(run / "metrics.jsonl", state["step"], state["epoch"])
    if log.epochs():   # the evaluation time the run measured so far, until this process measures its own
        clock.latest.setdefault("evaluation", log.epochs()[-1].get("eval_s", 0.0))
    return log


def _build(cfg: Config, info, run: Path, ckpt: Optional[dict], ckpt_path, start_dir):
    """The model (pretrained, ``init_from`` or a checkpoint's weights), its optimiser, the features module the
    step runs (DDP-wrapped, compiled as asked), the fp16 loss scaler, the names of what is frozen and the
    ``train.ema`` average (None when off; each rank keeps its own, all equal)."""
    t, device = cfg.train, info.device
    torch.manual_seed(t.seed)
    model = build_model(cfg, run / "tokenizer", load_pretrained=ckpt is None and start_dir is None)
    if start_dir is not None:
        init_from.load_weights(model, start_dir)
    model = model.to(device)
    frozen = freeze_towers(model)
    optimizer = build_optimizer(model, t)
    # fp16 needs loss scaling (its range underflows small gradients); disabled, the scaler passes everything through
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    if ckpt:   # weights before anything reads them (DDP's broadcast, the frozen-feature pass)
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            if ckpt.get("scaler"):
                scaler.load_state_dict(ckpt["scaler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ckpt_io.CheckpointError(f"{ckpt_path} does not fit this config (model or optimiser "
                                          f"differ; see the warning above): {e}") from None
    ema = build_ema(model, t.ema)   # a copy of the resumed weights: its locked towers are exactly the model's
    if ema is not None and ckpt:
        _restore_ema(ema, model, ckpt, ckpt_path, info.is_main)
    # every rank built the same weights from one seed; from here on each rank draws its own dropout, drop-path and
    # patch-drop masks (rank 0 keeps the stream of a single process); a resume restores each rank's own state later
    if info.rank:
        _seed_all(rank_seed(t.seed, info.rank))
    features = FeatureModel(model)
    if info.distributed:
        features = torch.nn.parallel.DistributedDataParallel(
            features, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    if t.compile:
        from clip_mini.model.layers.compile_pass import CompiledStep

        features = CompiledStep(features)
    return model, optimizer, features, scaler, frozen, ema


def _restore_ema(ema, model, ckpt: dict, ckpt_path, main: bool) -> None:
    """The checkpoint's averaged weights into ``ema``; a checkpoint of a run without ``train.ema`` starts the
    average at its weights."""
    if ckpt.get("ema") is None:
        if main:
            warnings.warn(f"{ckpt_path} holds no EMA of the weights (train.ema was off): the average starts at "
                          "its weights", RuntimeWarning, stacklevel=2)
        return
    try:
        load_ema_state(ema, model, ckpt["ema"])
    except (RuntimeError, KeyError) as e:
        raise ckpt_io.CheckpointError(f"{ckpt_path}: its EMA state does not fit this model: {e}") from None


# -- helpers --------------------------------------------------------------------------------------------------
class _Window:
    """Loss, throughput and data-wait time over the steps since the last log row."""

    def __init__(self):
        self.last = time.perf_counter()
        self._reset()

    def _reset(self) -> None:
        self.losses, self.pairs, self.wait, self.start = [], 0, 0.0, self.last

    def data_ready(self) -> float:
        """Mark a batch's arrival; returns the wait since the last step ended."""
        now = time.perf_counter()
        wait = now - self.last   # time between the end of the last step and this batch's arrival
        self.wait += wait
        self.last = now
        return wait

    def step_done(self, loss: float, pairs: int) -> float:
        """Record a finished step; returns its time since its batch arrived."""
        if math.isfinite(loss):
            self.losses.append(loss)
        self.pairs += pairs
        now, ready = time.perf_counter(), self.last
        self.last = now
        return now - ready

    def skip_wait(self) -> None:
        """Start the wait for the next batch now (time since the last step was spent elsewhere)."""
        self.last = time.perf_counter()

    def row(self, state: dict, lr: float, logit_scale: float, grad_norm: float) -> dict:
        elapsed = max(self.last - self.start, 1e-9)
        row = {"kind": "step", "step": state["step"], "epoch": state["epoch"] + 1,
               "loss": sum(self.losses) / len(self.losses) if self.losses else None, "lr": lr,
               "logit_scale": logit_scale, "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
               "pairs_per_s": self.pairs / elapsed, "data_wait": self.wait / elapsed}
        self._reset()
        return row


def _seed_all(seed: int) -> None:
    """Seed every generator a step may draw from: torch's (CPU and every GPU), numpy's and Python's."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _skip_step(state: dict, loss: torch.Tensor, grad_norm: torch.Tensor, max_bad: int, main: bool) -> None:
    state["bad_steps"] += 1
    what = f"loss {loss.item()}" if not torch.isfinite(loss) else f"gradient norm {grad_norm.item()}"
    if main:
        warnings.warn(f"step {state['step'] + 1}: non-finite {what}; update skipped "
                      f"({state['bad_steps']} in a row)", RuntimeWarning, stacklevel=2)
    if state["bad_steps"] >= max_bad:
        raise TrainError(f"stopped at step {state['step'] + 1}: {state['bad_steps']} steps in a row had a "
                         "non-finite loss or gradient (train.max_bad_steps). Lower train.lr, use "
                         "train.precision=fp32 or check the data, then continue with --resume auto")


def _eval_transform(model):
    from clip_mini.data import build_eval_transform

    return build_eval_transform(model.preprocess)


def _evaluate(model, df, transform, cache, cfg: Config, device, log: MetricsLog, state: dict, epoch_done: int,
              t0: float, frozen_feats: Optional[dict] = None) -> dict:
    """Evaluate on the validation split, add the epoch row, rewrite ``metrics.jsonl``.

    The row's ``time_s`` is the run's wall time so far (this process), ``eval_s`` the evaluation's share of it.
    """
    from clip_mini.train.frozen import val_tower_features

    t, start = cfg.train, time.time()
    tower = val_tower_features(model, frozen_feats["val"], t.eval_batch_size, device, t.precision) \
        if frozen_feats else None   # stored token states go through the current (fine-tuned) last blocks
    val = evaluate_model(model, df, transform, batch_size=t.eval_batch_size, cache=cache, device=device,
                         precision=t.precision, workers=loader_workers(cfg.data.workers), tower_features=tower)
    total, n = state["epoch_loss"]
    log.add({"kind": "epoch", "step": state["step"], "epoch": epoch_done, "train_loss": total / n if n else None,
             **{f"val_{k}": v for k, v in val.items()}, "time_s": time.time() - t0, "eval_s": time.time() - start,
             "precision": t.precision, **({"ema": t.ema} if t.ema else {})})
    log.flush()
    tqdm.write(f"epoch {epoch_done}: val loss {val['loss']:.4f}  t2i R@1/5/10 {val['t2i_r1']:.3f}/"
               f"{val['t2i_r5']:.3f}/{val['t2i_r10']:.3f}  i2t R@1/5/10 {val['i2t_r1']:.3f}/{val['i2t_r5']:.3f}/"
               f"{val['i2t_r10']:.3f}  medr {val['t2i_medr']:.0f}/{val['i2t_medr']:.0f}")
    return val


def _last_val(log: MetricsLog) -> dict:
    epochs = log.epochs()
    return {k[4:]: v for k, v in epochs[-1].items() if k.startswith("val_")} if epochs else {}


def _provenance(step: int, epoch: int, val: dict, t) -> dict:
    """What ``config.json`` records under ``trained``; ``clip-mini eval`` reuses the evaluation settings (the
    precision, and the batch size that groups the validation loss) so it reproduces ``val``."""
    return {"step": step, "epoch": epoch, "val": val, "precision": t.precision,
            "eval_batch_size": t.eval_batch_size, **({"ema": t.ema} if t.ema else {})}
