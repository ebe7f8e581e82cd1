"""Approximate search measured on text-like queries: recall@10 vs latency for HNSW, IVF-Flat and IVF-PQ + re-rank.

    python benchmarks/speed/bench_ann_real.py [--model runs/quality/d/best] [--rows 1000000] [--queries 500]

1. Real embeddings: the Flickr8k val split (500 photos, 2,500 captions; configs/flickr8k.yaml's split) embedded
   by a trained flickr8k model (``--model``; cached in ``--cache``). Measured: text->image cosine of the best, the
   10th best and the true image, R@1 / R@10, mean cross-modal and within-image cosine, the modality gap.
   Val, not test: these statistics only calibrate the generator below, so a held-out split the model has not
   trained on is all they need, and the test split's labels are read only by scorings in the test ledger
   (``clip_mini.eval.ledger``). Runs before this change used the test split (1,000 photos); their looks are
   back-filled in the ledger.
2. A generator reproducing them: image rows from a 20-component Gaussian mixture fitted to the photo embeddings
   (k-means centres, shared within-cluster covariance), normalised; a caption of image x is
   ``mean_text + (x - mean_image) A + g * e`` normalised, with A the ridge regression of caption embeddings on
   their photo's (ridge lambda) and e Gaussian with the regression residuals' covariance. lambda and g are picked
   on a small grid to match the real median best and 10th-best text->image cosines at the real size (500
   images, 5 captions each); both real and generated statistics are reported.
3. ``--rows`` generated image rows (float16, as an index stores them) and ``--queries`` generated captions of
   random generated images; exact top-10 by brute force; then HNSW (M=32, efSearch sweep), IVF-Flat (nprobe
   sweep) and IVF-PQ with exact re-ranking from the float16 rows (nprobe sweep), each with recall@10, latency per
   query (a batch of all queries on one thread, divided by the count) and the index's memory beside the raw rows.
   The parameter ``clip-mini index --faiss auto`` would pick (``faiss_auto.tune`` on its proxy queries) is checked
   on the text-like queries.

Writes ``benchmarks/results/speed/ann_real.json``. Runs under nice on a shared machine; the load average is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info  # noqa: E402

from benchmarks.lib.repo_paths import scrub_paths  # noqa: E402

D = 256


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


SPLIT = "val"   # the split whose embeddings calibrate the generator (never test: see the module docstring)


def real_embeddings(model: str, cache: Path) -> dict:
    if cache.is_file():
        z = np.load(cache)
        if "split" in z.files and str(z["split"]) == SPLIT:
            return {k: z[k] for k in z.files if k != "split"}
        print(f"{cache} holds another split's embeddings (an older run's test split): embedding {SPLIT} again",
              flush=True)
    import clip_mini
    from clip_mini.config import load_config
    from clip_mini.data.dataset import load_splits

    split = load_splits(load_config(ROOT / "configs/flickr8k.yaml"), progress=False)[SPLIT]
    images = sorted(split["path"].unique())
    where = {p: i for i, p in enumerate(images)}
    emb = clip_mini.load(model, batch_size=32)
    out = {"image": emb.encode_image(images), "text": emb.encode_text(split["caption"].tolist()),
           "text_image": np.array([where[p] for p in split["path"]])}
    from clip_mini.fileio.atomic import atomic_path

    with atomic_path(cache) as tmp, open(tmp, "wb") as f:   # a file object: savez adds no ".npz" to the name
        np.savez(f, split=np.array(SPLIT), **out)
    return out


def stats(images: np.ndarray, texts: np.ndarray, text_image: np.ndarray) -> dict:
    s = texts @ images.T
    top = -np.sort(-s, axis=1)
    true = s[np.arange(len(texts)), text_image]
    rank = (s > true[:, None]).sum(1)
    mi, mt = images.mean(0), texts.mean(0)
    r = lambda x: round(float(x), 4)  # noqa: E731
    return {"best_cos_p5_p50_p95": [r(v) for v in np.percentile(top[:, 0], [5, 50, 95])],
            "tenth_cos_p5_p50_p95": [r(v) for v in np.percentile(top[:, 9], [5, 50, 95])],
            "true_image_cos_p50": r(np.median(true)), "t2i_r1": r((rank == 0).mean()), "t2i_r10": r((rank < 10).mean()),
            "mean_text_image_cos": r(s.mean()),
            "mean_image_image_cos": r((images @ images.T)[np.triu_indices(len(images), 1)].mean()),
            "modality_gap_norm": r(np.linalg.norm(mi - mt)), "mean_image_norm": r(np.linalg.norm(mi)),
            "mean_text_norm": r(np.linalg.norm(mt))}


class Generator:
    """Image rows and captions with the real embeddings' statistics (see the module docstring)."""

    def __init__(self, images: np.ndarray, texts: np.ndarray, text_image: np.ndarray, clusters: int = 20,
                 ridge: float = 30.0, noise: float = 0.5, seed: int = 0):
        import faiss

        km = faiss.Kmeans(D, clusters, niter=25, seed=seed)
        km.train(images)
        lab = km.index.search(images, 1)[1][:, 0]
        self.centres, self.weights = km.centroids.copy(), np.bincount(lab, minlength=clusters) / len(images)
        self.l_within = np.linalg.cholesky(np.cov((images - self.centres[lab]).T) + 1e-6 * np.eye(D))
        self.mi, self.mt = images.mean(0), texts.mean(0)
        x, y = images[text_image] - self.mi, texts - self.mt
        self.a = np.linalg.solve(x.T @ x + ridge * np.eye(D), x.T @ y)
        self.l_resid = np.linalg.cholesky(np.cov((y - x @ self.a).T) + 1e-6 * np.eye(D))
        self.noise = noise

    def images(self, n: int, rng) -> np.ndarray:
        out = np.empty((n, D), np.float32)
        for s in range(0, n, 100_000):
            m = min(100_000, n - s)
            c = rng.choice(len(self.centres), m, p=self.weights)
            out[s:s + m] = unit(self.centres[c] + rng.standard_normal((m, D)).astype(np.float32) @ self.l_within.T)
        return out

    def captions(self, images: np.ndarray, rng) -> np.ndarray:
        e = rng.standard_normal(images.shape).astype(np.float32) @ self.l_resid.T
        return unit(self.mt + (images - self.mi) @ self.a + self.noise * e)


