"""Label-consistent mirroring (clip_mini.data.mirror): ``data.hflip: swap`` flips an image with "left" and "right"
swapped in its caption; ``data.mirror_pairs`` puts every training source beside its mirrored self in the batch,
with the image ids the contrastive loss needs (the same id when the caption has no left/right word, else a new one).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from clip_mini.config import ConfigError, DataConfig, PreprocessConfig, load_config
from clip_mini.data import CaptionCollate
from clip_mini.data.mirror import flips, mirror_id, swap_left_right
from clip_mini.model.text import train_tokenizer
from clip_mini.train.inputs import build_train_inputs, load_splits
from conftest import tiny_sets


# --- the caption rewrite ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("caption, want", [
    ("a large red circle on the left", "a large red circle on the right"),
    ("a red circle on the right", "a red circle on the left"),
    ("a red circle left of a blue square on the right", "a red circle right of a blue square on the left"),
    ("Left: a dog. RIGHT: a cat", "Right: a dog. LEFT: a cat"),
    ("the leftmost cup and the Rightmost one", "the rightmost cup and the Leftmost one"),
    ("a left-hand glove, to the right.", "a right-hand glove, to the left."),
    ("bright leftovers, copyright", "bright leftovers, copyright"),   # not whole words: unchanged
    ("a small blue star at the top", "a small blue star at the top"),
    ("", ""),
])
def test_swap_left_right_swaps_whole_words_keeping_their_case(caption, want):
    assert swap_left_right(caption) == want
    assert swap_left_right(want) == caption   # an involution: mirroring twice gives the caption back


def test_mirror_id_keeps_the_source_id_only_for_an_unchanged_caption():
    assert mirror_id(7, changed=False) == 7
    assert mirror_id(7, changed=True) == -8 and mirror_id(0, changed=True) == -1   # never a source id (>= 0)


# --- config ----------------------------------------------------------------------------------------------------

def test_hflip_takes_false_true_or_swap_and_names_the_key_otherwise():
    assert load_config(None, ["data.hflip=swap"]).data.hflip == "swap"
    assert load_config(None, ["data.hflip=true"]).data.hflip is True
    assert load_config(None, []).data.hflip is False and load_config(None, []).data.mirror_pairs is False
    for bad in ("maybe", "Swap", "1", "[swap]"):
        with pytest.raises(ConfigError, match=r"data\.hflip must be true or false, or one of \['swap'\]"):
            load_config(None, [f"data.hflip={bad}"])
    with pytest.raises(ConfigError, match=r"data\.mirror_pairs"):
        load_config(None, ["data.mirror_pairs=sometimes"])


@pytest.mark.parametrize("sets, key", [
    (["data.mirror_pairs=true", "data.hflip=true"], r"data\.hflip=swap"),
    (["data.mirror_pairs=true", "train.batch_size=7"], r"train\.batch_size must be even"),
    (["data.hflip=swap", "train.frozen_features=2", "model.vision.trainable=false"], r"train\.frozen_features"),
    (["data.mirror_pairs=true", "train.frozen_features=1", "model.vision.trainable=false"], r"train\.frozen_features"),
    (["data.mirror_pairs=true", "train.captions_per_image=2", "model.text.trainable=false"],
     r"train\.captions_per_image"),
])
def test_mirroring_refuses_what_it_cannot_keep_consistent(sets, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, sets)


def test_swap_builds_no_flip_into_the_image_transform():
    from clip_mini.data import build_train_transform

    def names(cfg):
        return [type(t).__name__ for t in build_train_transform(PreprocessConfig(image_size=32), cfg).compose]
    assert "HorizontalFlip" in names(DataConfig(hflip=True))
    assert "HorizontalFlip" not in names(DataConfig(hflip="swap"))   # the dataset flips, with the caption
    assert "HorizontalFlip" not in names(DataConfig(hflip=False))


# --- batches ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from clip_mini.data import generate

    root = tmp_path_factory.mktemp("mirror")
    return root, generate(root / "shapes", n=48, seed=1, size=32)


class CaptionsToo:
    """``CaptionCollate`` that keeps the batch's caption strings and pixels as they left the dataset (picklable:
    it runs in the loader worker)."""

    def __init__(self, tokenizer):
        self.collate = CaptionCollate(tokenizer, 16)

    def __call__(self, batch):
        return {**self.collate(batch), "captions": [b[1] for b in batch]}


def _inputs(shapes, *sets, workers=0, cache=False, seed=0):
    root, data = shapes
    cfg = load_config(None, [f"data.captions={data / 'captions.csv'}", "data.val=8", f"data.cache={cache}",
                             f"data.cache_dir={root / 'cache'}", "model.vision.image_size=32", "train.batch_size=8",
                             f"train.seed={seed}", f"data.workers={workers}", *sets])
    splits = load_splits(cfg, progress=False)
    pre = PreprocessConfig(image_size=32)
    cache_obj = None
    if cache:
        from clip_mini.train.inputs import make_image_cache

        cache_obj = make_image_cache(cfg, pre, splits)
        assert cache_obj is not None
    tok = train_tokenizer(splits["train"]["caption"], 200)
    inputs = build_train_inputs(cfg, splits["train"], pre, tok, 16, cache=cache_obj)
    inputs.collate = CaptionsToo(tok)
    return inputs, splits["train"]


def _batches(inputs, epoch):
    return [b for step in inputs.loader(epoch) for b in step]


def _same(a, b):
    return len(a) == len(b) and all(
        x["captions"] == y["captions"] and all(torch.equal(x[k], y[k]) for k in x if k != "captions")
        for x, y in zip(a, b))


def test_mirror_pairs_put_each_source_beside_its_flipped_self_with_the_swapped_caption(shapes):
    inputs, train = _inputs(shapes, "data.mirror_pairs=true", "data.hflip=swap")
    n_images = train["image_id"].nunique()
    assert inputs.steps_per_epoch == n_images // 4   # 4 sources (and their 4 mirrors) per batch of 8
    captions_of = train.groupby("image_id")["caption"].apply(set).to_dict()
    kinds, sources, flipped_sources = set(), [], 0
    for b in _batches(inputs, 0):
        assert b["pixels"].shape == (8, 3, 32, 32)
        ids, caps = b["image_ids"].tolist(), b["captions"]
        for k in range(0, 8, 2):
            (src_id, src_cap), (mir_id, mir_cap) = (ids[k], caps[k]), (ids[k + 1], caps[k + 1])
            assert torch.equal(b["pixels"][k + 1], torch.flip(b["pixels"][k], dims=(-1,)))
            assert mir_cap == swap_left_right(src_cap)
            # a source is one of its image's captions, or (hflip: swap flipped it) one of them mirrored
            assert src_cap in captions_of[src_id] or swap_left_right(src_cap) in captions_of[src_id]
            flipped_sources += src_cap not in captions_of[src_id]
            if mir_cap == src_cap:   # no left/right word: the identical text is a positive of both images
                assert mir_id == src_id
                kinds.add("same")
            else:                    # a hard negative of its source, and of nothing else's id
                assert mir_id == -1 - src_id and ids.count(mir_id) == 1 and ids.count(src_id) == 1
                kinds.add("new")
            sources.append(src_id)
    assert kinds == {"same", "new"}   # both rules met in the epoch
    assert len(sources) == len(set(sources)) == inputs.steps_per_epoch * 4   # every source once per epoch
    assert 0 < flipped_sources < len(sources)   # hflip: swap on the sources too, p = 0.5


def test_mirror_pairs_are_deterministic_per_seed_with_cache_and_workers(shapes):
    sets = ("data.mirror_pairs=true",)
    plain = _batches(_inputs(shapes, *sets)[0], 1)
    assert _same(_batches(_inputs(shapes, *sets, workers=1, cache=True)[0], 1), plain)   # same pixels, same pairs
    assert _same(_batches(_inputs(shapes, *sets)[0], 1), plain)
    assert not _same(_batches(_inputs(shapes, *sets, seed=1)[0], 1), plain)
    inputs = _inputs(shapes, *sets)[0]
    assert _same([b for step in inputs.loader(1, start_step=2) for b in step], plain[2:])   # a resumed epoch
    # without hflip: swap the sources are never flipped: every pair is (as sampled, mirrored)
    _, train = _inputs(shapes, *sets)
    known = set(train["caption"])
    assert all(c in known for b in plain for c in b["captions"][0::2])


def test_hflip_swap_flips_pixels_and_caption_together(shapes):
    swap, train = _inputs(shapes, "data.hflip=swap")
    plain, _ = _inputs(shapes)   # same seed: the same rows, crops (none: scale_min) and order
    assert swap.steps_per_epoch == plain.steps_per_epoch
    flipped = kept = 0
    for a, b in zip(_batches(swap, 0), _batches(plain, 0)):
        assert torch.equal(a["image_ids"], b["image_ids"])   # the same image: the same id
        for k in range(len(a["captions"])):
            if a["captions"][k] == b["captions"][k] and torch.equal(a["pixels"][k], b["pixels"][k]):
                kept += 1
                continue
            assert torch.equal(a["pixels"][k], torch.flip(b["pixels"][k], dims=(-1,)))
            assert a["captions"][k] == swap_left_right(b["captions"][k])
            flipped += 1
    assert flipped > 5 and kept > 5   # p = 0.5 per sample over 40
    # the draw is the key's: row i of epoch e is flipped iff flips((seed, e, i))
    ds = swap.dataset
    for row in range(6):
        pixels, caption, _ = ds[row]
        ref, ref_caption, _ = plain.dataset[row]
        assert torch.equal(pixels, torch.flip(ref, dims=(-1,)) if flips((0, 0, row)) else ref)
        assert caption == (swap_left_right(ref_caption) if flips((0, 0, row)) else ref_caption)


def test_the_loss_counts_a_mirror_without_position_words_as_a_positive():
    # Two sources and their mirrors: "a red circle at the top" (no left/right word: its mirror keeps the id) and
    # "a blue square on the left" (its mirror, "... on the right", gets -1 - id). Features that match each pair's
    # text exactly: the identical texts of the first pair must not be pushed apart.
    from clip_mini.model.loss import clip_loss

    caps = ["a red circle at the top", "a blue square on the left"]
    ids, rows = [], []
    for i, c in enumerate(caps):
        swapped = swap_left_right(c)
        ids += [i, mirror_id(i, swapped != c)]
        rows += [c, swapped]
    assert ids == [0, 0, 1, -2]
    basis = {c: torch.eye(4)[j] for j, c in enumerate(dict.fromkeys(rows))}
    text = torch.stack([basis[c] for c in rows])   # rows 0 and 1: the same text
    image = text.clone()
    scale = torch.tensor(30.0)
    good = clip_loss(image, text, scale, torch.tensor(ids))
    blind = clip_loss(image, text, scale, torch.arange(4))   # every mirror a negative: the twin texts compete
    assert float(good) < 1e-6 and float(blind) > 0.5 * math.log(2)


# --- WebDataset streams ----------------------------------------------------------------------------------------

def test_webdataset_streams_give_pairs_too_and_resume_exactly(shapes, tmp_path):
    from clip_mini.data.convert import convert_to_webdataset

    root, data = shapes
    cfg = load_config(None, [f"data.captions={data / 'captions.csv'}", "data.val=8", "data.cache=false"])
    train = load_splits(cfg, progress=False)["train"]
    out = convert_to_webdataset(train, tmp_path / "wds", shard_size=10, progress=False)
    sets = [f"data.shards={out['pattern']}", "data.format=webdataset", f"data.samples={out['samples']}",
            "data.mirror_pairs=true", "data.hflip=swap", "model.vision.image_size=32", "train.batch_size=8",
            "data.workers=0", "data.shuffle_buffer=4"]
    wcfg = load_config(None, sets)
    tok = train_tokenizer(train["caption"], 200)
    inputs = build_train_inputs(wcfg, train, PreprocessConfig(image_size=32), tok, 16)
    inputs.collate = CaptionsToo(tok)
    assert inputs.steps_per_epoch == out["samples"] // 4   # data.samples sources an epoch, 4 (and mirrors) a batch
    full = _batches(inputs, 0)
    assert len(full) == inputs.steps_per_epoch
    for b in full:
        ids = b["image_ids"].tolist()
        for k in range(0, 8, 2):
            assert torch.equal(b["pixels"][k + 1], torch.flip(b["pixels"][k], dims=(-1,)))
            assert b["captions"][k + 1] == swap_left_right(b["captions"][k])
            assert ids[k + 1] == mirror_id(ids[k], b["captions"][k + 1] != b["captions"][k])
    assert _same([b for step in inputs.loader(0, start_step=1) for b in step], full[1:])


# --- the trainer, end to end -----------------------------------------------------------------------------------

def test_a_locked_text_tower_has_rows_for_the_mirrored_captions(shapes, tmp_path, monkeypatch):
    # the stored text rows are per distinct caption of the table; mirrored captions ("... on the right" for a
    # table caption "... on the left") need theirs, and training on the rows equals running the tower
    from clip_mini.train import text_cache, train

    _, data = shapes

    def run(name):
        cfg = load_config(None, tiny_sets() + [
            "model.text.trainable=false", "data.val=8", "train.device=cpu", "train.batch_size=8", "train.epochs=1",
            "train.threads=1", "train.log_every=1", "train.precision=fp32", "data.cache=false",
            "data.mirror_pairs=true", "data.hflip=swap", f"data.captions={data / 'captions.csv'}",
            f"train.out_dir={tmp_path / name}"])
        train(cfg)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["kind"] == "step"]

    cached = run("cached")
    monkeypatch.setattr(text_cache, "wanted", lambda cfg: False)
    plain = run("plain")
    assert len(cached) == len(plain) == 10   # 40 train images, 4 sources a step
    assert cached == pytest.approx(plain, abs=1e-5)
