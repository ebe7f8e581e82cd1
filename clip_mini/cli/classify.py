"""``clip-mini classify``: sort a folder of images into your own labels (zero-shot), optionally scored."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clip_mini.cli.common import MODEL_HELP, command_parser, add_device, add_quiet, positive_int, resolve_model_arg


def add_arguments(sub) -> argparse.ArgumentParser:
    cl = command_parser(
        sub, "classify", "sort images into your own labels (zero-shot)",
        "Give each image the label whose prompt (\"a photo of a {}.\") the model scores closest, and write a CSV:\n"
        "path,label,score,runner_up,runner_up_score (scores are probabilities over the labels). Several\n"
        "--template options are averaged per label (prompt ensembling). Unreadable images are skipped and listed.\n"
        "--truth CSV (path,label) prints the accuracy and draws a confusion matrix.",
        'clip-mini classify --model runs/tiny/best --images photos/ --labels "cat,dog,beach" --out labels.csv',
        'clip-mini classify --model M --images data/shapes/images --labels-file colours.txt --template "a {} shape" '
        '--template "a {} object" --truth truth.csv --confusion confusion.png')
    cl.add_argument("--model", required=True, help=MODEL_HELP)
    cl.add_argument("--images", required=True, help="folder of images (searched recursively)")
    cl.add_argument("--labels", help='class names separated by commas: "cat,dog,beach"')
    cl.add_argument("--labels-file", help="class names, one a line (added after --labels)")
    cl.add_argument("--template", action="append", help='prompt with {} for the label (repeatable; default: '
                                                        '"a photo of a {}.")')
    cl.add_argument("--out", default="labels.csv", help="output CSV (written atomically)")
    cl.add_argument("--top", type=positive_int, default=2,
                    help="labels kept per image: the best and the runner-up, and label_3, score_3, ... above 2")
    cl.add_argument("--truth", help="CSV with path (or image) and label columns: print accuracy")
    cl.add_argument("--confusion", metavar="PNG", help="with --truth: the confusion matrix picture "
                                                       "(default: the --out name with _confusion.png)")
    cl.add_argument("--batch-size", type=positive_int, default=64, help="images per forward pass")
    add_device(cl)
    add_quiet(cl)
    return cl


def cmd_classify(args: argparse.Namespace) -> int:
    from clip_mini.embed import DEFAULT_TEMPLATES, check_templates, load
    from clip_mini.eval.classify import classify_files, parse_labels, read_truth, write_csv
    from clip_mini.eval.scoring import EvalError
    from clip_mini.retrieval.files import scan_images

    labels = parse_labels(args.labels, args.labels_file)
    templates = check_templates(args.template or list(DEFAULT_TEMPLATES))
    if args.top > len(labels):
        raise EvalError(f"--top {args.top} is more than the {len(labels)} labels")
    if args.confusion and not args.truth:
        raise EvalError("--confusion draws the scores against --truth: give --truth CSV too")
    paths = scan_images(args.images)
    if not paths:
        raise EvalError(f"no images found under {args.images} (looked for .jpg, .png, .webp, ...)")
    truth = read_truth(args.truth, args.images) if args.truth else None
    resolve_model_arg(args)
    embedder = load(args.model, device=args.device, batch_size=args.batch_size)
    result = classify_files(embedder, paths, labels, templates, args.top, truth, progress=not args.quiet)
    for path, reason in result["skipped"].items():
        print(f"classify: skipped unreadable image {reason if path in reason else f'{path}: {reason}'}",
              file=sys.stderr)
    if not result["rows"]:
        raise EvalError(f"none of the {len(paths)} images under {args.images} could be read")
    write_csv(result["rows"], args.out, args.top)
    print(f"classify: {result['n_images']} images -> {args.out}"
          + (f" ({len(result['skipped'])} unreadable skipped)" if result["skipped"] else ""))
    if truth is not None:
        from clip_mini.pictures.draw import confusion_png

        png = args.confusion or str(Path(args.out).with_name(Path(args.out).stem + "_confusion.png"))
        confusion_png(result["confusion"], labels, png,
                      title=f"accuracy {result['accuracy']:.3f} on {result['n_scored']} images")
        print(f"accuracy {100 * result['accuracy']:.2f}% on {result['n_scored']} images with a truth label; "
              f"confusion matrix: {png}")
    return 0
