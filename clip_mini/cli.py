"""``clip-mini``: train, index, search, eval, attention, serve.

    clip-mini --version
    clip-mini train --config configs/shapes.yaml [--set train.epochs=3] [--resume] [--print-config]
    clip-mini index --model runs/tiny/best --images photos/ --out indexes/photos [--device auto|cpu|cuda:0]
    clip-mini search --index indexes/photos "a dog running on grass" -k 10 --grid hits.png
    clip-mini eval --model runs/tiny/best --data configs/shapes.yaml --split test
    clip-mini attention --model runs/tiny/best photo.jpg --out attn.png
    clip-mini serve --index indexes/photos [--port 8000]

Heavy libraries are imported inside the command that needs them: ``search`` never imports torch (see
``clip_mini.retrieval.query``). Errors raised by clip_mini for bad input print ``error: <message>`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

EXIT_USER_ERROR, EXIT_INTERRUPTED = 2, 130
COMMANDS = ("train", "index", "search", "eval", "attention", "serve", "convert")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


_positive_int, _count = _int_at_least(1), _int_at_least(0)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (unless it has none worth showing); descriptions and examples as
    written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, []) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def command_parser(sub, name: str, summary: str, description: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand with a one-line summary (``clip-mini --help``), a description and examples (``NAME --help``)."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return sub.add_parser(name, help=summary, description=description, epilog=epilog, formatter_class=HelpFormatter)


def add_device(p: argparse.ArgumentParser) -> None:
    """``--device``, resolved by ``clip_mini.devices.resolve_device`` (also used by ``clip-mini serve``)."""
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where the model runs (auto: CUDA when available, else CPU)")


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars or info lines (results only)")


def build_parser(prog: str = "clip-mini", commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    from clip_mini.version import __version__

    p = argparse.ArgumentParser(prog=prog, description="A small CLIP-style image-text dual encoder.",
                                epilog="`clip-mini COMMAND --help` describes each command, with an example.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")
    if "train" in commands:
        sub.add_parser("train", add_help=False, help="train a model (see `clip-mini train --help`)")

    ix = command_parser(
        sub, "index", "embed a folder of images (or a dataset's) into an index directory",
        "Embed images into an index directory: incremental (only new or changed files are embedded), resumable\n"
        "after a kill, and readable while it is being updated. Item paths are stored relative to the indexed\n"
        "folder, so the folder and its index can be moved together.",
        "clip-mini index --model runs/tiny/best --images photos/ --out indexes/photos",
        "clip-mini index --model runs/tiny/best --captions data/shapes/captions.csv --out indexes/shapes")
    ix.add_argument("--out", required=True, help="index directory (created, or updated incrementally)")
    ix.add_argument("--model", help="model directory")
    src = ix.add_mutually_exclusive_group()
    src.add_argument("--images", help="folder of images (searched recursively)")
    src.add_argument("--captions", metavar="FILE",
                     help="captions file (image,caption CSV/TSV, Flickr8k or COCO JSON): its images, with their "
                          "captions, without a config")
    src.add_argument("--data", help="config YAML whose data.captions images (and captions) are indexed")
    src.add_argument("--merge", nargs="*", metavar="SHARD", help="merge shard indexes (default: OUT/shards/*)")
    src.add_argument("--shards", metavar="PATTERN", help="WebDataset shards, e.g. 'data/wds/{000000..000099}.tar'")
    ix.add_argument("--add", action="store_true", help="keep rows of files not listed now (default: mirror)")
    ix.add_argument("--shard", help="i/n: index only shard i of n (into OUT/shards/i-of-n); merge with --merge")
    ix.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                    help="with --shards: embed on Ray (no ADDRESS: a local Ray instance; else join that cluster)")
    ix.add_argument("--ray-workers", type=_positive_int, default=2, help="with --ray: embedding actors")
    ix.add_argument("--batch-size", type=_positive_int, default=64, help="images per forward pass")
    ix.add_argument("--workers", type=_count, default=None,
                    help="DataLoader workers decoding images (default: none on a CPU, 4 on a GPU)")
    ix.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                    help="image tower precision (auto: bf16 on a GPU or a CPU with native bf16 (AVX-512 BF16 or "
                         "AMX), where it is 3-6x fp32 here within 1e-2 cosine; else fp32)")
    ix.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help=argparse.SUPPRESS)
    ix.add_argument("--faiss", default="auto", choices=["auto", "none", "hnsw", "ivf", "ivfpq"],
                    help="store a faiss index too (auto, when faiss is installed: HNSW from 500k rows, IVF-PQ "
                         "with exact re-ranking from 1M); its search parameter is tuned to --recall-target")
    ix.add_argument("--recall-target", type=float, default=None, metavar="R",
                    help="recall@10 against exact search that the stored faiss index is tuned to (default 0.95; "
                         "measured on text-like proxy queries, see clip_mini/retrieval/faiss_auto.py)")
    ix.add_argument("--dtype", choices=["float16", "bfloat16"], default=None,
                    help="how the rows are stored (default: an existing index's, else float16). bfloat16: exact "
                         "search reads the rows straight into this CPU's bf16 products (~2x faster on large "
                         "indexes), at 8 significant bits instead of 11 (cosines within ~4e-3 of float32)")
    ix.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                    help="RAM the faiss index may take, for --faiss auto (default: half the memory available): "
                         "HNSW when it fits, else IVF-PQ")
    add_device(ix)
    add_quiet(ix)

    se = command_parser(
        sub, "search", "search an index with a text (or an image) query",
        "Rank the images of an index by cosine similarity to a text query (or to an image with --image).\n"
        "A text query never imports torch; paths are printed absolute.",
        'clip-mini search --index indexes/photos "a dog running on grass" -k 5 --grid hits.png',
        "clip-mini search --index indexes/photos --image query.jpg --json")
    se.add_argument("--index", required=True, help="index directory")
    se.add_argument("query", nargs="?", help="text query")
    se.add_argument("--image", help="image query (image-to-image search)")
    se.add_argument("-k", type=_positive_int, default=10, help="number of results")
    se.add_argument("--model", help="model directory (default: the one recorded in the index)")
    se.add_argument("--backend", default="auto", choices=["auto", "exact", "faiss"], help="search back end")
    se.add_argument("--json", action="store_true", help="print JSON instead of a table")
    se.add_argument("--grid", metavar="PNG", help="draw the results with rank, score and file name into this PNG")
    se.add_argument("--no-verify", action="store_true", help="skip the checksum of the index files")
    add_device(se)
    add_quiet(se)

    ev = command_parser(
        sub, "eval", "retrieval recall on a split, or zero-shot accuracy with --labels",
        "Retrieval recall@1/5/10 and median rank both ways on a split of a caption dataset (--data), or\n"
        "zero-shot classification accuracy over class names (--labels). Results go to stdout (--json for\n"
        "scripts), progress to stderr.",
        "clip-mini eval --model runs/tiny/best --data configs/tiny.yaml",
        "clip-mini eval --model runs/tiny/best --labels data/shapes/labels.csv --label-col colour "
        '--template "a {} shape"')
    ev.add_argument("--model", required=True, help="model directory")
    ev.add_argument("--data", help="config YAML (data section) for retrieval recall@K")
    ev.add_argument("--split", default=None, choices=["train", "val", "test"],
                    help="split to score (default: test when the config has a test split, else val)")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ev.add_argument("--labels", help="zero-shot: class names (.txt, with --images) or an image,label CSV")
    ev.add_argument("--images", help="zero-shot: ImageFolder root (one subfolder per class)")
    ev.add_argument("--label-col", default="label", help="zero-shot: label column of a labels CSV")
    ev.add_argument("--template", action="append", help="zero-shot prompt with {} (repeatable)")
    ev.add_argument("--batch-size", type=_positive_int, default=None,
                    help="images/captions per pass and pairs per loss batch (default: the model's training "
                         "eval_batch_size, else the config's; 64 for zero-shot)")
    ev.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                    help="autocast precision (default: the one the model was trained and evaluated at, else fp32)")
    ev.add_argument("--workers", type=_count, default=None,
                    help="DataLoader workers decoding images (default: none on a CPU, 4 on a GPU)")
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_device(ev)
    add_quiet(ev)

    at = command_parser(
        sub, "attention", "overlay the CLS token's attention on an image",
        "Draw where the ViT image tower's class token attends, over the image (ViT towers only).",
        "clip-mini attention --model runs/tiny/best photo.jpg --out attn.png --mode rollout")
    at.add_argument("--model", required=True, help="model directory (with a ViT image tower)")
    at.add_argument("image", help="image file")
    at.add_argument("--out", required=True, help="output PNG")
    at.add_argument("--mode", default="mean", choices=["mean", "rollout"],
                    help="mean over heads and layers, or attention rollout")
    at.add_argument("--alpha", type=float, default=0.5, help="heat map opacity")
    at.add_argument("--size", type=_count, default=448, help="longer side of the output in pixels (0: image size)")
    add_device(at)
    add_quiet(at)
    if "convert" in commands:
        cv = sub.add_parser("convert", help="write a captions file (or a config's split) as WebDataset shards")
        cv.add_argument("--to-webdataset", action="store_true", required=True, help="the output format (tar shards)")
        cv.add_argument("--out", required=True, help="output folder (replaced as a whole): 000000.tar, ...")
        cin = cv.add_mutually_exclusive_group(required=True)
        cin.add_argument("--captions", help="captions file: CSV/TSV, Flickr8k token file or COCO JSON")
        cin.add_argument("--data", help="config YAML: convert its data section's splits")
        cv.add_argument("--split", choices=["train", "val", "test"], help="with --data: only this split")
        cv.add_argument("--image-root", help="with --captions: folder the image names are relative to")
        cv.add_argument("--format", default="auto", choices=["auto", "csv", "tsv", "flickr8k", "coco"])
        cv.add_argument("--shard-size", type=_positive_int, default=1000, help="samples per shard")
        cv.add_argument("--seed", type=int, default=0, help="shuffle seed of the sample order")
        cv.add_argument("--no-shuffle", action="store_true", help="keep the captions file's order")
        cv.add_argument("--quiet", action="store_true")
    if "serve" in commands:
        from clip_mini.serve.server import add_arguments   # argparse only: the web stack loads when serve runs

        add_arguments(sub.add_parser("serve", help="search service and web page over an index (HTTP)"))
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "clip-mini", commands: Sequence[str] = COMMANDS) -> int:
    """Run one command; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "train" and "train" in commands:
            return _train(argv[1:])
        args = build_parser(prog, commands).parse_args(argv)
        from clip_mini.allocator import keep_freed_memory

        keep_freed_memory()   # embedding passes reuse their batch buffers without page faults (see the module)
        if args.command == "serve":
            from clip_mini.serve.server import cmd_serve

            return cmd_serve(args)
        from clip_mini import commands as C
        from clip_mini.progress import console

        with console(quiet=getattr(args, "quiet", False)):
            return getattr(C, f"cmd_{args.command}")(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:   # `clip-mini search ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        # An OSError (permission denied, a read-only folder) is the environment, not a bug, and names its file.
        if not (is_user_error(e) or isinstance(e, OSError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def is_user_error(e: BaseException) -> bool:
    """clip_mini's own exceptions (``clip_mini.ClipMiniError`` and its subclasses ConfigError, DataError,
    ImageError, ModelDirError, InputError, EmbeddingIndexError, OutputError, ...) describe bad input: no traceback.

    Matched by where the class is defined, so this module need not import the modules that define them.
    """
    return any(c.__module__.split(".")[0] == "clip_mini" for c in type(e).__mro__)


def _train(argv: list[str]) -> int:
    try:
        from clip_mini.train.cli import main as train_main
    except ImportError as e:
        print(f"error: training is unavailable: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    status = train_main(argv, prog="clip-mini train")
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
