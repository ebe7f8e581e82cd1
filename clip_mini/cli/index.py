"""``clip-mini index``: embed a folder of images, a captions file, a config's images or WebDataset shards."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

from clip_mini.cli.common import (MODEL_HELP, command_parser, add_device, add_quiet, positive_int, count,
                                  resolve_model_arg)


def add_arguments(sub) -> argparse.ArgumentParser:
    ix = command_parser(
        sub, "index", "embed a folder of images (or a dataset's) into an index directory",
        "Embed images into an index directory: incremental (only new or changed files are embedded), resumable\n"
        "after a kill, and readable while it is being updated. Item paths are stored relative to the indexed\n"
        "folder, so the folder and its index can be moved together.",
        "clip-mini index --model runs/tiny/best --images photos/ --out indexes/photos",
        "clip-mini index --images photos/ --out indexes/photos   # the built-in model 'photos' (clip-mini models)",
        "clip-mini index --model runs/tiny/best --images photos/ --out indexes/photos --exclude-dir @eaDir "
        "--exclude-dir drafts",
        "clip-mini index --model runs/tiny/best --captions data/shapes/captions.csv --out indexes/shapes")
    ix.add_argument("--out", required=True, help="index directory (created, or updated incrementally)")
    ix.add_argument("--model", help=MODEL_HELP[:-1] + "; default for a new index: the built-in model "
                                 "'photos', when installed)")
    src = ix.add_mutually_exclusive_group()
    src.add_argument("--images", help="folder of images (searched recursively)")
    src.add_argument("--captions", metavar="FILE",
                     help="captions file (image,caption CSV/TSV, Flickr8k or COCO JSON): its images, with their "
                          "captions, without a config")
    src.add_argument("--data", help="config YAML whose data.captions images (and captions) are indexed")
    src.add_argument("--merge", nargs="*", metavar="SHARD", help="merge shard indexes (default: OUT/shards/*)")
    src.add_argument("--shards", metavar="PATTERN", help="WebDataset shards, e.g. 'data/wds/{000000..000099}.tar'")
    ix.add_argument("--add", action="store_true",
                    help="keep rows of files not listed now (default: mirror the folder: rows of files that are "
                         "gone are dropped, and counted)")
    ix.add_argument("--exclude-dir", action="append", metavar="NAME",
                    help="with --images: a directory name never entered, at any depth; repeat it for several. "
                         "Giving it replaces the defaults: @eaDir, node_modules, .git, 'System Volume Information'")
    ix.add_argument("--include-hidden", action="store_true",
                    help="with --images: also index hidden files and folders (names starting with '.')")
    ix.add_argument("--shard", help="i/n: index only shard i of n (into OUT/shards/i-of-n); merge with --merge")
    ix.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                    help="with --shards: embed on Ray (no ADDRESS: a local Ray instance; else join that cluster)")
    ix.add_argument("--ray-workers", type=positive_int, default=2, help="with --ray: embedding actors")
    ix.add_argument("--batch-size", type=positive_int, default=64, help="images per forward pass")
    ix.add_argument("--workers", type=count, default=None,
                    help="DataLoader workers decoding images (default: none on a CPU, 4 on a GPU)")
    ix.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                    help="image tower precision (auto: bf16 on a GPU of compute capability 8.0 or newer or a CPU "
                         "with native bf16 (AVX-512 BF16 or AMX), much faster than fp32 within 1e-2 cosine; else "
                         "fp32). fp16: for older GPUs (V100, T4), whose tensor cores have no bf16)")
    ix.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help=argparse.SUPPRESS)
    ix.add_argument("--faiss", default="auto", choices=["auto", "none", "hnsw", "ivf", "ivfpq"],
                    help="store a faiss index too (auto, when faiss is installed: HNSW from 500k rows, IVF-PQ "
                         "with exact re-ranking from 1M); its search parameter is tuned to --recall-target")
    ix.add_argument("--recall-target", type=float, default=None, metavar="R",
                    help="recall@10 against exact search that the stored faiss index is tuned to (default 0.95; "
                         "measured on text-like proxy queries, see clip_mini/retrieval/faiss_auto.py)")
    ix.add_argument("--dtype", choices=["float16", "bfloat16"], default=None,
                    help="how the rows are stored (default: an existing index's, else float16). bfloat16: exact "
                         "search reads the rows straight into a native-bf16 CPU's products (faster on large "
                         "indexes), at 8 significant bits instead of 11 (cosines within ~4e-3 of float32)")
    ix.add_argument("--flip-average", action="store_true",
                    help="average each image's row with its mirror image's: 2x indexing time, better recall; fixed "
                         "per index like its model (an update with the other setting is refused)")
    ix.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                    help="RAM the faiss index may take, for --faiss auto (default: half the memory available): "
                         "HNSW when it fits, else IVF-PQ")
    add_device(ix)
    add_quiet(ix)
    return ix


def cmd_index(args: argparse.Namespace) -> int:
    from clip_mini.retrieval.format import EmbeddingIndexError, parse_shard
    from clip_mini.retrieval.shards import merge_indexes

    progress = not args.quiet
    if args.merge is not None:
        index = merge_indexes(args.out, args.merge or None, faiss=args.faiss, progress=progress, dtype=args.dtype)
        print(f"merged into {index.path}: {len(index)} images")
        return 0
    if args.shards is not None or args.ray is not None:
        return _index_shards(args, progress)
    if args.images is None and args.data is None and args.captions is None:
        raise EmbeddingIndexError("index needs --model and one of --images FOLDER, --captions FILE or --data CONFIG "
                                  "(or --merge)")
    if args.model is None:
        _default_model(args, EmbeddingIndexError)
    from clip_mini.runtime.devices import resolve_device, resolve_precision

    device = resolve_device(args.device)   # a bad --device fails before anything is read
    shard, world = _shard_from(args.shard, parse_shard)
    if world is not None and device.type == "cuda":
        device = _rank_device()
    precision = resolve_precision(args.precision, device)   # of the GPU this rank runs on
    _hint(precision, device, progress)
    images, captions, source = _index_inputs(args)
    from clip_mini.embed import load
    from clip_mini.retrieval.build import sync_index

    resolve_model_arg(args)   # a built-in name: built into the user cache once; the index records the directory
    embedder = load(args.model, device=device, batch_size=args.batch_size)
    index = sync_index(args.out, embedder, images, captions=captions, prune=not args.add,
                       batch_size=args.batch_size, workers=args.workers,
                       precision=precision, faiss=args.faiss, shard=shard, source=source,
                       model_dir=args.model, progress=progress, recall_target=args.recall_target,
                       memory_budget=None if args.memory_budget is None else args.memory_budget * 2**30,
                       dtype=args.dtype, flip_average=args.flip_average)
    print(f"index {index.path}: {len(index)} images, generation {index.manifest['generation']}; "
          f"{index.changes['added']} added, {index.changes['dropped']} dropped"
          + (" (files gone or no longer listed)" if index.changes["dropped"] else ""))
    if world is not None:   # launched by torchrun: wait for every rank, then rank 0 merges the shards
        world.barrier()
        if shard[0] == 0:
            merged = merge_indexes(args.out, None, faiss=args.faiss, progress=progress, dtype=args.dtype)
            print(f"merged {shard[1]} shards into {merged.path}: {len(merged)} images")
        world.barrier()
        world.destroy_process_group()
    return 0


def _default_model(args: argparse.Namespace, error) -> None:
    """No --model: a new index gets the built-in default model; an existing one needs the model it was built with
    (as before built-in models), so that a forgotten --model never reaches its fingerprint check."""
    from pathlib import Path

    from clip_mini.builtin.registry import DEFAULT_MODEL, list_models

    out = Path(args.out)
    if (out / "manifest.json").exists() or (out / "shards").exists():
        try:
            built_with = f" ({json.loads((out / 'manifest.json').read_text(encoding='utf-8'))['model_dir']})"
        except (OSError, ValueError, KeyError, TypeError):
            built_with = ""
        raise error(f"index needs --model: {out} is an existing index, updated with the model it was built with"
                    f"{built_with}: give --model DIR (or a built-in name)")
    if DEFAULT_MODEL not in list_models():
        raise error("index needs --model DIR (a model directory or a built-in name: no built-in model "
                    f"'{DEFAULT_MODEL}' is installed) and one of --images FOLDER, --captions FILE or --data CONFIG "
                    "(or --merge)")
    args.model = DEFAULT_MODEL
    if not args.quiet:
        print(f"no --model: using the built-in model '{DEFAULT_MODEL}'", file=sys.stderr)


def _index_shards(args: argparse.Namespace, progress: bool) -> int:
    """``index --shards PATTERN [--ray [ADDRESS]]``: WebDataset shards into an index (see retrieval.wds_source)."""
    from clip_mini.retrieval.format import EmbeddingIndexError

    if args.shards is None or args.model is None:
        raise EmbeddingIndexError("index --shards needs --model (a model directory or built-in name) and --shards "
                                  "PATTERN (--ray works with --shards)")
    if args.shard is not None or args.add or args.exclude_dir is not None or args.include_hidden:
        raise EmbeddingIndexError("--shard, --add, --exclude-dir and --include-hidden are for image folders; "
                                  "--shards indexes shard by shard already")
    resolve_model_arg(args)
    from clip_mini.data.webdataset import expand_shards
    from clip_mini.embed import load
    from clip_mini.retrieval.wds_source import index_shards
    from clip_mini.runtime.devices import resolve_precision

    shards = expand_shards(args.shards)
    embed = None
    if args.ray is not None:
        from clip_mini.retrieval.ray_index import ray_embedder

        # The actors pick their device and precision where they run (their GPUs are not the driver's); the
        # driver's own model, which only checks and records the index, stays on its CPU.
        embedder = load(args.model, device="cpu", batch_size=args.batch_size)
        precision = args.precision
        # the actors load the model where they run, in their own working folder: an absolute path
        embed = ray_embedder(os.path.abspath(args.model), None if args.ray == "local" else args.ray, args.ray_workers,
                             args.batch_size, precision, progress, device=args.device,
                             flip_average=args.flip_average)
    else:
        embedder = load(args.model, device=args.device, batch_size=args.batch_size)
        precision = resolve_precision(args.precision, embedder.device)
        _hint(precision, embedder.device, progress)
    index = index_shards(args.out, embedder, shards, batch_size=args.batch_size, precision=precision,
                         faiss=args.faiss, source=args.shards, model_dir=args.model, progress=progress, embed=embed,
                         dtype=args.dtype, flip_average=args.flip_average)
    report = getattr(embed, "report", None)   # a Ray pass: where the rows were read and embedded
    if report is not None:
        lines = report.lines()
        for line in lines if progress else [ln for ln in lines if not ln.startswith("ray:   node ")]:
            print(line)
    print(f"index {index.path}: {len(index)} images from {len(shards)} shards, generation "
          f"{index.manifest['generation']}")
    return 0


def _hint(precision: str, device, progress: bool) -> None:
    from clip_mini.runtime.devices import precision_hint

    hint = precision_hint(precision, device)
    if hint and progress:
        print(f"index: {hint}", file=sys.stderr)


def _shard_from(text, parse_shard):
    """``--shard i/n``, or the rank under torchrun (returns the shard and the initialised torch.distributed)."""
    if text is not None:
        return parse_shard(text), None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from datetime import timedelta

        import torch.distributed as dist

        # The barrier after indexing waits for the slowest shard, which can take hours: not the 30 min default.
        # gloo on GPUs too: the group only carries barriers, never tensors.
        dist.init_process_group("gloo", timeout=timedelta(hours=48))
        return (dist.get_rank(), dist.get_world_size()), dist
    return None, None


def _rank_device():
    """Under torchrun each rank embeds on its own GPU: ``cuda:LOCAL_RANK`` (modulo the GPUs there are)."""
    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def _index_inputs(args: argparse.Namespace):
    from clip_mini.retrieval.format import EmbeddingIndexError

    from clip_mini.retrieval.files import scan_images

    if args.images is None and (args.exclude_dir is not None or args.include_hidden):
        raise EmbeddingIndexError("--exclude-dir and --include-hidden choose the files of --images FOLDER; "
                                  "--captions and --data list their images themselves")
    if args.images is not None:
        images = scan_images(args.images, include_hidden=args.include_hidden,
                             **({} if args.exclude_dir is None else {"exclude_dirs": args.exclude_dir}))
        if not images:
            raise EmbeddingIndexError(f"no images found under {args.images} (looked for .jpg, .png, .webp, ...)")
        return images, None, os.path.abspath(args.images)
    from clip_mini.config import DataConfig, load_config
    from clip_mini.data import load_table

    data = DataConfig(captions=args.captions) if args.captions is not None else load_config(args.data).data
    with contextlib.redirect_stdout(io.StringIO() if args.quiet else sys.stderr):
        df = load_table(data, report_dir=None, progress=not args.quiet)   # its summary line is an info line
    captions = df.groupby("path", sort=False)["caption"].agg(" | ".join).to_dict()
    return list(captions), captions, os.path.abspath(data.captions)