def calibrate(real: dict) -> tuple[Generator, dict, dict]:
    want = stats(real["image"], real["text"], real["text_image"])
    ti = np.repeat(np.arange(len(real["image"])), 5)
    best = None
    for ridge in (3.0, 10.0, 30.0, 100.0):
        for noise in (0.5, 0.6, 0.7, 0.85, 1.0):
            gen = Generator(real["image"], real["text"], real["text_image"], ridge=ridge, noise=noise)
            rng = np.random.default_rng(0)
            imgs = gen.images(len(real["image"]), rng)
            got = stats(imgs, gen.captions(imgs[ti], rng), ti)
            err = abs(got["best_cos_p5_p50_p95"][1] - want["best_cos_p5_p50_p95"][1]) + \
                abs(got["tenth_cos_p5_p50_p95"][1] - want["tenth_cos_p5_p50_p95"][1])
            if best is None or err < best[0]:
                best = (err, gen, got, {"ridge": ridge, "noise": noise})
    return best[1], best[2], best[3]


def timed_search(fn, queries: np.ndarray) -> tuple[np.ndarray, float]:
    fn(queries[:10])   # warm-up
    t = time.perf_counter()
    ids = fn(queries)
    return ids, 1000 * (time.perf_counter() - t) / len(queries)


def index_bytes(index) -> int:
    import faiss

    return int(faiss.serialize_index(index).size)


