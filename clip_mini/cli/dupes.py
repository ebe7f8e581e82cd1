"""``clip-mini dupes``: groups of near-duplicate images in an index, from the image tower's own features (computed
once per image and cached beside the index: ``retrieval.dupe_features``) or from the stored embeddings alone."""
from __future__ import annotations

import argparse
import sys

from clip_mini.cli.common import MODEL_HELP, add_device, add_quiet, command_parser, resolve_model_arg
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
    from clip_mini.retrieval.dupe_features import CACHE_DIR, TOWER_THRESHOLD
    from clip_mini.retrieval.dupes import DEFAULT_MAX_PAIRS, DEFAULT_THRESHOLD, LINKAGES

    du = command_parser(
        sub, "dupes", "find near-duplicate images in an index",
        "Group the images of an index that are copies of one photo (resized, recompressed, cropped, straightened,\n"
        "recoloured, captioned, or a screenshot of it in a viewer): pairs whose features have a cosine similarity of\n"
        "at least --threshold. The features (--features auto) are the image tower's own, averaged over the middle of\n"
        "each picture: computed once per image by the index's model (one tower pass, on a larger picture than\n"
        f"indexing's) and cached in INDEX/{CACHE_DIR}/, so later runs only compute new images. Without the\n"
        "model, or with --features embedding, the stored search embeddings are grouped instead (nothing read but\n"
        "the index; they miss more copies and pair more photos of one scene). From 20,000 rows a faiss range\n"
        "search replaces the exact pass.\n"
        "Single linkage (the default) groups images linked through others, so a chain of edits A~B~C is one group\n"
        "even when A and C differ: each group shows its similarity (its weakest link) and its lowest pair;\n"
        "--linkage complete links every two images of a group.",
        "clip-mini dupes --index indexes/photos",
        "clip-mini dupes --index indexes/photos --threshold 0.8 --json --grid dupes.png",
        "clip-mini dupes --index indexes/photos --features embedding --linkage complete")
    du.add_argument("--index", required=True, help="index directory")
    du.add_argument("--features", default="auto", choices=["auto", "tower", "embedding"],
                    help="tower: the image tower's features (needs the model and the images); embedding: the stored "
                         "search embeddings; auto: tower when the model is at hand, else embedding (default auto)")
    du.add_argument("--threshold", type=_threshold, default=None,
                    help=f"cosine similarity in (0, 1] from which two images count as duplicates (default "
                         f"{TOWER_THRESHOLD} for tower features, {DEFAULT_THRESHOLD} for embeddings: chosen with the "
                         "built-in photos model; scores within the rounding of the float16 rows below it count too, "
                         "so 1 finds identical images)")
    du.add_argument("--model", help="for the tower features: a " + MODEL_HELP + "; default: the one recorded in the "
                                    "index")
    add_device(du)
    du.add_argument("--linkage", default="single", choices=list(LINKAGES),
                    help="single: images linked through others share a group; complete: every two images of a "
                         "group are linked (default single)")
    du.add_argument("--max-pairs", type=_max_pairs, default=DEFAULT_MAX_PAIRS,
                    help=f"refuse a threshold that links more pairs than this (20 bytes each in memory; "
                         f"default {DEFAULT_MAX_PAIRS:,})")
    du.add_argument("--backend", default="auto", choices=["auto", "exact", "faiss"],
                    help="exact pairwise pass, or faiss range search (auto: faiss for large indexes)")
    du.add_argument("--json", action="store_true",
                    help='print {"groups": [{"paths": [...], "similarity": s, "lowest": l}], "features": ..., '
                         '"left_out": [{"path": p, "reason": r}]}')
    du.add_argument("--grid", metavar="PNG", help=f"draw the first {GRID_GROUPS} groups, one row each, into this PNG")
    du.add_argument("--no-verify", action="store_true", help="skip the checksum of the index files")
    add_quiet(du)
    return du


def cmd_dupes(args: argparse.Namespace) -> int:
    from clip_mini.retrieval.dupe_features import index_dupes
    from clip_mini.retrieval.index import EmbeddingIndex

    resolve_model_arg(args)   # a built-in name: its cached directory
    index = EmbeddingIndex.load(args.index, verify=not args.no_verify)
    found = index_dupes(index, args.threshold, args.features, args.backend, progress=not args.quiet,
                        linkage=args.linkage, max_pairs=args.max_pairs, model_dir=args.model, device=args.device)
    groups, threshold, tower = found.groups, found.threshold, found.tower
    left_out = sorted((index.items["path"][r], why) for r, why in (tower.left_out.items() if tower else ()))
    if args.grid and groups:
        from clip_mini.pictures.draw import group_grid
        from clip_mini.retrieval.wds_source import hit_image_files

        shown = groups[:GRID_GROUPS]
        rows = [r for g in shown for r in g["rows"]]
        with hit_image_files(index.items, rows) as files:   # shard rows: read back by offset
            it = iter(files)
            group_grid([[next(it) for _ in g["rows"]] for g in shown], [g["similarity"] for g in shown], args.grid,
                       title=f"near-duplicates in {index.path} ({found.features} features, threshold {threshold})")
    n_images = sum(len(g["paths"]) for g in groups)
    if args.json:
        print_json({"index": str(index.path), "features": found.features, "threshold": threshold,
                    "linkage": args.linkage, "count": len(index),
                    "groups": [{"paths": g["paths"], "similarity": g["similarity"], "lowest": g["lowest"]}
                               for g in groups],
                    "left_out": [{"path": p, "reason": why} for p, why in left_out]})
    else:
        for k, g in enumerate(groups, 1):
            lowest = "not computed (a large group)" if g["lowest"] is None else f"{g['lowest']:.4f}"
            print(f"group {k}  similarity {g['similarity']:.4f}  lowest pair {lowest}  ({len(g['paths'])} images)")
            for p in g["paths"]:
                print(f"  {p}")
        if args.grid and groups:
            print(f"grid: {args.grid}")
    if not args.quiet:
        if found.note:
            print(f"dupes: {found.note}", file=sys.stderr)
        for p, why in left_out[:5]:
            print(f"dupes: left out {p}: {why}", file=sys.stderr)
        if len(left_out) > 5:
            print(f"dupes: ... {len(left_out) - 5} more left out (--json lists them)", file=sys.stderr)
        how = (f"tower features ({tower.computed} computed, {tower.cached} cached"
               + (")" if tower.cache else "; not cached: the index folder is not writable)") if tower
               else "stored embeddings")
        print(f"dupes: {len(groups)} groups, {n_images} of {len(index)} images, {how}, threshold {threshold}, "
              f"{args.linkage} linkage"
              + ("" if groups or not args.grid else "; no groups, so no grid was drawn"), file=sys.stderr)
    return 0
