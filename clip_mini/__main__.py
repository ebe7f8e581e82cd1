"""``python -m clip_mini``: the same command line as ``clip-mini`` (whose entry point is this module's ``main``)."""
from clip_mini.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
