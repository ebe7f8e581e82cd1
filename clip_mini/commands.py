"""The bodies of the ``clip-mini`` commands (argument parsing lives in ``clip_mini.cli``).

Each ``cmd_*`` takes the parsed arguments, calls the library and prints; each imports only what it needs, so a
text search stays free of torch.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

from clip_mini.printing import print_json, print_results, rounded
from clip_mini.retrieval.index import EmbeddingIndex, EmbeddingIndexError


# -- index -----------------------------------------------------------------------------------------------------
def cmd_index(args: argparse.Namespace) -> int:
    from clip_mini.retrieval.format import parse_shard
    from clip_mini.retrieval.shards import merge_indexes

    progress = not args.quiet
    if args.merge is not None:
        index = merge_indexes(args.out, args.merge or None, faiss=args.faiss, progress=progress, dtype=args.dtype)
        print(f"merged into {index.path}: {len(index)} images")
        return 0
    if args.shards is not None or args.ray is not None:
        return _index_shards(args, progress)
    if args.model is None or (args.images is None and args.data is None and args.captions is None):
        raise EmbeddingIndexError("index needs --model and one of --images FOLDER, --captions FILE or --data CONFIG "
                                  "(or --merge)")
    from clip_mini.devices import resolve_device, resolve_precision

    device = resolve_device(args.device)   # a bad --device fails before anything is read
    precision = resolve_precision(args.precision, device)
    shard, world = _shard_from(args.shard, parse_shard)
    if world is not None and device.type == "cuda":
        device = _rank_device()
    images, captions, source = _index_inputs(args)
    import clip_mini
    from clip_mini.retrieval.build import sync_index

    embedder = clip_mini.load(args.model, device=device, batch_size=args.batch_size)
    index = sync_index(args.out, embedder, images, captions=captions, prune=not args.add,
                       batch_size=args.batch_size, workers=args.workers,
                       precision=precision, faiss=args.faiss, shard=shard, source=source,
                       model_dir=args.model, progress=progress, recall_target=args.recall_target,
                       memory_budget=None if args.memory_budget is None else args.memory_budget * 2**30,
                       dtype=args.dtype)
    print(f"index {index.path}: {len(index)} images, generation {index.manifest['generation']}")
    if world is not None:   # launched by torchrun: wait for every rank, then rank 0 merges the shards
        world.barrier()
        if shard[0] == 0:
            merged = merge_indexes(args.out, None, faiss=args.faiss, progress=progress, dtype=args.dtype)
            print(f"merged {shard[1]} shards into {merged.path}: {len(merged)} images")
        world.barrier()
        world.destroy_process_group()
    return 0


def _index_shards(args: argparse.Namespace, progress: bool) -> int:
    """``index --shards PATTERN [--ray [ADDRESS]]``: WebDataset shards into an index (see retrieval.wds_source)."""
    if args.shards is None or args.model is None:
        raise EmbeddingIndexError("index --shards needs --model DIR and --shards PATTERN (--ray works with --shards)")
    if args.shard is not None or args.add:
        raise EmbeddingIndexError("--shard and --add are for image folders; --shards indexes shard by shard already")
    import clip_mini
    from clip_mini.data.webdataset import expand_shards
    from clip_mini.retrieval.wds_source import index_shards

    shards = expand_shards(args.shards)
    embedder = clip_mini.load(args.model, batch_size=args.batch_size)
    from clip_mini.devices import resolve_device, resolve_precision

    precision = resolve_precision(args.precision, resolve_device(args.device))
    embed = None
    if args.ray is not None:
        from clip_mini.retrieval.ray_index import ray_embedder

        embed = ray_embedder(args.model, None if args.ray == "local" else args.ray, args.ray_workers,
                             args.batch_size, precision, progress)
    index = index_shards(args.out, embedder, shards, batch_size=args.batch_size, precision=precision,
                         faiss=args.faiss, source=args.shards, model_dir=args.model, progress=progress, embed=embed,
                         dtype=args.dtype)
    print(f"index {index.path}: {len(index)} images from {len(shards)} shards, generation "
          f"{index.manifest['generation']}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from clip_mini.convert import convert_to_webdataset, table_for

    if args.split is not None and args.data is None:
        from clip_mini.data.readers import DataError

        raise DataError("--split needs --data CONFIG")
    stats = convert_to_webdataset(table_for(args), args.out, args.shard_size,
                                  None if args.no_shuffle else args.seed, progress=not args.quiet)
    print(f"wrote {stats['samples']} samples in {stats['shards']} shards: {stats['pattern']}"
          + (f" ({len(stats['skipped'])} unreadable images skipped, see stats.json)" if stats["skipped"] else ""))
    return 0


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
    from clip_mini.retrieval.files import scan_images

    if args.images is not None:
        images = scan_images(args.images)
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


# -- search ----------------------------------------------------------------------------------------------------
def cmd_search(args: argparse.Namespace) -> int:
    if (args.query is None) == (args.image is None):
        raise EmbeddingIndexError("search needs a text query or --image PATH (exactly one)")
    if args.query is not None and not args.query.strip():
        raise EmbeddingIndexError("the text query is empty")
    index = EmbeddingIndex.load(args.index, verify=not args.no_verify)
    model_dir = args.model or index.manifest.get("model_dir")
    if not model_dir:
        raise EmbeddingIndexError(f"index {args.index} does not record its model: pass --model DIR")
    if not Path(model_dir).is_dir():
        raise EmbeddingIndexError(f"model directory {model_dir} (used to build {args.index}) is gone: pass --model")
    from clip_mini.retrieval.engine import QueryEngine

    # The device matters only for an image query: a text query runs torch-free (the string is resolved when the
    # image tower loads, so a text search never imports torch to ask about CUDA).
    engine = QueryEngine.load(model_dir, device=args.device)
    engine.check_index(index)
    if args.query is not None:
        queries = engine.encode_text([args.query])
    else:
        if not Path(args.image).is_file():
            from clip_mini.embed import InputError

            what = "is a directory, not an image file" if Path(args.image).is_dir() else "not found"
            raise InputError(f"query image {what}: {args.image}")
        queries = engine.encode_image([args.image])
    scores, ids = index.search(queries, args.k, args.backend)
    hits = [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
    results = [{"rank": r + 1, "score": round(s, 6), "path": index.items["path"][i],
                "caption": index.items["caption"][i]} for r, (i, s) in enumerate(hits)]
    if args.grid:
        from clip_mini.viz import result_grid

        from clip_mini.retrieval.wds_source import hit_image_files

        title = f"{args.query!r}" if args.query is not None else f"image: {args.image}"
        with hit_image_files(index.items, [i for i, _ in hits]) as files:   # shard rows: read back by offset
            result_grid(files, [h["score"] for h in results], args.grid, title=title,
                        names=[Path(h["path"]).name for h in results])
    if args.json:
        print_json({"query": args.query, "image": args.image, "index": str(index.path),
                    "model_fingerprint": index.fingerprint, "results": results})
    else:
        print_results(results)
        if args.grid:
            print(f"grid: {args.grid}")
    return 0


# -- eval ------------------------------------------------------------------------------------------------------
def cmd_eval(args: argparse.Namespace) -> int:
    from clip_mini.model_eval import DEFAULT_TEMPLATES, EvalError, evaluate_retrieval, evaluate_zero_shot

    from clip_mini.devices import default_workers, resolve_device

    if (args.data is None) == (args.labels is None):
        raise EvalError("eval needs --data CONFIG (retrieval) or --labels FILE (zero-shot), one of them")
    device = resolve_device(args.device)
    workers, progress = default_workers(args.workers, device), not args.quiet
    # Progress lines from the data pipeline go to stderr: stdout carries only the results (pipeable JSON).
    with contextlib.redirect_stdout(io.StringIO() if args.quiet else sys.stderr):
        if args.labels is not None:
            out = evaluate_zero_shot(args.model, args.labels, args.images, args.label_col,
                                     args.template or DEFAULT_TEMPLATES, args.batch_size or 64, workers,
                                     progress=progress, precision=args.precision, device=device)
        else:
            out = evaluate_retrieval(args.model, args.data, args.split, args.set, args.batch_size, workers,
                                     progress=progress, precision=args.precision, device=device)
    if args.labels is not None:
        keys = [k for k in out if k.startswith("top")]
    else:
        keys = [f"{d}_{m}" for d in ("t2i", "i2t") for m in ("r1", "r5", "r10", "medr")] + ["rsum", "loss"]
    if args.json:
        print_json(out)
        return 0
    head = {k: out[k] for k in ("split", "precision", "n_images", "n_captions", "n_classes", "n_dropped_images")
            if k in out}
    print("  ".join(f"{k}={v}" for k, v in rounded(head).items()))
    for k in keys:
        v = out[k]
        print(f"{k:>10}  {v:.2f}" if k.endswith("medr") or k in ("rsum", "loss") else f"{k:>10}  {100 * v:.2f}%")
    return 0


# -- attention -------------------------------------------------------------------------------------------------
def cmd_attention(args: argparse.Namespace) -> int:
    import clip_mini
    from clip_mini.attention import attention_map, image_backbone
    from clip_mini.data import load_image
    from clip_mini.embed import InputError
    from clip_mini.viz import attention_overlay

    if not 0.0 <= args.alpha <= 1.0:
        raise InputError(f"--alpha must be in [0, 1], got {args.alpha}")
    from clip_mini.devices import resolve_device

    device = resolve_device(args.device)
    backbone = image_backbone(args.model)   # from config.json: refuse before loading weights or reading the image
    if backbone != "vit":
        raise InputError(f"attention maps need a ViT image tower; {args.model} uses {backbone}")
    image = load_image(args.image)
    embedder = clip_mini.load(args.model, device=device)
    if embedder.model.preprocess.resize_mode == "center_crop":   # the patch grid covers the centre square only
        h, w = image.shape[:2]
        s = min(h, w)
        image = image[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
    heat = attention_map(embedder.model, embedder.transform(image), args.mode)
    size = attention_overlay(image, heat, args.out, alpha=args.alpha, size=args.size or None)
    print(f"attention ({args.mode}, {heat.shape[0]}x{heat.shape[1]} patches) -> {args.out} ({size[0]}x{size[1]})")
    return 0
