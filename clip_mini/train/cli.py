"""``python train.py`` / ``clip-mini train``: a few flags mapped onto the config, clear errors, an exit code."""
from __future__ import annotations

import argparse
import sys
from typing import Optional


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a clip_mini image-text model.")
    p.add_argument("--config", help="YAML config (e.g. configs/tiny.yaml); defaults for anything it leaves out")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set train.epochs=3 (repeatable)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
                   help="continue a run: 'auto' (the default when given without a value) takes the newest "
                        "intact checkpoint of train.out_dir and starts fresh if there is none; or a checkpoint "
                        "file or run directory")
    p.add_argument("--out", help="run directory (same as --set train.out_dir=...)")
    return p


def main(argv: Optional[list[str]] = None, prog: str = "train.py") -> int:
    """Parse ``argv``, check the config, train; returns the process exit code (0 ok, 2 error, 130 interrupted)."""
    from clip_mini.cli import EXIT_USER_ERROR
    from clip_mini.config import ConfigError, load_config

    args = build_parser(prog).parse_args(argv)
    overrides = list(args.overrides) + ([f"train.out_dir={args.out}"] if args.out else [])
    try:
        cfg = load_config(args.config, overrides)
        from clip_mini.train.build import check_train_config

        check_train_config(cfg)   # before any data is read or any weight is built
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return run(cfg, args.resume)


def run(cfg, resume: Optional[str]) -> int:
    from clip_mini.cli import EXIT_INTERRUPTED, EXIT_USER_ERROR, is_user_error
    from clip_mini.train import train

    try:
        train(cfg, resume=resume)
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
