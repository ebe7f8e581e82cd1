#!/usr/bin/env bash
# Many SIGKILL-and-resume trials of training and of index building (CI runs 2 of each).
#   bash scripts/crash_trials.sh [TRIALS]      (default 20; needs the venv: make test once)
set -euo pipefail
cd "$(dirname "$0")/.."
CLIP_MINI_KILL_TRIALS="${1:-20}" .venv/bin/python -m pytest -q -k sigkill tests/test_train_loop.py tests/test_index_reliability.py
