"""Index build throughput: JPEG folder -> stored embeddings, against the model forward alone, and peak memory.

    python benchmarks/speed/bench_index.py [--images ../shared/data/flickr8k/images] [--limit 2000] [--stub-files 100000]
        [--big-photos 192]

Models (``--configs``): the ``configs/tiny.yaml`` architecture (a 64 px tower: JPEG decoding is most of the work)
and ``configs/flickr8k.yaml``'s (EfficientNet-Lite0 and DINOv2 concatenated: the forward is), both untrained
(speed does not depend on the weights). Measured, each in a fresh process so peak RSS is per variant:

* ``forward``: ``model.ImageForward`` (the pass indexing runs) on ready (B, 3, S, S) tensors, fp32 and bf16, median
  batch: the ceiling for indexing;
* ``index``: ``sync_index`` on ``limit`` JPEGs (stat, sha256, decode, resize, forward, chunked writes, commit),
  fp32 and bf16, with 0 and 1 DataLoader workers; ``vs_forward`` is its images/s over the forward's at the same
  precision; ``vs_forward_same_process`` the median over rounds of its images/s over a pure forward timed in the
  same process right after it (the pair seconds apart, so the VM's drift over minutes cancels);
* ``bf16_workers0_<N>_images`` (the flickr8k model, ``--long-limit N``): the bf16 index run on N photos instead
  of 500, in every round: the per-run costs (the bf16 tower copy, the first batch's kernel setup, importing the
  image pipeline; about a second) are ~10% of 500 photos at ~50 images/s and a quarter of that at 2000;
* ``big_photos`` (the flickr8k model, ``--big-photos N``): ``sync_index`` in bf16 with 0 and 1 workers on the first
  N photos enlarged to 2000 x 1500 JPEGs (quality 90): the decoding cost of a phone or camera photo, which the
  160 px dev photos do not have, for the choice of the default worker count;
* ``stub``: the index machinery alone on ``stub_files`` tiny files (on tmpfs when available) with a stub model
  returning random vectors, showing that memory stays bounded as the file count grows (the claim: 100k images
  in under 2 GB RSS; most of the ~1 GB is torch itself).

Each model runs ``--rounds`` rounds (default 3); a round is, per precision, a forward process then its index
processes, so the ratios compare runs minutes apart at most; figures are medians over rounds (every round's in
``images_per_s_all``). Falls back to generated JPEGs when the Flickr8k folder is absent. Writes
``benchmarks/results/speed/index.json``.
``benchmarks/results/speed/index_full_decode.json`` is this script's last run before JPEGs were decoded at reduced
scale (``load_image(min_size=)``), kept for the comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402
from benchmarks.lib.repo_paths import relative_to_repo  # noqa: E402

FLICKR = ROOT.parent / "shared/data/flickr8k/images"


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss   # DataLoader workers
    return round(max(own, kids) / 1024, 1)


def make_model(out: Path, config: str) -> None:
    from clip_mini.config import load_config
    from clip_mini.model.clip import CLIPModel

    # untrained (speed does not depend on the weights); a pretrained text tower still brings its own vocabulary
    CLIPModel.build(load_config(ROOT / config).model, captions=["a photo"] * 8,
                    load_pretrained=False).save_pretrained(out)


def run_forward(model_dir: str, batch: int, n_batches: int, precision: str) -> dict:
    """The ceiling for indexing: ``model.ImageForward`` (the pass indexing runs) on ready pixel tensors, in a
    process of its own per precision as each indexing run has (an earlier pass's freed memory, kept by
    ``clip_mini.runtime.allocator``, would otherwise start the second precision off in a warmer heap)."""
    import torch

    import clip_mini
    from clip_mini.model.clip import ImageForward

    e = clip_mini.load(model_dir)
    size = e.model.preprocess.image_size
    pixels = torch.randn(batch, 3, size, size)
    forward = ImageForward(e.model, precision, "cpu")
    forward(pixels)   # warm-up
    times = []
    for _ in range(n_batches):
        t = time.perf_counter()
        forward(pixels)
        times.append(time.perf_counter() - t)
    return {"images_per_s": round(batch / sorted(times)[len(times) // 2], 1),   # median batch
            "batch": batch, "image_size": size, "threads": torch.get_num_threads(), "peak_rss_mb": _peak_rss_mb()}


def run_index(model_dir: str, folder: str, limit: int, workers: int, precision: str, out_dir: str,
              forward_batches: int = 0) -> dict:
    """``sync_index`` on the first ``limit`` images of ``folder``; then, with ``forward_batches``, the pure forward
    in the same process right after (``forward_images_per_s``): this VM's speed drifts by 5-10% over minutes, and
    the pair a few seconds apart moves together. Peak RSS is read before that forward."""
    import clip_mini
    from clip_mini.retrieval.files import scan_images
    from clip_mini.retrieval.build import sync_index

    files = scan_images(folder)[:limit]
    e = clip_mini.load(model_dir)
    t = time.perf_counter()
    index = sync_index(out_dir, e, files, workers=workers, precision=precision, progress=False)
    secs = time.perf_counter() - t
    t = time.perf_counter()
    sync_index(out_dir, e, files, workers=workers, precision=precision, progress=False)   # unchanged: stat only
    noop = time.perf_counter() - t
    out = {"images": len(index), "workers": workers, "precision": precision, "seconds": round(secs, 2),
           "images_per_s": round(len(index) / secs, 1), "unchanged_rerun_s": round(noop, 3),
           "peak_rss_mb": _peak_rss_mb()}
    if forward_batches:
        out["forward_images_per_s"] = run_forward(model_dir, 64, forward_batches, precision)["images_per_s"]
    return out


class _StubEmbedder:
    """Random unit vectors instead of a model: isolates the index machinery's time and memory."""

    def __init__(self, dim: int = 128):
        import torch

        from clip_mini.config import PreprocessConfig
        from clip_mini.data import build_eval_transform

        self.dim, self.fingerprint, self.device = dim, "stub0000stub0000", "cpu"
        self.transform = build_eval_transform(PreprocessConfig(image_size=16))
        gen = torch.Generator().manual_seed(0)

        class _Tower(torch.nn.Module):   # what indexing runs (model.ImageForward): a tower, then the head
            cfg = type("cfg", (), {"backbone": "stub"})

            def __init__(self):
                super().__init__()
                self.unused = torch.nn.Parameter(torch.zeros(1))   # gives the tower a dtype

            def forward(self, pixels):
                return torch.randn(len(pixels), dim, generator=gen)

        class _Model:
            visual = _Tower()

            def project_image(self, features):
                return features / features.norm(dim=1, keepdim=True)

        self.model = _Model()


