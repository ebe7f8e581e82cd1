"""``clip-mini convert``: write a captions file (or a config's splits) as WebDataset shards."""
from __future__ import annotations

import argparse

from clip_mini.cli.common import positive_int


def add_arguments(sub) -> argparse.ArgumentParser:
    cv = sub.add_parser("convert", help="write a captions file (or a config's split) as WebDataset shards")
    cv.add_argument("--to-webdataset", action="store_true", required=True, help="the output format (tar shards)")
    cv.add_argument("--out", required=True, help="output folder (replaced as a whole): 000000.tar, ...")
    cin = cv.add_mutually_exclusive_group(required=True)
    cin.add_argument("--captions", help="captions file: CSV/TSV, Flickr8k token file or COCO JSON")
    cin.add_argument("--data", help="config YAML: convert its data section's splits")
    cv.add_argument("--split", choices=["train", "val", "test"], help="with --data: only this split")
    cv.add_argument("--image-root", help="with --captions: folder the image names are relative to")
    cv.add_argument("--format", default="auto", choices=["auto", "csv", "tsv", "flickr8k", "coco"])
    cv.add_argument("--shard-size", type=positive_int, default=1000, help="samples per shard")
    cv.add_argument("--seed", type=int, default=0, help="shuffle seed of the sample order")
    cv.add_argument("--no-shuffle", action="store_true", help="keep the captions file's order")
    cv.add_argument("--quiet", action="store_true")
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