def sweep(name: str, index, kind: str, values: list[int], queries, truth, rerank=None) -> dict:
    from clip_mini.retrieval import faiss_auto as FA
    from clip_mini.retrieval.search import faiss_search

    points = []
    for v in values:
        FA.set_param(index, kind, v)
        ids, ms = timed_search(lambda q: faiss_search(index, q, 10, rerank=rerank)[1], queries)
        points.append({"param": v, "recall_at_10": round(FA.recall_at(ids, truth), 4), "ms_per_query": round(ms, 4)})
        print(name, points[-1], flush=True)
        if points[-1]["recall_at_10"] >= 0.999:
            break
    return {"param": "efSearch" if kind == "hnsw" else "nprobe", "points": points}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/quality/d/best")
    p.add_argument("--cache", default=f"/tmp/clip_mini_ann_real_flickr8k_{SPLIT}.npz")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--hnsw-rows", type=int, default=None, help="rows for HNSW (default: --rows)")
    p.add_argument("--ivf-nlist", type=int, default=1024, help="IVF-Flat lists (index's default 4*sqrt(N) trains "
                   "k-means on 64 rows a list: minutes at 1M rows on 2 cores)")
    p.add_argument("--kinds", nargs="+", default=["ivfpq", "ivf", "hnsw"], choices=["ivfpq", "ivf", "hnsw"])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speed/ann_real.json"))
    args = p.parse_args(argv)
    import faiss

    from clip_mini.retrieval import faiss_auto as FA
    from clip_mini.retrieval.search import build_faiss, faiss_search

    faiss.omp_set_num_threads(1)   # per-query latency on one core; the build below uses both
    t0 = time.perf_counter()
    real = real_embeddings(args.model, Path(args.cache))
    gen, synth_stats, fitted = calibrate(real)
    out: dict = {"machine": machine_info(), "model": args.model, "calibration_split": SPLIT, "rows": args.rows,
                 "queries": args.queries,
                 "loadavg_start": os.getloadavg()[0],
                 "real_stats": stats(real["image"], real["text"], real["text_image"]),
                 "generated_stats_at_real_size": synth_stats, "generator": {"clusters": 20, **fitted}}
    print(json.dumps(out), flush=True)
    rng = np.random.default_rng(1)
    rows = gen.images(args.rows, rng).astype(np.float16)
    queries = gen.captions(np.asarray(rows[rng.choice(args.rows, args.queries, replace=False)], np.float32), rng)
    flat = faiss.IndexFlatIP(D)
    flat.add(rows.astype(np.float32))
    faiss.omp_set_num_threads(2)
    truth = flat.search(queries, 10)[1]
    del flat
    out["raw_rows_bytes"] = int(rows.nbytes)
    top = queries @ rows[truth[:, 0]].astype(np.float32).T
    out["generated_query_best_cos_p50_at_rows"] = round(float(np.median(np.diag(top))), 4)
    results = {}
    hnsw_rows = args.hnsw_rows or args.rows
    from clip_mini.fileio.atomic import atomic_write_json

    sweeps = {"ivfpq": [4, 8, 16, 32, 64, 128], "ivf": [4, 8, 16, 32, 64, 128], "hnsw": [16, 32, 64, 128, 256, 512]}
    for kind in args.kinds:
        values = sweeps[kind]
        sub = rows if kind != "hnsw" else rows[:hnsw_rows]
        truth_k = truth if kind != "hnsw" or hnsw_rows == args.rows else _truth(sub, queries)
        faiss.omp_set_num_threads(2)
        t = time.perf_counter()
        index = build_faiss(sub, kind, nlist=args.ivf_nlist if kind == "ivf" else None)
        build_s = time.perf_counter() - t
        faiss.omp_set_num_threads(1)
        res = sweep(kind, index, kind, values, queries, truth_k, rerank=sub if kind == "ivfpq" else None)
        res.update(build_s=round(build_s, 1), rows=len(sub), index_bytes=index_bytes(index))
        if kind != "hnsw":
            res["nlist"] = int(index.nlist)
        tuned = FA.tune(index, kind, sub)   # what `index --faiss auto` stores: proxy queries, target 0.95
        ids, ms = timed_search(lambda q: faiss_search(index, q, 10, rerank=sub if kind == "ivfpq" else None)[1],
                               queries)
        res["auto"] = {**tuned, "recall_at_10_on_text_like": round(FA.recall_at(ids, truth_k), 4),
                       "ms_per_query_on_text_like": round(ms, 4)}
        print(kind, res["auto"], flush=True)
        results[kind] = res
        del index
        out["indexes"] = results   # written after each index: a long run stopped later keeps what it measured
        atomic_write_json(args.out, scrub_paths({**out, "partial": True}))
    out["indexes"] = results
    out["loadavg_end"] = os.getloadavg()[0]
    out["bench_s"] = round(time.perf_counter() - t0, 1)
    atomic_write_json(args.out, scrub_paths(out))
    return out


def _truth(rows: np.ndarray, queries: np.ndarray) -> np.ndarray:
    import faiss

    flat = faiss.IndexFlatIP(D)
    flat.add(rows.astype(np.float32))
    return flat.search(queries, 10)[1]


if __name__ == "__main__":
    main()
