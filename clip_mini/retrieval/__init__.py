"""Retrieval: index directories of image embeddings, and searching them.

Imports run one way (each module imports only those above it)::

    rows     stored embedding rows: float16, or bfloat16 bits read as float32 (index --dtype)
    search   exact search (four kernels, one result, ties by row id) and faiss's approximate indexes (a package)
    items    the columnar, memory-mapped items table (format version 4), read row by row
    taken    when each photo was taken (EXIF, else mtime), read while a build hashes the file
    faiss_auto  index --faiss auto: tune the faiss search parameter to a recall target on proxy queries
    format   the directory format: manifest, items table, generations, atomic commits, writer lock, shard layout
    dupe_groups  near-duplicate groups from linked pairs: single or complete linkage, weakest link, lowest pair
    dupes    near-duplicate pairs from stored rows (exact pairs, or faiss range search at scale), grouped
    files    the image folder an index is built from (the file walk and batched embedding: clip_mini.features)
    reader   IndexReader: one generation opened read-only, searched
    filters  search filters (folder, glob, date range): the rows they keep, searched exactly before the top-k
    build    sync_index: make an index hold a list of images (incremental, resumable)
    shards   merge_indexes: shard indexes into one
    wds_source  index_shards: WebDataset tar shards into an index (rows record shard, key, offset)
    ray_index   the same embedding pass as a Ray Data pipeline (index --shards ... --ray)
    preprocess_np  the eval image transform in numpy (no torch, albumentations or OpenCV on a query)
    query    text and image query encoders on onnxruntime (torch-free)
    engine   QueryEngine: query embeddings (text or image) from a model directory, loaded once
    index    EmbeddingIndex: the public class on top of all of them

The CLI (``clip_mini.cli.main``) and ``clip-mini serve`` sit on top; nothing here imports the trainer.
"""
