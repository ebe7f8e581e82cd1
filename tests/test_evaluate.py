"""Retrieval and zero-shot metrics: ties count against the query, median rank of an even count, bad input."""
import numpy as np
import pytest
import torch

from clip_mini.eval.metrics import median_rank, retrieval_metrics, zero_shot_accuracy


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def _brute_ranks(sim: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Reference: for each query, count the non-positive items scoring at least its best positive."""
    out = []
    for s, p in zip(sim, pos):
        best = s[p].max()
        out.append(sum(1 for j in range(len(s)) if not p[j] and s[j] >= best))
    return np.array(out)


def test_collapsed_image_tower_scores_zero_not_one():
    rng = np.random.default_rng(0)
    n = 6
    image_features = np.tile(_unit(rng.normal(size=(1, 8))), (n, 1))   # every image embeds identically
    ids = np.repeat(np.arange(n), 2)
    text_features = _unit(rng.normal(size=(len(ids), 8)))
    m = retrieval_metrics(image_features, text_features, ids)
    assert m["t2i_r1"] == 0.0   # strictly-higher counting gave 1.0 here
    assert m["t2i_r5"] == 0.0   # the own image ties with the 5 others, all of which rank ahead
    assert m["t2i_medr"] == n


def test_collapsed_text_tower_scores_zero():
    rng = np.random.default_rng(1)
    n = 5
    ids = np.repeat(np.arange(n), 3)
    image_features = _unit(rng.normal(size=(n, 8)))
    text_features = np.tile(_unit(rng.normal(size=(1, 8))), (len(ids), 1))
    m = retrieval_metrics(image_features, text_features, ids)
    assert m["i2t_r1"] == 0.0 and m["i2t_r10"] == 0.0
    assert m["i2t_medr"] == len(ids) - 3 + 1   # behind every other caption, its own 3 tie among themselves


def test_zero_image_row_does_not_hit_its_captions():
    rng = np.random.default_rng(2)
    n = 4
    ids = np.repeat(np.arange(n), 5)
    image_features = _unit(rng.normal(size=(n, 8)))
    image_features[0] = 0.0                          # an unreadable image embedded as a zero vector
    text_features = _unit(rng.normal(size=(len(ids), 8)))
    text_features[ids == 0] = 0.0                   # ...and captions that also score 0 everywhere
    sim = image_features @ text_features.T
    pos = ids[None, :] == np.arange(n)[:, None]
    m = retrieval_metrics(image_features, text_features, ids, ks=(1,), chunk=3)
    ranks = _brute_ranks(sim, pos)
    assert ranks[0] >= (sim[0][~pos[0]] >= 0).sum() > 0   # all its non-captions tie at 0: they rank ahead
    assert m["i2t_r1"] == pytest.approx(np.mean(ranks < 1))
    t_sim = text_features @ image_features.T
    t_ranks = _brute_ranks(t_sim, ids[:, None] == np.arange(n)[None, :])
    assert t_ranks[ids == 0].min() == n - 1         # a zero caption ties every image: its own ranks last
    assert m["t2i_r1"] == pytest.approx(np.mean(t_ranks < 1))


def test_matches_brute_force_with_many_ties():
    rng = np.random.default_rng(3)
    n_img, per = 9, 3
    ids = np.repeat(np.arange(n_img), per)
    # small-integer features make exact ties common
    image_features = rng.integers(-1, 2, size=(n_img, 4)).astype(np.float32)
    text_features = rng.integers(-1, 2, size=(len(ids), 4)).astype(np.float32)
    m = retrieval_metrics(image_features, text_features, ids, ks=(1, 2, 5), chunk=4)
    sim = text_features @ image_features.T
    t2i = _brute_ranks(sim, ids[:, None] == np.arange(n_img)[None, :])
    i2t = _brute_ranks(sim.T, ids[None, :] == np.arange(n_img)[:, None])
    for name, ranks in (("t2i", t2i), ("i2t", i2t)):
        for k in (1, 2, 5):
            assert m[f"{name}_r{k}"] == pytest.approx(np.mean(ranks < k))
        assert m[f"{name}_medr"] == pytest.approx(np.median(ranks + 1))


def test_median_rank_of_even_count_is_mean_of_middle_two():
    assert median_rank(torch.tensor([1, 2, 3, 10])) == 2.5   # torch.median says 2
    assert median_rank(torch.tensor([4, 1, 7])) == 4.0
    # through the metric: 2 captions ranked 1st and 2nd -> median 1.5
    image_features = np.eye(2, dtype=np.float32)
    text_features = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)   # caption 1 (image 1) ranks 2nd
    m = retrieval_metrics(image_features, text_features, [0, 1])
    assert m["t2i_medr"] == 1.5


def test_non_finite_features_are_refused_with_the_row():
    image_features = np.eye(3, dtype=np.float32)
    text_features = np.eye(3, dtype=np.float32)
    text_features[2, 1] = np.nan
    with pytest.raises(ValueError, match="text_features.*first row 2"):
        retrieval_metrics(image_features, text_features, [0, 1, 2])


def test_zero_shot_ties_count_against_the_true_class():
    rng = np.random.default_rng(4)
    classes = _unit(rng.normal(size=(4, 8)))
    collapsed = np.tile(_unit(rng.normal(size=(1, 8))), (8, 1))
    # a collapsed tower scores every class by the same image vector; identical class rows tie exactly
    acc = zero_shot_accuracy(collapsed, np.tile(classes[:1], (4, 1)), np.arange(8) % 4, ks=(1, 4))
    assert acc == {"top1": 0.0, "top4": 1.0}
    perfect = zero_shot_accuracy(classes, classes, np.arange(4))
    assert perfect["top1"] == 1.0
    with pytest.raises(ValueError, match="labels must lie in"):
        zero_shot_accuracy(classes, classes, [0, 1, 2, 4])


# -- unreadable images in an evaluation split ---------------------------------------------------------------
def _scores(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("n_")}


@pytest.fixture(scope="module")
def split_with_bad_image(tmp_path_factory):
    """A tiny untrained model, a 6-image split (2 captions each) and the same split's image 2 made unreadable."""
    import pandas as pd

    from clip_mini.model.clip import CLIPModel

    from conftest import tiny_model_config, write_images

    folder = tmp_path_factory.mktemp("evalsplit")
    paths = [str(p) for p in write_images(folder / "good", 6, seed=5, size=32)]
    words = ["red", "blue", "green", "yellow", "pink", "grey"]
    rows = [(p, f"a {w} {shape}", i) for i, (p, w) in enumerate(zip(paths, words)) for shape in ("circle", "star")]
    df = pd.DataFrame(rows, columns=["path", "caption", "image_id"])
    bad = df.copy()
    bad_path = folder / "broken.png"
    bad_path.write_bytes(b"not a png")
    bad.loc[bad["image_id"] == 2, "path"] = str(bad_path)
    torch.manual_seed(0)
    model = CLIPModel.build(tiny_model_config(), captions=df["caption"].tolist()).eval()
    return model, df, bad


@pytest.mark.filterwarnings("ignore:skipping unreadable image")
def test_unreadable_image_is_dropped_with_its_captions(split_with_bad_image, capsys):
    from clip_mini.data import build_eval_transform
    from clip_mini.eval.validation import drop_unreadable, evaluate_model

    model, df, bad = split_with_bad_image
    transform = build_eval_transform(model.preprocess)
    got = evaluate_model(model, bad, transform, batch_size=4)
    assert "left out 1 unreadable image(s) and their 2 caption(s)" in capsys.readouterr().out
    expected, dropped = drop_unreadable(df, np.arange(6) != 2)
    assert dropped == [df.loc[4, "path"]] and expected["image_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    ref = evaluate_model(model, expected, transform, batch_size=4)
    # the split without that image: its row no longer takes part (float noise only: image batches differ)
    assert _scores(got) == pytest.approx(_scores(ref), abs=1e-6)
    assert (got["n_images"], got["n_captions"], got["n_dropped_images"], got["n_dropped_captions"]) == (5, 10, 1, 2)
    assert ref["n_dropped_images"] == 0


def test_precomputed_tower_features_drop_unreadable_images_too(split_with_bad_image):
    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.eval.validation import evaluate_model

    model, df, _ = split_with_bad_image
    transform = build_eval_transform(model.preprocess)
    paths = df.drop_duplicates("image_id")["path"].tolist()
    with torch.no_grad():
        tower = model.visual(torch.stack([transform(load_image(p)) for p in paths]))
    ok = torch.tensor([True, True, False, True, True, True])
    got = evaluate_model(model, df, transform, batch_size=4, tower_features=(tower, ok))
    keep = df["image_id"] != 2
    ref = evaluate_model(model, df[keep].assign(image_id=df["image_id"][keep].map({0: 0, 1: 1, 3: 2, 4: 3, 5: 4})),
                         transform, batch_size=4, tower_features=(tower[ok], ok[ok]))
    # ranks exactly; the loss to float32 rounding (the two runs batch the rows differently, and a CPU's matmul
    # blocking may then sum in another order: 1e-8 apart on an AMD EPYC)
    assert got.pop("loss") == pytest.approx(ref.pop("loss"), rel=1e-6)
    assert _scores(got) == _scores(ref) and got["n_dropped_images"] == 1 and got["n_images"] == 5
    with pytest.raises(Exception, match="none of the 6 evaluation images could be read"):
        evaluate_model(model, df, transform, batch_size=4, tower_features=(tower, torch.zeros(6, dtype=torch.bool)))


def test_flip_average_scores_each_image_with_its_mirror(split_with_bad_image):
    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.eval.validation import _text_features, _val_loss, evaluate_model

    model, df, _ = split_with_bad_image
    transform = build_eval_transform(model.preprocess)
    got = evaluate_model(model, df, transform, batch_size=4, flip_average=True)
    pixels = torch.stack([transform(load_image(p)) for p in df.drop_duplicates("image_id")["path"]])
    with torch.no_grad():   # the reference: the plain model pass on the pixels and on their mirror
        image = torch.nn.functional.normalize(model.encode_image(pixels) + model.encode_image(pixels.flip(-1)), dim=-1)
        text = _text_features(model, df["caption"].tolist(), 4, torch.device("cpu"), "fp32")
    ids = df["image_id"].to_numpy()
    assert got["loss"] == pytest.approx(_val_loss(image, text, ids, model.scale().float(), 4), rel=1e-5)
    want = retrieval_metrics(image, text, torch.from_numpy(ids.copy()))
    assert {k: got[k] for k in want} == pytest.approx(want, abs=1e-6)
    assert got["loss"] != pytest.approx(evaluate_model(model, df, transform, batch_size=4)["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="needs the pixels"):
        evaluate_model(model, df, transform, tower_features=(torch.zeros(6, model.visual.width), torch.ones(6)),
                       flip_average=True)


# -- clip-mini eval reproduces the trainer's numbers --------------------------------------------------------
@pytest.fixture(scope="module")
def eval_shapes(tmp_path_factory):
    from clip_mini.data import generate

    return generate(tmp_path_factory.mktemp("data") / "shapes", n=160, seed=1, size=32)


@pytest.mark.slow
@pytest.mark.parametrize("locked", [False, True], ids=["pixels", "frozen-features"])
def test_eval_of_best_reproduces_the_trainers_row(eval_shapes, tmp_path, locked, capsys):
    """bf16 run; eval of ``best/`` on val from the run's config equals the metrics.jsonl row it was selected by.

    With a locked tower the trainer scores precomputed bf16 tower outputs, eval runs the tower on pixels: the
    same numbers either way.
    """
    import json

    from clip_mini.cli.main import main
    from clip_mini.config import load_config
    from clip_mini.train import train

    from test_train_loop import TINY

    run = tmp_path / "run"
    locked_opts = ["model.vision.trainable=false", "train.frozen_features=1"] if locked else []
    cfg = load_config(None, TINY + locked_opts + [
        f"data.captions={eval_shapes / 'captions.csv'}", f"data.cache_dir={eval_shapes.parent / 'cache'}",
        f"train.out_dir={run}", "train.precision=bf16", "train.epochs=3", "train.eval_batch_size=24"])
    train(cfg)
    trained = json.loads((run / "best" / "config.json").read_text())["trained"]
    assert (trained["precision"], trained["eval_batch_size"]) == ("bf16", 24)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["kind"] == "epoch" and r["epoch"] == trained["epoch"])
    capsys.readouterr()
    assert main(["eval", "--model", str(run / "best"), "--data", str(run / "config.yaml"), "--split", "val",
                 "--precision", "bf16", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    keys = [f"{d}_{m}" for d in ("t2i", "i2t") for m in ("r1", "r5", "r10", "medr")] + ["rsum", "loss"]
    assert got["precision"] == "bf16" and got["n_images"] == row["val_n_images"] == 40
    for k in keys:
        assert got[k] == pytest.approx(row[f"val_{k}"], abs=1e-6), k
    # no --precision: the hardware rule, not the precision the model was trained at
    assert main(["eval", "--model", str(run / "best"), "--data", str(run / "config.yaml"), "--split", "val",
                 "--json"]) == 0
    from clip_mini.runtime.devices import resolve_precision

    assert json.loads(capsys.readouterr().out)["precision"] == resolve_precision("auto", torch.device("cpu"))
    # fp32 is another model's numbers: the flag is honoured (and the loss moves)
    assert main(["eval", "--model", str(run / "best"), "--data", str(run / "config.yaml"), "--split", "val",
                 "--precision", "fp32", "--json"]) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert fp32["precision"] == "fp32" and fp32["loss"] != pytest.approx(row["val_loss"], abs=1e-6)


def _on_gpu(t: torch.Tensor):
    """A stand-in for ``t`` living on cuda:0 (a mock: no GPU here); only a copy to the CPU yields its values."""
    from unittest import mock

    remote = mock.MagicMock(spec=torch.Tensor)
    remote.device = torch.device("cuda", 0)
    remote.detach.return_value.to.side_effect = lambda device, dtype: (
        t.to(dtype) if torch.device(device).type == "cpu" else pytest.fail(f"moved to {device}"))
    remote.__array__ = mock.Mock(side_effect=TypeError("can't convert cuda:0 device type tensor to numpy"))
    return remote


def test_metrics_accept_tensors_on_another_device_by_moving_them():
    # The trainer's features come off the GPU; a CUDA tensor passed straight in failed in np.asarray (the ids) or
    # in indexing a CPU mask with CUDA rows. Now any tensor is copied to the CPU first.
    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(6, 4, generator=g), dim=1)
    txt = torch.nn.functional.normalize(img.repeat_interleave(2, 0) + 0.3 * torch.randn(12, 4, generator=g), dim=1)
    ids = torch.arange(6).repeat_interleave(2)
    want = retrieval_metrics(img, txt, ids)
    assert retrieval_metrics(_on_gpu(img), _on_gpu(txt), _on_gpu(ids)) == want
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    assert zero_shot_accuracy(_on_gpu(img), _on_gpu(img[:3]), _on_gpu(labels)) == \
        zero_shot_accuracy(img, img[:3], labels)
