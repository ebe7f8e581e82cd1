"""``clip-mini models``: the built-in models (a name works wherever a model directory does), one line each."""
from __future__ import annotations

import argparse

from clip_mini.cli.common import command_parser

# card.json keys shown first, in this order, when the card has no "summary" of its own
CARD_KEYS = ("trained_on", "steps", "cpu", "scores", "data_licence", "data_license")
LINE_CHARS = 160


def add_arguments(sub) -> argparse.ArgumentParser:
    mo = command_parser(
        sub, "models", "list the built-in models (names usable as --model)",
        "List the models shipped inside the package: each is a small delta over pretrained towers from PyPI\n"
        "packages, built once into the user cache ($CLIP_MINI_CACHE_DIR, else ~/.cache/clip_mini) on first use.\n"
        "Its name works wherever a model directory does (--model NAME, clip_mini.load(NAME)); scripts get the\n"
        "names from clip_mini.list_models().",
        "clip-mini models")
    return mo


def cmd_models(args: argparse.Namespace) -> int:
    from clip_mini.builtin.registry import DEFAULT_MODEL, cached_dir, list_models, model_card

    names = list_models()
    if not names:
        print("no built-in models are installed: pass a model directory as --model")
        return 0
    width = max(len(name) for name in names)
    for name in names:
        built = "built" if (cached_dir(name) / "manifest.json").is_file() else "built on first use"
        note = ", the default of `clip-mini index`" if name == DEFAULT_MODEL else ""
        print(f"{name:<{width}}  {describe(model_card(name))} [{built}{note}]")
    return 0


def describe(card: dict) -> str:
    """One line from a free-form ``card.json``: its ``summary``, else its main facts as ``key: value``."""
    if isinstance(card.get("summary"), str) and card["summary"].strip():
        line = " ".join(card["summary"].split())
    else:
        keys = [k for k in CARD_KEYS if k in card] + [k for k in card if k not in CARD_KEYS]
        line = "; ".join(f"{k.replace('_', ' ')}: {_short(card[k])}" for k in keys)
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 3] + "..."


def _short(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_short(v) for v in value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return " ".join(str(value).split())
