"""``python train.py`` / ``clip-mini train``: a few flags mapped onto the config, clear errors, an exit code."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Optional


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    from clip_mini.cli.common import HelpFormatter

    p = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Train a clip_mini image-text model: the config's data, model and train sections (defaults for\n"
                    "anything it leaves out), a run directory with checkpoints, metrics, best/ and final/ models.",
        epilog=f"examples:\n  {prog} --config configs/tiny.yaml --set train.epochs=3\n"
               f"  {prog} --config configs/flickr8k.yaml --print-config\n  {prog} --config configs/tiny.yaml --resume")
    p.add_argument("--config", help="YAML config (e.g. configs/tiny.yaml); defaults for anything it leaves out")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set train.epochs=3 (repeatable)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
                   help="continue a run: 'auto' (the default when given without a value) takes the newest "
                        "intact checkpoint of train.out_dir and starts fresh if there is none; or a checkpoint "
                        "file or run directory")
    p.add_argument("--out", help="run directory (same as --set train.out_dir=...)")
    p.add_argument("--budget", metavar="DURATION",
                   help="wall-clock budget for the whole run, e.g. 30m, 90s, 1.5h (same as --set train.budget=...): "
                        "the step count and the learning-rate schedule are fitted so the run ends within it")
    p.add_argument("--init-from", metavar="MODEL",
                   help="start from a saved model directory or a built-in model's name, e.g. photos (same as --set "
                        "train.init_from=...): its towers, heads, tokenizer and preprocessing")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every key, after --set) as YAML and exit")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars or info lines (errors and warnings only)")
    return p


def main(argv: Optional[list[str]] = None, prog: str = "train.py") -> int:
    """Parse ``argv``, check the config, train; returns the process exit code (0 ok, 2 error, 130 interrupted)."""
    from clip_mini.cli.common import EXIT_USER_ERROR
    from clip_mini.config import ConfigError, load_config, precision_settings
    from clip_mini.errors import ModelDirError

    args = build_parser(prog).parse_args(argv)   # --help and usage errors exit here, before torch is imported
    from clip_mini.train.build import run_precision

    overrides = list(args.overrides) + ([f"train.out_dir={args.out}"] if args.out else [])
    overrides += [f"train.budget={args.budget}"] if args.budget else []
    overrides += [f"train.init_from={args.init_from}"] if args.init_from else []
    try:
        overrides = [_builtin_init_from(o) for o in overrides]
        cfg = load_config(args.config, overrides)
        precision = run_precision(cfg, args.resume)
        settings = precision_settings(args.config, precision) if cfg.train.budget is not None else []
        if settings:   # a budgeted run: the config's section for this precision, under the command line's --set
            cfg = load_config(args.config, overrides, precision=precision)
            if not (args.print_config or args.quiet):
                print(f"{args.config}: its {precision} settings apply ({', '.join(settings)}; --set wins over them)")
        if args.print_config:   # checked as a run would check it (train() checks once, before reading any data)
            from clip_mini.train.build import check_train_config

            check_train_config(cfg)
    except (ConfigError, ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.print_config:
        from clip_mini.config import dump_config

        sys.stdout.write(dump_config(cfg))
        return 0
    from clip_mini.runtime.allocator import keep_freed_memory

    keep_freed_memory()   # a process-wide malloc setting, so the program sets it, not the library
    return run(cfg, args.resume, quiet=args.quiet)


def _builtin_init_from(override: str) -> str:
    """``train.init_from=NAME`` of a built-in model -> its model directory (built into the cache on first use); a
    name that is neither a directory nor a built-in is refused with the built-in names listed."""
    key, _, value = override.partition("=")
    value = value.strip()
    # a path (it has a folder separator) or an existing folder stays as given: the trainer checks it when it starts
    if key.strip() != "train.init_from" or value in ("", "null", "None", "~") or "/" in value or os.sep in value \
            or os.path.isdir(value):
        return override
    from clip_mini.builtin.registry import resolve_model

    return f"train.init_from={resolve_model(value)}"


def run(cfg, resume: Optional[str], quiet: bool = False) -> int:
    from clip_mini.cli.common import EXIT_INTERRUPTED, EXIT_USER_ERROR, is_user_error
    from clip_mini.cli.progress import console
    from clip_mini.train.budget import process_start_time
    from clip_mini.train import train

    try:
        sink = open(os.devnull, "w") if quiet else contextlib.nullcontext(sys.stdout)   # quiet: no info lines
        with console(quiet), sink as out, contextlib.redirect_stdout(out):
            train(cfg, resume=resume, started=process_start_time())   # train.budget counts the whole process
    except KeyboardInterrupt:
        print("interrupted; continue with --resume auto", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        # Every error of ours (bad data, a batch larger than the data, a run directory in use, a diverged run)
        # and every OSError (it names its file) says what to change: exit 2 without a traceback, as clip-mini
        # does. Anything else is a bug and keeps its traceback.
        if not (is_user_error(e) or isinstance(e, OSError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
