"""What every ``clip-mini`` command shares: exit codes, the help formatter, common options, and which
errors are the user's (printed as one line) rather than bugs."""
from __future__ import annotations

import argparse

EXIT_USER_ERROR, EXIT_INTERRUPTED = 2, 130


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


positive_int, count = _int_at_least(1), _int_at_least(0)


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
    """``--device``, resolved by ``clip_mini.runtime.devices.resolve_device`` (also used by ``clip-mini serve``)."""
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where the model runs (auto: CUDA when available, else CPU)")


def check_output_folder(path: str, option: str) -> None:
    """Refuse an output file whose folder does not exist (rather than creating folders the user never named)."""
    from pathlib import Path

    folder = Path(path).parent
    if not folder.is_dir():
        from clip_mini.errors import InputError

        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise InputError(f"{option} {path}: the folder {folder} {what} (create it first)")


MODEL_HELP = "model directory or built-in name (clip-mini models)"


def resolve_model_arg(args: argparse.Namespace) -> None:
    """Turn ``--model`` (a model directory or a built-in name) into a model directory, in place: a built-in is
    built into the user cache on first use, and found there later without importing torch."""
    if getattr(args, "model", None):
        from clip_mini.builtin.registry import resolve_model

        args.model = str(resolve_model(args.model))


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars or info lines (results only)")


def is_user_error(e: BaseException) -> bool:
    """clip_mini's own exceptions (``clip_mini.ClipMiniError`` and its subclasses ConfigError, DataError,
    ImageError, ModelDirError, InputError, EmbeddingIndexError, OutputError, ...) describe bad input: no traceback.

    Matched by where the class is defined, so this module need not import the modules that define them.
    """
    return any(c.__module__.split(".")[0] == "clip_mini" for c in type(e).__mro__)
