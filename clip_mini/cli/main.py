"""``clip-mini``: train, index, search, eval, attention, serve, convert, dupes, classify, models.

    clip-mini --version
    clip-mini train --config configs/tiny.yaml [--set train.epochs=3] [--resume] [--print-config]
    clip-mini index --model runs/tiny/best --images photos/ --out indexes/photos [--device auto|cpu|cuda:0]
    clip-mini index --images photos/ --out indexes/photos        # no --model: the built-in model 'photos'
    clip-mini search --index indexes/photos "a dog running on grass" -k 10 --grid hits.png
    clip-mini eval --model runs/tiny/best --data configs/tiny.yaml --split test
    clip-mini attention --model runs/tiny/best photo.jpg --out attn.png
    clip-mini serve --index indexes/photos [--port 8000]
    clip-mini dupes --index indexes/photos [--threshold 0.965] [--json] [--grid dupes.png]
    clip-mini classify --model runs/tiny/best --images photos/ --labels "cat,dog,beach" --out labels.csv
    clip-mini models                                              # built-in models: --model NAME works too

Heavy libraries are imported inside the command that needs them: ``search`` never imports torch (see
``clip_mini.retrieval.query``). Errors raised by clip_mini for bad input print ``error: <message>`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from clip_mini.cli.common import EXIT_INTERRUPTED, EXIT_USER_ERROR, is_user_error

COMMANDS = ("train", "index", "search", "eval", "attention", "serve", "convert", "dupes", "classify", "models")


def build_parser(prog: str = "clip-mini", commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    """The top-level parser: each command module adds its own subparser (argparse only; nothing heavy loads)."""
    from clip_mini.version import __version__

    p = argparse.ArgumentParser(prog=prog, description="A small CLIP-style image-text dual encoder.",
                                epilog="`clip-mini COMMAND --help` describes each command, with an example.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")
    for name in commands:
        if name == "train":
            sub.add_parser("train", add_help=False, help="train a model (see `clip-mini train --help`)")
        else:
            importlib.import_module(f"clip_mini.cli.{name}").add_arguments(sub)
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "clip-mini", commands: Sequence[str] = COMMANDS) -> int:
    """Run one command; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "train" and "train" in commands:
            return _train(argv[1:])
        parser = build_parser(prog, commands)
        if argv and argv[0] not in commands and argv[0] not in ("-h", "--help", "--version"):
            parser.error(_misplaced(argv[0], parser, commands))   # exits 2, after the usage line
        args = parser.parse_args(argv)
        from clip_mini.runtime.allocator import keep_freed_memory

        keep_freed_memory()   # embedding passes reuse their batch buffers without page faults (see the module)
        command = importlib.import_module(f"clip_mini.cli.{args.command}")
        if args.command == "serve":
            return command.cmd_serve(args)
        from clip_mini.cli.progress import console

        with console(quiet=getattr(args, "quiet", False)):
            return getattr(command, f"cmd_{args.command}")(args)
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


def _misplaced(first: str, parser: argparse.ArgumentParser, commands: Sequence[str]) -> str:
    """What to say when ``first`` is not a command: the nearest command for a typo; for an option given before any
    command, which commands take it (argparse would take the option's value for the command name)."""
    import difflib

    if not first.startswith("-"):
        close = difflib.get_close_matches(first, commands, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else f" (commands: {', '.join(commands)})"
        return f"unknown command '{first}'{hint}"
    option = first.split("=", 1)[0]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    takers = [name for name in commands if name in subparsers and option in subparsers[name]._option_string_actions]
    if takers:
        return (f"{option} goes after the command it is for: `{parser.prog} {takers[0]} ... {option} ...`"
                + (f" (also an option of {', '.join(takers[1:])})" if len(takers) > 1 else ""))
    return (f"{option} is not an option of {parser.prog}: options go after the command (`{parser.prog} COMMAND "
            f"--help` lists them), e.g. `{parser.prog} search --index INDEX -k 5 \"a red circle\"`")


def _train(argv: list[str]) -> int:
    try:
        from clip_mini.cli.train import main as train_main
    except ImportError as e:
        print(f"error: training is unavailable: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    status = train_main(argv, prog="clip-mini train")
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
