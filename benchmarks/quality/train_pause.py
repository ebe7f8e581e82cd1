"""Train (or continue) a run and pause after a given global step, leaving a checkpoint to resume from.

    python benchmarks/quality/train_pause.py --config configs/flickr8k.yaml [--set key=value ...] --stop-after 10 [--resume]

``train.py`` has no pause flag; this calls ``clip_mini.train.train(cfg, resume, stop_after)``, which
checkpoints and returns once ``stop_after`` steps are done. The quality benchmark uses it to time the first
steps of the real run (its probe), then resumes that run with a schedule fitted to the time left.
Exit codes as ``train.py``: 0 done, 2 an error in what was passed (the message names it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--stop-after", type=int, required=True, help="global step to pause after")
    p.add_argument("--resume", action="store_true", help="continue train.out_dir's newest checkpoint")
    args = p.parse_args(argv)
    from clip_mini.cli.common import EXIT_USER_ERROR, is_user_error
    from clip_mini.config import load_config
    from clip_mini.train import train

    try:
        result = train(load_config(args.config, args.overrides), resume="auto" if args.resume else None,
                       stop_after=args.stop_after)
    except Exception as e:
        if not (is_user_error(e) or isinstance(e, OSError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"paused at step {result['step']} (epoch {result['epoch']}, stopped={result['stopped']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
