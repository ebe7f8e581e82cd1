"""Run every speed benchmark in turn (``make bench``); each prints JSON and writes benchmarks/results/speed/<name>.json.

The Flickr8k quality benchmark trains for 30 minutes per variant, so it runs only with ``--quality``.
"""
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEED = ["speed/bench_data.py", "speed/bench_allocator.py", "speed/bench_train.py", "speed/bench_towers.py",
         "speed/bench_index.py", "speed/bench_search.py", "speed/bench_startup.py", "speed/bench_e2e.py"]


def main() -> int:
    scripts = SPEED + (["quality/quality_flickr8k.py"] if "--quality" in sys.argv[1:] else [])
    failed = []
    for name in scripts:
        print(f"== {name}", flush=True)
        if subprocess.run([sys.executable, str(HERE / name)], cwd=HERE.parent).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
