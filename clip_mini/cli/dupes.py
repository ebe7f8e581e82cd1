"""``clip-mini dupes``: groups of near-duplicate images in an index, from its stored embeddings (no re-embedding)."""
from __future__ import annotations

import argparse
import sys

from clip_mini.cli.common import command_parser, add_quiet
from clip_mini.cli.printing import print_json

GRID_GROUPS = 30   # groups drawn by --grid: the picture is for looking, the JSON holds them all


def _threshold(text: str) -> float:
    from clip_mini.retrieval.dupes import check_threshold
    from clip_mini.retrieval.format import EmbeddingIndexError

    try:
        return check_threshold(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if isinstance(e, EmbeddingIndexError)
                                         else f"expected a number, got {text!r}") from None


def _max_pairs(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of pairs, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(sub) -> argparse.ArgumentParser:
    from clip_mini.retrieval.dupes import DEFAULT_MAX_PAIRS, DEFAULT_THRESHOLD, LINKAGES

    du = command_parser(
        sub, "dupes", "find near-duplicate images in an index",
        "Group the images of an index whose embeddings have a cosine similarity of at least --threshold\n"
        "(resized, recompressed, cropped or recoloured copies of one photo). Uses the stored embeddings only;\n"
        "from 20,000 rows a faiss range search replaces the exact pass. Single linkage (the default) groups images\n"
        "linked through others, so a chain of edits A~B~C is one group even when A and C differ: each group shows\n"
        "its similarity (its weakest link) and its lowest pair; --linkage complete links every two images of a group.",
        "clip-mini dupes --index indexes/photos",
        "clip-mini dupes --index indexes/photos --threshold 0.95 --json --grid dupes.png",
        "clip-mini dupes --index indexes/photos --linkage complete")
    du.add_argument("--index", required=True, help="index directory")
    du.add_argument("--threshold", type=_threshold, default=DEFAULT_THRESHOLD,
                    help="cosine similarity in (0, 1] from which two images count as duplicates (scores within the "
                         "rounding of the stored rows below it count too: 1e-3 for float16, so 1 finds identical "
                         "images)")
    du.add_argument("--linkage", default="single", choices=list(LINKAGES),
                    help="single: images linked through others share a group; complete: every two images of a "
                         "group are linked (default single)")
    du.add_argument("--max-pairs", type=_max_pairs, default=DEFAULT_MAX_PAIRS,
                    help=f"refuse a threshold that links more pairs than this (20 bytes each in memory; "
                         f"default {DEFAULT_MAX_PAIRS:,})")
    du.add_argument("--backend", default="auto", choices=["auto", "exact", "faiss"],
                    help="exact pairwise pass, or faiss range search (auto: faiss for large indexes)")
    du.add_argument("--json", action="store_true",
                    help='print {"groups": [{"paths": [...], "similarity": s, "lowest": l}]}')
    du.add_argument("--grid", metavar="PNG", help=f"draw the first {GRID_GROUPS} groups, one row each, into this PNG")
    du.add_argument("--no-verify", action="store_true", help="skip the checksum of the index files")
    add_quiet(du)
    return du


def cmd_dupes(args: argparse.Namespace) -> int:
    from clip_mini.retrieval.dupes import index_duplicates
    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(args.index, verify=not args.no_verify)
    groups = index_duplicates(index, args.threshold, args.backend, progress=not args.quiet, linkage=args.linkage,
                              max_pairs=args.max_pairs)
    if args.grid and groups:
        from clip_mini.pictures.draw import group_grid
        from clip_mini.retrieval.wds_source import hit_image_files

        shown = groups[:GRID_GROUPS]
        rows = [r for g in shown for r in g["rows"]]
        with hit_image_files(index.items, rows) as files:   # shard rows: read back by offset
            it = iter(files)
            group_grid([[next(it) for _ in g["rows"]] for g in shown], [g["similarity"] for g in shown], args.grid,
                       title=f"near-duplicates in {index.path} (threshold {args.threshold})")
    n_images = sum(len(g["paths"]) for g in groups)
    if args.json:
        print_json({"index": str(index.path), "threshold": args.threshold, "linkage": args.linkage,
                    "count": len(index),
                    "groups": [{"paths": g["paths"], "similarity": g["similarity"], "lowest": g["lowest"]}
                               for g in groups]})
    else:
        for k, g in enumerate(groups, 1):
            lowest = "not computed (a large group)" if g["lowest"] is None else f"{g['lowest']:.4f}"
            print(f"group {k}  similarity {g['similarity']:.4f}  lowest pair {lowest}  ({len(g['paths'])} images)")
            for p in g["paths"]:
                print(f"  {p}")
        if args.grid and groups:
            print(f"grid: {args.grid}")
    if not args.quiet:
        print(f"dupes: {len(groups)} groups, {n_images} of {len(index)} images, threshold {args.threshold}, "
              f"{args.linkage} linkage"
              + ("" if groups or not args.grid else "; no groups, so no grid was drawn"), file=sys.stderr)
    return 0
