"""``clip-mini search``: rank an index's images for a text or image query (a text query never imports torch unless
``--explain`` draws match maps)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clip_mini.cli.common import add_device, add_quiet, check_output_folder, command_parser, positive_int
from clip_mini.cli.printing import print_json, print_results


def add_arguments(sub) -> argparse.ArgumentParser:
    se = command_parser(
        sub, "search", "search an index with a text (or an image) query",
        "Rank the images of an index by cosine similarity to a text query (or to an image with --image).\n"
        "A text query never imports torch; paths are printed absolute.",
        'clip-mini search --index indexes/photos "a dog running on grass" -k 5 --grid hits.png',
        "clip-mini search --index indexes/photos --image query.jpg --json",
        'clip-mini search --index indexes/photos "a red car" -k 8 --explain --grid hits.png')
    se.add_argument("--index", required=True, help="index directory")
    se.add_argument("query", nargs="?", help="text query")
    se.add_argument("--image", help="image query (image-to-image search)")
    se.add_argument("-k", type=positive_int, default=10,
                    help="number of results (at most the index's size: a larger k lists every image, with a note)")
    se.add_argument("--model", help="model directory (default: the one recorded in the index)")
    se.add_argument("--backend", default="auto", choices=["auto", "exact", "faiss"], help="search back end")
    se.add_argument("--json", action="store_true", help="print JSON instead of a table")
    se.add_argument("--grid", metavar="PNG", help="draw the results with rank, score and file name into this PNG")
    se.add_argument("--explain", action="store_true",
                    help="with --grid and a text query: overlay on each hit where it matches the query (loads "
                         "the model with torch: Embedder.explain)")
    se.add_argument("--no-verify", action="store_true", help="skip the checksum of the index files")
    add_device(se)
    add_quiet(se)
    return se


def cmd_search(args: argparse.Namespace) -> int:
    from clip_mini.retrieval.index import EmbeddingIndex, EmbeddingIndexError

    if (args.query is None) == (args.image is None):
        raise EmbeddingIndexError("search needs a text query or --image PATH (exactly one)")
    if args.query is not None and not args.query.strip():
        raise EmbeddingIndexError("the text query is empty")
    if args.explain and (args.grid is None or args.query is None):
        raise EmbeddingIndexError("--explain draws where a text query matches into --grid PNG: give both a text "
                                  "query and --grid")
    if args.grid:
        check_output_folder(args.grid, "--grid")
    index = EmbeddingIndex.load(args.index, verify=not args.no_verify)
    if args.backend == "faiss" and "faiss" not in index.manifest["files"]:
        raise EmbeddingIndexError(f"--backend faiss: {args.index} has no faiss index (it was built without one); "
                                  "search it with --backend exact (or auto), or store one with "
                                  "`clip-mini index ... --faiss hnsw`")
    if args.image is not None and not Path(args.image).is_file():
        from clip_mini.embed import InputError

        what = "is a directory, not an image file" if Path(args.image).is_dir() else "not found"
        raise InputError(f"query image {what}: {args.image}")
    # The device matters only for an image query: a text query runs torch-free (the string is resolved when the
    # image tower loads, so a text search never imports torch to ask about CUDA).
    [hits] = index.hits(texts=None if args.query is None else [args.query],
                        images=None if args.image is None else [args.image],
                        k=args.k, model_dir=args.model, backend=args.backend, device=args.device)
    results = [{"rank": h["rank"], "score": round(h["score"], 6), "path": h["path"], "caption": h["caption"]}
               for h in hits]
    if args.k > len(index) and not args.quiet:
        print(f"note: -k {args.k} is more than the {len(index)} images in {args.index}: listing all of them",
              file=sys.stderr)
    if args.grid:
        from clip_mini.pictures.draw import result_grid

        from clip_mini.retrieval.wds_source import hit_image_files

        title = f"{args.query!r}" if args.query is not None else f"image: {args.image}"
        with hit_image_files(index.items, [h["row"] for h in hits]) as files:   # shard rows: read back by offset
            heats = _match_maps(index, args, files) if args.explain else None
            result_grid(files, [h["score"] for h in results], args.grid, title=title,
                        names=[Path(h["path"]).name for h in results], heats=heats)
    if args.json:
        print_json({"query": args.query, "image": args.image, "index": str(index.path),
                    "model_fingerprint": index.fingerprint, "results": results})
    else:
        print_results(results)
        if args.grid:
            print(f"grid: {args.grid}")
    return 0


def _match_maps(index, args: argparse.Namespace, files: list[str]) -> list:
    """Each hit's match map for the text query (None where the file cannot be read: the grid marks it)."""
    from clip_mini.embed import InputError, load

    embedder = load(index._model_dir(args.model), device=args.device)
    index.check_model(embedder.fingerprint, str(index._model_dir(args.model)))
    heats = []
    for f in files:
        try:
            heats.append(embedder.explain(f, args.query))
        except InputError:
            heats.append(None)
    return heats
