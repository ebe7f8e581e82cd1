"""``python -m clip_mini``: the same command line as ``clip-mini``."""
from clip_mini.cli import main

raise SystemExit(main())
