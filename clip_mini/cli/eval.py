"""``clip-mini eval``: retrieval recall on a split, or zero-shot accuracy over class names."""
from __future__ import annotations

import argparse
import contextlib
import io
import sys

from clip_mini.cli.common import (MODEL_HELP, command_parser, add_device, add_quiet, positive_int, count,
                                  resolve_model_arg)
from clip_mini.cli.printing import print_json, rounded


def add_arguments(sub) -> argparse.ArgumentParser:
    ev = command_parser(
        sub, "eval", "retrieval recall on a split, or zero-shot accuracy with --labels",
        "Retrieval recall@1/5/10 and median rank both ways on a split of a caption dataset (--data), or\n"
        "zero-shot classification accuracy over class names (--labels). Results go to stdout (--json for\n"
        "scripts), progress to stderr. Val unless --split test: every test scoring is one line of the test\n"
        "ledger, written before the split is read.",
        "clip-mini eval --model runs/tiny/best --data configs/tiny.yaml",
        "clip-mini eval --model runs/tiny/best --labels data/shapes/labels.csv --label-col colour "
        '--template "a {} shape"')
    ev.add_argument("--model", required=True, help=MODEL_HELP)
    ev.add_argument("--data", help="config YAML (data section) for retrieval recall@K")
    ev.add_argument("--split", default=None, choices=["train", "val", "test"],
                    help="split to score (default: val); a test scoring first writes a line in the test ledger "
                         "(benchmarks/results/quality/test_ledger.jsonl)")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ev.add_argument("--labels", help="zero-shot: class names (.txt, with --images) or an image,label CSV")
    ev.add_argument("--images", help="zero-shot: ImageFolder root (one subfolder per class)")
    ev.add_argument("--label-col", default="label", help="zero-shot: label column of a labels CSV")
    ev.add_argument("--template", action="append", help="zero-shot prompt with {} (repeatable)")
    ev.add_argument("--batch-size", type=positive_int, default=None,
                    help="images/captions per pass and pairs per loss batch (default: the model's training "
                         "eval_batch_size, else the config's; 64 for zero-shot)")
    ev.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                    help="autocast precision (auto: bf16 where the device computes it natively, else fp32)")
    ev.add_argument("--flip-average", action="store_true",
                    help="average each image's row with its mirror image's, as index --flip-average does (2x the "
                         "image pass)")
    ev.add_argument("--workers", type=count, default=None,
                    help="DataLoader workers decoding images (default: none on a CPU, 4 on a GPU)")
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_device(ev)
    add_quiet(ev)
    return ev


def cmd_eval(args: argparse.Namespace) -> int:
    from clip_mini.eval.scoring import DEFAULT_TEMPLATES, EvalError, evaluate_retrieval, evaluate_zero_shot

    from clip_mini.runtime.devices import default_workers, resolve_device

    if (args.data is None) == (args.labels is None):
        raise EvalError("eval needs --data CONFIG (retrieval) or --labels FILE (zero-shot), one of them")
    device = resolve_device(args.device)
    resolve_model_arg(args)
    workers, progress = default_workers(args.workers, device), not args.quiet
    # Progress lines from the data pipeline go to stderr: stdout carries only the results (pipeable JSON).
    with contextlib.redirect_stdout(io.StringIO() if args.quiet else sys.stderr):
        if args.labels is not None:
            out = evaluate_zero_shot(args.model, args.labels, args.images, args.label_col,
                                     args.template or DEFAULT_TEMPLATES, args.batch_size or 64, workers,
                                     progress=progress, precision=args.precision, device=device,
                                     flip_average=args.flip_average)
        else:
            out = evaluate_retrieval(args.model, args.data, args.split, args.set, args.batch_size, workers,
                                     progress=progress, precision=args.precision, device=device,
                                     flip_average=args.flip_average)
    if args.labels is not None:
        keys = [k for k in out if k.startswith("top")]
    else:
        keys = [f"{d}_{m}" for d in ("t2i", "i2t") for m in ("r1", "r5", "r10", "medr")] + ["rsum", "loss"]
    if args.json:
        print_json(out)
        return 0
    head = {k: out[k] for k in ("split", "precision", "flip_average", "n_images", "n_captions", "n_classes",
                                "n_dropped_images") if k in out}
    print("  ".join(f"{k}={v}" for k, v in rounded(head).items()))
    for k in keys:
        v = out[k]
        print(f"{k:>10}  {v:.2f}" if k.endswith("medr") or k in ("rsum", "loss") else f"{k:>10}  {100 * v:.2f}%")
    return 0
