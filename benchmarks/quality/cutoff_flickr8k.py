"""How well a cut-off tells "the photo is here" from "nothing here matches", on Flickr8k val.

    python benchmarks/quality/cutoff_flickr8k.py --model photos
    python benchmarks/quality/cutoff_flickr8k.py --model photos --ship       # + write the package's cutoff.json
    python benchmarks/quality/cutoff_flickr8k.py --model runs/photos/best --result /tmp/cutoff.json

Every val caption is searched twice over the val photos: with its own photo (a case to keep when the photo ranks in
the top ``--k``) and without it (a case to answer with nothing). A rule keeps a case when the search still lists
the photo, and answers a removed case with nothing when it lists no photo at all. Two rules
(``clip_mini.eval.cutoff``):

* ``old``: one cosine every hit must reach, the one that keeps 90 % of the top-k photos;
* ``new`` (search's default): nothing is listed unless the best hit reaches ``best``; then the hits that reach
  ``hit`` (the cosine that keeps 98 % of the top-k photos), ``best`` the highest that keeps 90 % of the cases.

Honest by construction: the val photos are split in two halves (``SPLIT_SEED``, fixed here), each caption goes with
its photo, every rule and candidate is fitted on the captions of half A and scored on those of half B (all searches
run over all 500 val photos), and the reverse fit (B -> A) is shown beside it. ``candidates`` scores other
query-specific signals, all cheap at search time, the same way at kept 0.90 as gates (the best hit's signal
decides whether anything is listed): a z-score against the index's score distribution (a mean vector and covariance
stored at index time), the gap from the best hit to the m-th, logistic mixes, the best photo's score against a bank
of ``--bank`` train captions, and the query against its nearest bank captions on the best photo. Val and train
captions only: no test label is read. ``--ship`` writes the rule calibrated on all val captions into a built-in
model's ``cutoff.json`` (read by search for that package only). Writes
benchmarks/results/quality/cutoff_flickr8k.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402

SPLIT_SEED = 0                   # which val photos are half A (fit) and half B (scored)
HIT_KEEPS = (0.90, 0.93, 0.95, 0.98, 0.99, 1.0)   # the per-hit floor's share, swept to show what it costs
CURVE_POINTS = 120


def subset(cases, mask):
    return type(cases)(*(x[mask] for x in cases))


def false_hits(removed_top: np.ndarray, hit: float, best: float) -> float:
    """Mean number of hits a photo-removed search lists within its top k."""
    listed = (removed_top[:, 0] >= best)[:, None] & (removed_top >= hit)
    return float(listed.sum(1).mean())


def rounded(d: dict, n: int = 4) -> dict:
    return {k: (round(float(v), n) if isinstance(v, (float, np.floating)) else v) for k, v in d.items()}


def rule_row(name, cases, removed_top, fit_mask, score_mask, k, hit_keep, score_rule, fit_rule) -> dict:
    rule = fit_rule(subset(cases, fit_mask), k, hit_keep=hit_keep)
    held = score_rule(subset(cases, score_mask), rule["cutoff_cosine"], rule["cutoff_best_cosine"], k)
    return {"rule": name, "hit_keep": hit_keep, "hit": rule["cutoff_cosine"], "best": rule["cutoff_best_cosine"],
            "fit": rounded({"kept": rule["cutoff_kept"], "empty_when_removed": rule["cutoff_empty"]}),
            "held_out": rounded({**held, "false_hits_when_removed": false_hits(
                removed_top[score_mask], rule["cutoff_cosine"], rule["cutoff_best_cosine"])}, 4)}


def gate_at(present: np.ndarray, removed: np.ndarray, top: np.ndarray, fit: np.ndarray, score: np.ndarray,
            keep: float = 0.90) -> dict:
    """A gate on one signal (anything listed iff the signal of the best hit reaches t): t keeps ``keep`` of half A's
    top-k cases; kept / empty on half B."""
    vals = np.sort(present[fit & top])
    t = vals[int(math.floor((1 - keep) * len(vals)))]
    return rounded({"fit_kept": (present[fit & top] >= t).mean(), "fit_empty": (removed[fit] < t).mean(),
                    "kept": (present[score & top] >= t).mean(), "empty_when_removed": (removed[score] < t).mean()})


def logistic_gate(fp: np.ndarray, fr: np.ndarray, top, fit, score, keep: float = 0.90) -> dict:
    """A logistic mix of signals, fitted on half A (present top-k cases against removed cases), used as a gate."""
    from sklearn.linear_model import LogisticRegression

    x = np.concatenate([fp[fit & top], fr[fit]])
    y = np.r_[np.ones((fit & top).sum()), np.zeros(fit.sum())]
    mu, sd = x.mean(0), x.std(0) + 1e-12
    clf = LogisticRegression(C=1.0, max_iter=2000).fit((x - mu) / sd, y)
    return gate_at(clf.decision_function((fp - mu) / sd), clf.decision_function((fr - mu) / sd), top, fit, score,
                   keep)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="photos", help="model directory or built-in name")
    p.add_argument("--config", default=str(ROOT / "configs/flickr8k-vit.yaml"), help="the split comes from here")
    p.add_argument("--captions", default=str(ROOT.parent / "shared/data/flickr8k/captions.csv"))
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--bank", type=int, default=2000, help="train captions in the bank candidates (0: skip them)")
    p.add_argument("--ship", action="store_true",
                   help="write the rule calibrated on all val captions into the built-in model's cutoff.json")
    p.add_argument("--result", default=str(ROOT / "benchmarks/results/quality/cutoff_flickr8k.json"))
    args = p.parse_args(argv)
    machine = machine_info()

    from clip_mini.builtin.registry import BUILTIN_ROOT, is_builtin_name, resolve_model
    from clip_mini.config import load_config
    from clip_mini.data import load_splits
    from clip_mini.embed import load
    from clip_mini.eval.cutoff import HIT_KEEP, KEEP, fit_rule, score_rule, search_cases
    from clip_mini.fileio.atomic import atomic_write_json
    from clip_mini.retrieval.cutoff import SIDECAR, model_cutoff

    t0 = time.time()
    cfg = load_config(args.config, [f"data.captions={args.captions}"])
    splits = load_splits(cfg, progress=False)
    val = splits["val"]
    embedder = load(args.model)
    paths = sorted(val["path"].unique())
    col = {p_: i for i, p_ in enumerate(paths)}
    img = embedder.encode_image(paths, show_progress=True).astype(np.float64)
    txt = embedder.encode_text(val["caption"].tolist(), show_progress=True).astype(np.float64)
    truth = val["path"].map(col).to_numpy()
    n_cap, n_img = len(txt), len(img)
    rows = np.arange(n_cap)
    sim = txt @ img.T                                          # (captions, images)
    removed = sim.copy()
    removed[rows, truth] = -np.inf
    k_list = 50
    present_top = -np.sort(-sim, 1)[:, :k_list]
    removed_top = -np.sort(-removed, 1)[:, :k_list]
    cases = search_cases(img, txt, truth)
    top = cases.rank < args.k

    half = np.zeros(n_img, dtype=int)
    half[np.random.default_rng(SPLIT_SEED).permutation(n_img)[n_img // 2:]] = 1
    a, b = half[truth] == 0, half[truth] == 1

    # the two rules, fitted on one half, scored on the other
    rules = {}
    for direction, fit, score in (("A->B", a, b), ("B->A", b, a)):
        rules[direction] = {
            "old": rule_row("old", cases, removed_top[:, :10], fit, score, args.k, None, score_rule, fit_rule),
            "new": rule_row("new", cases, removed_top[:, :10], fit, score, args.k, HIT_KEEP, score_rule, fit_rule)}
    sweep = [rule_row(f"hit_keep {hk}", cases, removed_top[:, :10], a, b, args.k, hk, score_rule, fit_rule)
             for hk in HIT_KEEPS]

    # curves on half B: the old rule's one cosine, the new rule's best-hit cosine (its hit floor as fitted on A)
    hit_new = rules["A->B"]["new"]["hit"]
    cb = subset(cases, b)
    lo, hi = np.quantile(np.concatenate([cb.true, cb.removed]), [0.001, 0.999])
    curves = {"old": [], "new": []}
    for t in np.linspace(lo, hi, CURVE_POINTS):
        for name, hit, best in (("old", t, t), ("new", min(hit_new, t), t)):
            curves[name].append(rounded({"threshold": t, **score_rule(cb, hit, best, args.k),
                                         "false_hits_when_removed": false_hits(removed_top[b, :10], hit, best)}))

    model_dir = resolve_model(args.model)
    shipped = fit_rule(cases, args.k)   # what the trainer stores, on this model's own weights
    ship = None
    if args.ship:
        if not is_builtin_name(args.model):
            raise SystemExit(f"--ship writes a built-in model's {SIDECAR}; {args.model} is not a built-in name")
        fingerprint = json.loads((Path(model_dir) / "config.json").read_text())["builtin_fingerprint"]
        ship = {"calibrated_for": fingerprint, "model": args.model, "split": "val", "captions": n_cap,
                "images": n_img, "k": args.k, "keep": KEEP, "hit_keep": HIT_KEEP, **shipped,
                "command": f"python benchmarks/quality/cutoff_flickr8k.py --model {args.model} --ship"}
        atomic_write_json(Path(BUILTIN_ROOT) / args.model / SIDECAR, ship)

    # the rule search uses for this model, as stored (cutoff.json of a built-in, else config.json), and the old
    # one-cosine rule the trainer stored in config.json, scored on all val captions (they were fitted on all of them,
    # so in-sample) and on half B
    def scored(hit, best):
        return rounded({"hit": hit, "best": best, **score_rule(cases, hit, best, args.k),
                        "false_hits_when_removed": false_hits(removed_top[:, :10], hit, best),
                        "held_out_half": rounded(score_rule(cb, hit, best, args.k))})

    stored = model_cutoff(model_dir)
    default = None if stored is None else scored(stored.hit, stored.best)
    trained = json.loads((Path(model_dir) / "config.json").read_text()).get("trained", {}).get("val", {})
    old_default = scored(trained["cutoff_cosine"], trained["cutoff_cosine"]) if "cutoff_cosine" in trained else None

    # other query-specific signals, each as a gate fitted on A and scored on B at kept 0.90
    mu, cov = img.mean(0), np.cov(img, rowvar=False, bias=True)   # index statistics, stored at index time
    centre, spread = txt @ mu, np.sqrt(np.einsum("qd,de,qe->q", txt, cov, txt))
    order_p, order_r = sim.argmax(1), removed.argmax(1)           # the best photo of each search
    signals = {
        "best cosine (the new rule without its hit floor)": (present_top[:, 0], removed_top[:, 0]),
        "best hit's z-score against the index": ((present_top[:, 0] - centre) / spread,
                                                 (removed_top[:, 0] - centre) / spread),
        "mean of the best 3": (present_top[:, :3].mean(1), removed_top[:, :3].mean(1)),
    }
    for m, nth in ((2, "2nd"), (10, "10th"), (50, "50th")):
        signals[f"gap best - {nth}"] = (present_top[:, 0] - present_top[:, m - 1],
                                        removed_top[:, 0] - removed_top[:, m - 1])
    gaps = [np.stack([t[:, 0], t[:, 0] - t[:, 1], t[:, 0] - t[:, 9]], 1) for t in (present_top, removed_top)]
    candidates = {name: gate_at(sp, sr, top, a, b) for name, (sp, sr) in signals.items()}
    candidates["logistic: best, best - 2nd, best - 10th"] = logistic_gate(*gaps, top, a, b)
    bank_info = None
    if args.bank:
        train = splits["train"]
        pick = train.iloc[np.random.default_rng(SPLIT_SEED).choice(len(train), min(args.bank, len(train)),
                                                                   replace=False)]
        bank = embedder.encode_text(pick["caption"].tolist(), show_progress=True).astype(np.float64)
        bank_scores = np.sort(bank @ img.T, 0)[::-1]               # per photo, the bank's cosines, best first
        q10 = bank_scores[min(9, len(bank) - 1)]
        candidates["best hit minus its photo's 10th best bank caption"] = gate_at(
            present_top[:, 0] - q10[order_p], removed_top[:, 0] - q10[order_r], top, a, b)
        nearest = np.argsort(-(txt @ bank.T), 1)[:, :5]           # the query's 5 nearest bank captions
        contrast = [top_s[:, 0] - np.einsum("qnd,qd->q", bank[nearest], img[o]) / 5
                    for top_s, o in ((present_top, order_p), (removed_top, order_r))]
        candidates["best hit minus its photo's score for the query's 5 nearest bank captions"] = gate_at(
            *contrast, top, a, b)
        feats = [np.stack([t[:, 0], t[:, 0] - t[:, 1], t[:, 0] - t[:, 9], t[:, 0] - q10[o], c,
                           (t[:, 0] - centre) / spread], 1)
                 for t, o, c in ((present_top, order_p, contrast[0]), (removed_top, order_r, contrast[1]))]
        candidates["logistic: all of the above"] = logistic_gate(*feats, top, a, b)
        bank_info = {"captions": len(bank), "from": "train split", "seed": SPLIT_SEED}

    result = {"benchmark": "cutoff_flickr8k", "machine": machine, "model": str(args.model),
              "split": "val", "captions": n_cap, "images": n_img, "k": args.k, "false_hits_within": 10,
              "recall_at_k": round(float(top.mean()), 4),
              "targets": {"kept": KEEP, "empty_when_removed": 0.50},
              "halves": {"seed": SPLIT_SEED, "captions_a": int(a.sum()), "captions_b": int(b.sum()),
                         "fit": "A", "scored": "B"},
              "rules": rules, "hit_keep_sweep": sweep, "curves_half_b": curves,
              "default": default, "old_default": old_default, "calibration_on_all_val": rounded(shipped, 6), "shipped": ship,
              "candidates_half_b": candidates, "bank": bank_info,
              "wall_s": round(time.time() - t0, 1)}
    machine.update({k: v for k, v in machine_info().items() if k in ("torch", "threads")})   # torch loaded since
    write_result(args.result, result)


if __name__ == "__main__":
    main()