def run_stub(n_files: int, tmp: str) -> dict:
    import numpy as np
    from PIL import Image

    from clip_mini.retrieval.build import sync_index

    folder = Path(tmp) / "stub_images"
    folder.mkdir()
    # Distinct 4x4 PNGs (distinct pixel values), so every file is hashed and embedded, none deduplicated.
    t = time.perf_counter()
    paths = []
    for i in range(n_files):
        p = folder / f"{i // 1000:03d}" / f"{i:06d}.png"
        p.parent.mkdir(exist_ok=True)
        Image.fromarray(np.full((4, 4, 3), (i % 251, (i // 251) % 251, i // 63001), np.uint8)).save(p)
        paths.append(str(p))
    made = time.perf_counter() - t
    t = time.perf_counter()
    index = sync_index(Path(tmp) / "stub_index", _StubEmbedder(), paths, batch_size=256, progress=False)
    return {"files": len(index), "make_files_s": round(made, 1), "index_s": round(time.perf_counter() - t, 1),
            "peak_rss_mb": _peak_rss_mb()}


def _child(kind: str, *args) -> dict:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--child", kind, *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} failed: {r.stderr[-3000:]}")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "process_wall_s": round(time.perf_counter() - start, 1)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", default=str(FLICKR))
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--stub-files", type=int, default=100_000)
    p.add_argument("--big-photos", type=int, default=192, help="enlarged photos for the flickr8k model (0: none)")
    p.add_argument("--configs", nargs="+", default=["configs/tiny.yaml", "configs/flickr8k.yaml"],
                   help="model architectures to index with (untrained)")
    p.add_argument("--long-limit", type=int, default=2000,
                   help="flickr8k model: also index this many photos in bf16 (0 workers) each round: a folder where "
                        "the per-run costs (tower copy, first batch, imports) weigh as they do for a user's")
    p.add_argument("--rounds", type=int, default=3, help="alternating forward/index rounds per model (medians)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/index.json"))
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        from clip_mini.runtime.allocator import keep_freed_memory

        keep_freed_memory()   # as `clip-mini index` sets it; the pure forward too, so the ratio compares like with like
        kind, *rest = args.child
        fn = {"forward": lambda: run_forward(rest[0], 64, int(rest[1]), rest[2]),
              "index": lambda: run_index(rest[0], rest[1], int(rest[2]), int(rest[3]), rest[4], rest[5],
                                         int(rest[6]) if len(rest) > 6 else 0),
              "stub": lambda: run_stub(int(rest[0]), rest[1])}[kind]
        print(json.dumps(fn()))
        return {}
    with tempfile.TemporaryDirectory(prefix="clip_mini_bench_") as tmp:
        if Path(args.images).is_dir():
            folder, recorded = args.images, relative_to_repo(args.images)
        else:
            folder, recorded = _generated_jpegs(Path(tmp) / "jpegs", args.limit), "generated 160 px JPEGs"
        result = {"machine": machine_info(), "images_folder": recorded, "loadavg_start": os.getloadavg()[0],
                  "models": {}}
        for config in args.configs:
            model_dir = Path(tmp) / Path(config).stem
            make_model(model_dir, config)
            big = "flickr8k" in config   # ~50-100 images/s: fewer images, fewer timed batches
            limit = min(args.limit, 500) if big else args.limit
            # Rounds alternate every forward and index process, so the VM's drift (5% between runs minutes
            # apart) moves both sides of each ratio alike; medians over rounds are reported, every round kept.
            fwd_rounds: dict[str, list] = {"fp32": [], "bf16": []}
            idx_rounds: dict[str, list] = {}
            for _ in range(args.rounds):
                for precision in ("fp32", "bf16"):
                    fwd_rounds[precision].append(_child("forward", model_dir, 8 if big else 10, precision))
                    runs_here = [(f"{precision}_workers{w}", limit, w) for w in (0, 1)]
                    if big and precision == "bf16" and args.long_limit > limit:
                        runs_here.append((f"bf16_workers0_{args.long_limit}_images", args.long_limit, 0))
                    for name, n, workers in runs_here:
                        idx_rounds.setdefault(name, []).append(_child(
                            "index", model_dir, folder, n, workers, precision,
                            Path(tmp) / f"index-{model_dir.name}-{name}-{len(fwd_rounds[precision])}",
                            4 if big else 10))
            forward = {**fwd_rounds["bf16"][0],
                       "images_per_s": {p: _median(r, "images_per_s") for p, r in fwd_rounds.items()},
                       "images_per_s_all": {p: [x["images_per_s"] for x in r] for p, r in fwd_rounds.items()},
                       "peak_rss_mb": {p: max(x["peak_rss_mb"] for x in r) for p, r in fwd_rounds.items()}}
            runs = {}
            for name, rounds in idx_rounds.items():
                r = {**rounds[0], "images_per_s": _median(rounds, "images_per_s"),
                     "seconds": _median(rounds, "seconds"), "peak_rss_mb": max(x["peak_rss_mb"] for x in rounds),
                     "images_per_s_all": [x["images_per_s"] for x in rounds]}
                r["vs_forward"] = round(r["images_per_s"] / forward["images_per_s"][r["precision"]], 3)
                # each round's index over the forward timed in the same process seconds later, then the median
                paired = [x["images_per_s"] / x["forward_images_per_s"] for x in rounds]
                r["vs_forward_same_process_all"] = [round(v, 3) for v in paired]
                r["vs_forward_same_process"] = round(statistics.median(paired), 3)
                r.pop("forward_images_per_s")
                runs[name] = r
            best_name, best = max(runs.items(), key=lambda kv: kv[1]["images_per_s"])
            result["models"][config] = {"forward": forward, "index": runs, "best": {
                "run": best_name, "images_per_s": best["images_per_s"],
                "vs_forward_same_precision": best["vs_forward"]}}
            if big and args.big_photos:
                photos = _enlarged_jpegs(folder, Path(tmp) / "big_photos", args.big_photos)
                result["models"][config]["big_photos"] = {"size": "2000x1500", **{
                    f"bf16_workers{w}": _child("index", model_dir, photos, args.big_photos, w, "bf16",
                                               Path(tmp) / f"index-big-{w}") for w in (0, 1)}}
            print(json.dumps({config: result["models"][config]}), flush=True)
        if args.stub_files:
            # On tmpfs when there is one: creating and deleting 100k files on a busy disk takes minutes of
            # writeback that has nothing to do with the index.
            shm = Path("/dev/shm")
            with tempfile.TemporaryDirectory(prefix="clip_mini_stub_", dir=shm if shm.is_dir() else tmp) as stub:
                result["stub"] = _child("stub", args.stub_files, stub)
        result["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))
    from clip_mini.fileio.atomic import atomic_write_json

    atomic_write_json(args.out, result)
    return result


def _median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 2)


def _enlarged_jpegs(src: str | Path, folder: Path, n: int) -> Path:
    from PIL import Image

    folder.mkdir(parents=True)
    for path in sorted(Path(src).glob("*.jpg"))[:n]:
        with Image.open(path) as im:
            im.convert("RGB").resize((2000, 1500), Image.BICUBIC).save(folder / path.name, quality=90)
    return folder


def _generated_jpegs(folder: Path, n: int) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        base = np.linspace(0, 255, 160, dtype=np.float32)
        img = (base[None, :, None] * rng.random(3) + rng.normal(0, 8, (160, 160, 3))).clip(0, 255)
        Image.fromarray(img.astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=90)
    return folder


if __name__ == "__main__":
    main()
