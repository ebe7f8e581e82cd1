#!/usr/bin/env python
"""Inference entry point, the same commands as ``clip-mini`` except ``train`` (use ``train.py`` for that).

    python infer.py index --model runs/tiny/best --images photos/ --out indexes/photos
    python infer.py search --index indexes/photos "a dog running on grass" -k 10 [--json] [--grid hits.png]
    python infer.py eval --model runs/tiny/best --data configs/tiny.yaml --split test
    python infer.py attention --model runs/tiny/best photo.jpg --out attn.png
"""
import sys

from clip_mini.cli.main import main

if __name__ == "__main__":
    sys.exit(main(prog="infer.py", commands=("index", "search", "eval", "attention")))
