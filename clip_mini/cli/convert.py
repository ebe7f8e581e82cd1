"""``clip-mini convert``: write a captions file (or a config's splits) as WebDataset shards."""
from __future__ import annotations

import argparse

from clip_mini.cli.common import command_parser, positive_int


def add_arguments(sub) -> argparse.ArgumentParser:
    cv = command_parser(
        sub, "convert", "write a captions file (or a config's split) as WebDataset shards",
        "Write image-caption pairs as WebDataset tar shards (000000.tar, ...): each image once, with all its\n"
        "captions, in a shuffled order. Train on them with data.format: webdataset, index them with\n"
        "`clip-mini index --shards`.",
        "clip-mini convert --to-webdataset --captions data/shapes/captions.csv --out data/shapes-wds",
        "clip-mini convert --to-webdataset --data configs/tiny.yaml --split train --out data/tiny-wds")
    cv.add_argument("--to-webdataset", action="store_true", required=True, help="the output format (tar shards)")
    cv.add_argument("--out", required=True, help="output folder (replaced as a whole): 000000.tar, ...")
    cin = cv.add_mutually_exclusive_group(required=True)
    cin.add_argument("--captions", help="captions file: CSV/TSV, Flickr8k token file or COCO JSON")
    cin.add_argument("--data", help="config YAML: convert its data section's splits")
    cv.add_argument("--split", choices=["train", "val", "test"], help="with --data: only this split")
    cv.add_argument("--image-root", help="with --captions: folder the image names are relative to")
    cv.add_argument("--format", default="auto", choices=["auto", "csv", "tsv", "flickr8k", "coco"],
                    help="captions file format (auto: from its name and content)")
    cv.add_argument("--shard-size", type=positive_int, default=1000, help="samples per shard")
    cv.add_argument("--seed", type=int, default=0, help="shuffle seed of the sample order")
    cv.add_argument("--no-shuffle", action="store_true", help="keep the captions file's order")
    cv.add_argument("--quiet", action="store_true", help="no progress bar")
    return cv


def cmd_convert(args: argparse.Namespace) -> int:
    from clip_mini.data.convert import convert_to_webdataset, table_for

    if args.split is not None and args.data is None:
        from clip_mini.data.readers import DataError

        raise DataError("--split needs --data CONFIG")
    stats = convert_to_webdataset(table_for(args), args.out, args.shard_size,
                                  None if args.no_shuffle else args.seed, progress=not args.quiet)
    print(f"wrote {stats['samples']} samples in {stats['shards']} shards: {stats['pattern']}"
          + (f" ({len(stats['skipped'])} unreadable images skipped, see stats.json)" if stats["skipped"] else ""))
    return 0
