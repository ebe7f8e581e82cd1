"""``clip-mini search``: rank an index's images for a query of text and image terms (``"a dog" + "beach" -
"grass"``, see ``clip_mini.features.terms``); a text query never imports torch unless ``--explain`` draws match
maps. Exit status 0 with results, 1 when nothing is returned (as grep), 2 on bad input."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clip_mini.cli.common import (MODEL_HELP, add_device, add_quiet, check_output_folder, command_parser, positive_int,
                                  resolve_model_arg)
from clip_mini.cli.printing import print_json, print_results

EXIT_NO_HITS = 1   # grep's status for "nothing found": `clip-mini search ... --paths && ...` chains on it


def add_arguments(sub) -> argparse.ArgumentParser:
    se = command_parser(
        sub, "search", "search an index with text and image terms",
        "Rank the images of an index by cosine similarity to a query: captions and images joined by + and -\n"
        "(rclip's grammar), each optionally weighted (\"2:golden retriever\"); an argument written as a path\n"
        "(./x.jpg, /photos/x.jpg, ~/x.jpg) is an image. The terms' unit embeddings are summed with their weights\n"
        "(- negates) and renormalised. A text query never imports torch; paths are printed absolute.\n"
        "Exit status: 0 with results, 1 when nothing is returned, 2 on bad input.",
        'clip-mini search --index indexes/photos "a dog running on grass" -k 5 --grid hits.png',
        'clip-mini search --index indexes/photos "a dog" + "beach" - "grass" "2:golden retriever"',
        'clip-mini search --index indexes/photos ./cat.jpg + "at night" --paths | xargs feh',
        "clip-mini search --index indexes/photos --image query.jpg --json",
        'clip-mini search --index indexes/photos "a red car" -k 8 --explain --grid hits.png',
        'clip-mini search --index indexes/photos "a beach at sunset" --after 2024-06 --before 2024-09 --glob "*.jpg"',
        'clip-mini search --index indexes/photos "a birthday cake" --under family/2023 -k 20')
    se.add_argument("--index", required=True, help="index directory")
    se.add_argument("query", nargs="*", metavar="TERM",
                    help='query terms joined by + and -: "a dog" + "beach" - "grass"; "2:caption" weights a term; '
                         "a path (./x.jpg) is an image")
    se.add_argument("--image", help="an image query term (added to the others with +)")
    se.add_argument("-k", type=positive_int, default=10,
                    help="number of results (at most the index's size: a larger k lists every image, with a note)")
    se.add_argument("--model", help=MODEL_HELP[:-1] + "; default: the one recorded in the index)")
    se.add_argument("--backend", default="auto", choices=["auto", "exact", "faiss"], help="search back end")
    se.add_argument("--json", action="store_true", help="print JSON instead of a table")
    se.add_argument("--grid", metavar="PNG", help="draw the results with rank, score and file name into this PNG")
    se.add_argument("--explain", action="store_true",
                    help="with --grid and a text query: overlay on each hit where it matches the query (loads "
                         "the model with torch: Embedder.explain)")
    se.add_argument("--paths", action="store_true",
                    help="print only the result paths, one per line (for xargs, feh, cp); notes go to stderr")
    se.add_argument("-0", dest="null", action="store_true",
                    help="print the paths NUL-separated (implies --paths): safe for any file name with xargs -0")
    se.add_argument("--no-verify", action="store_true", help="skip the checksum of the index files")
    fl = se.add_argument_group(
        "filters", "keep only some images, before the top -k (exact: -k 10 gives 10 results when 10 pass); "
                   "filters combine (all must hold)")
    fl.add_argument("--under", metavar="PATH",
                    help="only images under this folder of the index's folder: relative to it (2024/trip) or "
                         "absolute")
    fl.add_argument("--glob", metavar="PATTERN",
                    help="only images whose path relative to the index's folder matches: * and ? do not cross /, "
                         "** does; a pattern without / matches file names at any depth ('*.jpg', 'IMG_2*', "
                         "'2024/**/beach/*')")
    fl.add_argument("--after", metavar="DATE",
                    help="only photos taken at or after the start of DATE (EXIF DateTimeOriginal, else the file's "
                         "mtime; local time): YYYY, YYYY-MM, YYYY-MM-DD, YYYY-MM-DDTHH:MM[:SS]")
    fl.add_argument("--before", metavar="DATE",
                    help="only photos taken before the start of DATE (same formats): --after 2024-01-01 "
                         "--before 2025-01-01 is the year 2024")
    co = se.add_argument_group(
        "cut-off", "stop listing photos when nothing matches: by default the model's own cut-off, calibrated on its "
                   "validation split when it was trained, lists nothing unless the best hit reaches one cosine, and "
                   "then the hits that reach another (90%% of the captions whose photo ranks in the top 5 still list "
                   "it); a model without one lists the top -k")
    co.add_argument("--cutoff", default="auto", choices=["auto", "none"],
                    help="auto: the model's calibrated cut-off; none: list the top -k whatever they score")
    co.add_argument("--min-score", type=float, metavar="S",
                    help="only hits with a cosine score of at least S (instead of the model's cut-off)")
    add_device(se)
    add_quiet(se)
    return se


def cmd_search(args: argparse.Namespace) -> int:
    from clip_mini.retrieval.filters import SearchFilter
    from clip_mini.retrieval.index import EmbeddingIndex, EmbeddingIndexError
    from clip_mini.features.terms import USAGE, QueryError, describe, parse_args, single_caption

    args.paths = args.paths or args.null
    if args.paths and args.json:
        raise EmbeddingIndexError("--paths (or -0) and --json are two output formats: give one")
    if not args.query and args.image is None:
        raise QueryError(f"the query is empty: search needs a text query or --image PATH; {USAGE}")
    # Bad terms (a weight, a missing image) and bad filters (a date) fail before the index is opened.
    terms = parse_args(args.query, [] if args.image is None else [args.image])
    flt = SearchFilter.of(under=args.under, glob=args.glob, after=args.after, before=args.before)
    single_text = single_caption(terms) is not None
    if args.explain and (args.grid is None or not single_text):
        raise EmbeddingIndexError("--explain draws where one caption matches into --grid PNG: give --grid and a "
                                  "single text query (no + or - terms, no image)")
    if args.grid:
        check_output_folder(args.grid, "--grid")
    index = EmbeddingIndex.load(args.index, verify=not args.no_verify)
    resolve_model_arg(args)   # a built-in name: its cached directory, found without torch
    if args.backend == "faiss" and "faiss" not in index.manifest["files"]:
        raise EmbeddingIndexError(f"--backend faiss: {args.index} has no faiss index (it was built without one); "
                                  "search it with --backend exact (or auto), or store one with "
                                  "`clip-mini index ... --faiss hnsw`")
    # The device matters only for an image query: a text query runs torch-free (the string is resolved when the
    # image tower loads, so a text search never imports torch to ask about CUDA).
    kept = flt.rows(index) if flt.active else None   # a folder outside the index's, an index without dates: fail now
    [hits] = index.hits(terms=terms, k=args.k, model_dir=args.model, backend=args.backend, device=args.device,
                        filters=flt, cutoff=args.cutoff, min_score=args.min_score)
    results = [{"rank": h["rank"], "score": round(h["score"], 6), "path": h["path"], "caption": h["caption"]}
               for h in hits]
    if hits.below and not args.quiet:
        best, hint = hits.best_below, "--cutoff none" if args.min_score is None else "a lower --min-score"
        if args.min_score is not None:
            rule = f"--min-score {args.min_score:g}"
        elif hits:
            rule = f"the model's cut-off {hits.min_score:.3f} for each hit (calibrated on its validation split)"
        else:
            rule = f"the model's cut-off {hits.min_best:.3f} for the best hit (calibrated on its validation split)"
        if hits:
            print(f"note: {hits.below} more of the top {args.k} fall below {rule}; {hint} lists them",
                  file=sys.stderr)
        else:
            print(f"no good match: the nearest, {best['path']}, scores {best['score']:.3f}, below {rule}; "
                  f"{hint} lists the nearest anyway", file=sys.stderr)
    if not args.quiet:
        if kept is not None and args.k > len(kept):
            from clip_mini.retrieval.filters import index_folder

            where = (f" (--under and --glob are relative to the index's folder {index_folder(index)})"
                     if not len(kept) and (args.glob or (args.under and not Path(args.under).is_absolute())) else "")
            print(f"note: the filters ({_filter_words(flt)}) keep {len(kept)} of the {len(index)} images in "
                  f"{args.index}" + (": listing all of them" if len(kept) else where), file=sys.stderr)
        elif args.k > len(index):
            print(f"note: -k {args.k} is more than the {len(index)} images in {args.index}: listing all of them",
                  file=sys.stderr)
    query = describe(terms[1:] if args.image else terms) if args.query else None   # --image is the first term
    if args.grid:
        from clip_mini.pictures.draw import result_grid

        from clip_mini.retrieval.wds_source import hit_image_files

        title = (repr(terms[0].value) if single_text else f"image: {args.image}" if not args.query
                 else describe(terms))
        with hit_image_files(index.items, [h["row"] for h in hits]) as files:   # shard rows: read back by offset
            heats = _match_maps(index, args, files, terms[0].value) if args.explain else None
            result_grid(files, [h["score"] for h in results], args.grid, title=title,
                        names=[Path(h["path"]).name for h in results], heats=heats)
    if args.paths:
        _print_paths([r["path"] for r in results], "\0" if args.null else "\n")
    elif args.json:
        print_json({"query": query, "image": args.image, "index": str(index.path),
                    "terms": [{"image" if t.is_image else "text": str(t.value), "weight": t.weight} for t in terms],
                    **({"filters": flt.describe(), "passing": len(kept)} if kept is not None else {}),
                    "min_score": hits.min_score, "min_best": hits.min_best, "below_min_score": hits.below,
                    "model_fingerprint": index.fingerprint, "results": results})
    else:
        print_results(results)
        if args.grid:
            print(f"grid: {args.grid}")
    if args.paths and args.grid and not args.quiet:
        print(f"grid: {args.grid}", file=sys.stderr)
    return 0 if results else EXIT_NO_HITS


def _filter_words(flt) -> str:
    return ", ".join(f"--{name} {value}" for name, value in flt.describe().items())


def _print_paths(paths: list[str], end: str) -> None:
    """One path per entry and nothing else: a path holding a newline is safe only with -0, so it is refused
    without it rather than split in two."""
    if end == "\n":
        bad = next((p for p in paths if "\n" in p), None)
        if bad is not None:
            from clip_mini.errors import InputError

            raise InputError(f"the result path {bad!r} contains a newline: print NUL-separated paths with -0")
    sys.stdout.write("".join(p + end for p in paths))


def _match_maps(index, args: argparse.Namespace, files: list[str], text: str) -> list:
    """Each hit's match map for the text query (None where the file cannot be read: the grid marks it)."""
    from clip_mini.embed import InputError, load

    embedder = load(index._model_dir(args.model), device=args.device)
    index.check_model(embedder.fingerprint, str(index._model_dir(args.model)))
    heats = []
    for f in files:
        try:
            heats.append(embedder.explain(f, text))
        except InputError:
            heats.append(None)
    return heats
