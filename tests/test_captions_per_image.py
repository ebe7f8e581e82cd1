"""Several captions per image in a step (train.captions_per_image): the multi-positive contrastive loss, the rows
each batch carries, and a run that trains on them (single batch and accumulated alike)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from clip_mini.config import ConfigError, load_config
from clip_mini.model.loss import clip_loss, multi_positive_nll, siglip_loss
from clip_mini.train import text_cache
from conftest import tiny_sets


def _features(n, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=-1)


def test_one_positive_per_row_is_the_cross_entropy():
    logits = torch.randn(6, 9, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 3, 8, 2, 2, 5])
    positive = F.one_hot(target, 9).bool()
    torch.testing.assert_close(multi_positive_nll(logits, positive), F.cross_entropy(logits, target))


def test_text_ids_equal_to_image_ids_give_the_one_caption_loss():
    img, txt, scale = _features(5), _features(5, seed=1), torch.tensor(10.0)
    ids = torch.tensor([0, 1, 2, 3, 4])
    torch.testing.assert_close(clip_loss(img, txt, scale, ids, text_ids=ids), clip_loss(img, txt, scale, ids))


def test_every_caption_of_an_image_is_a_positive_competing_with_the_negatives_only():
    img, txt, scale = _features(3), _features(6, seed=2), torch.tensor(7.0)
    image_ids, text_ids = torch.tensor([4, 9, 2]), torch.tensor([4, 4, 9, 9, 2, 2])
    got = clip_loss(img, txt, scale, image_ids, text_ids=text_ids)
    s = (scale * img @ txt.T).tolist()
    i2t = []   # by hand: image i, each of its captions p against the captions of other images
    for i in range(3):
        pos = [j for j in range(6) if text_ids[j] == image_ids[i]]
        neg = [j for j in range(6) if text_ids[j] != image_ids[i]]
        i2t.append(sum(-s[i][p] + torch.logsumexp(torch.tensor([s[i][p]] + [s[i][n] for n in neg]), 0).item()
                       for p in pos) / len(pos))
    t2i = [-s[int(j // 2)][j] + torch.logsumexp(torch.tensor([s[i][j] for i in range(3)]), 0).item() for j in range(6)]
    want = 0.5 * (sum(i2t) / 3 + sum(t2i) / 6)
    assert got.item() == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="label_smoothing"):
        clip_loss(img, txt, scale, image_ids, label_smoothing=0.1, text_ids=text_ids)


def test_siglip_counts_every_caption_of_the_image_as_positive():
    img, txt = _features(2), _features(4, seed=3)
    image_ids, text_ids = torch.tensor([0, 1]), torch.tensor([0, 0, 1, 1])
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    logits = scale * img @ txt.T + bias
    signs = torch.tensor([[1., 1., -1., -1.], [-1., -1., 1., 1.]])
    want = -F.logsigmoid(signs * logits).sum() / 2
    torch.testing.assert_close(siglip_loss(img, txt, scale, bias, image_ids, text_ids), want)


def test_collate_brings_the_drawn_caption_then_the_images_next_ones():
    captions = ["a", "b", "c", "d", "e"]
    image_ids = [0, 0, 0, 1, 1]
    index = {c: i for i, c in enumerate(captions)}
    rows = torch.arange(5, dtype=torch.float32)[:, None].repeat(1, 2)
    groups = text_cache.caption_groups(captions, image_ids, index)
    assert groups == {0: [0, 1, 2], 1: [3, 4]}

    def base(batch):
        return {"image_ids": torch.tensor([b[2] for b in batch])}

    collate = text_cache.TextRowCollate(base, index, rows, per_image=3, groups=groups)
    out = collate([(None, "b", 0), (None, "e", 1)])
    assert out["text_tower"][:, 0].tolist() == [1, 2, 0, 4, 3, 4]   # cyclic from the drawn one; repeats when short
    assert out["text_ids"].tolist() == [0, 0, 0, 1, 1, 1]
    one = text_cache.TextRowCollate(base, index, rows)([(None, "b", 0), (None, "e", 1)])
    assert one["text_tower"][:, 0].tolist() == [1, 4] and "text_ids" not in one


def test_trained_tower_collate_tokenizes_the_drawn_caption_then_the_images_next_ones():
    from clip_mini.data.caption_groups import CaptionGroupCollate, group_by_image

    groups = group_by_image(["a dog", "a cat", "a cow", "red", "blue"], [0, 0, 0, 1, 1])
    assert groups == {0: ["a dog", "a cat", "a cow"], 1: ["red", "blue"]}
    seen = []

    def tokenizer(texts, **kw):
        seen.append(list(texts))
        n = len(texts)
        return {"input_ids": torch.arange(n)[:, None], "attention_mask": torch.ones(n, 1, dtype=torch.long)}

    def base(batch):
        return {"image_ids": torch.tensor([b[2] for b in batch]), "input_ids": torch.zeros(len(batch), 1)}

    out = CaptionGroupCollate(base, tokenizer, 16, groups, per_image=3)([(None, "a cat", 0), (None, "blue", 1)])
    assert seen == [["a cat", "a cow", "a dog", "blue", "red", "blue"]]   # cyclic from the drawn one; repeats
    assert out["text_ids"].tolist() == [0, 0, 0, 1, 1, 1] and out["input_ids"].shape == (6, 1)
    with pytest.raises(ValueError, match="per_image"):
        CaptionGroupCollate(base, tokenizer, 16, groups, per_image=1)


def _config(shapes, out_dir, *extra):
    return load_config(None, tiny_sets() + [
        "model.text.trainable=false", "data.val=8", "train.device=cpu",
        "train.batch_size=8", "train.epochs=2", "train.threads=1", "train.log_every=1", "train.precision=fp32",
        "model.vision.dropout=0", "model.head_dropout=0", "train.captions_per_image=3",
        f"data.captions={shapes / 'captions.csv'}", f"train.out_dir={out_dir}", *extra])


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "step"]


@pytest.mark.parametrize("tower", [
    [],   # pixels through the whole ViT every step
    ["model.vision.trainable_blocks=1", "train.frozen_features=2", "data.workers=0"],   # stored token states
    ["model.text.trainable=true"],   # a text tower that trains: the tokens of every caption
    ["model.text.trainable=true", "model.vision.trainable_blocks=1", "train.frozen_features=2", "data.workers=0"],
])
def test_a_run_trains_on_every_caption_and_accumulation_gives_the_same_steps(tmp_path, monkeypatch, tower):
    from clip_mini.data import generate
    from clip_mini.model.loss import ClipLoss
    from clip_mini.train import train

    shapes = generate(tmp_path / "shapes", n=48, seed=0, size=32)   # 3 captions per image
    seen = []
    real = ClipLoss.forward

    def spy(self, img, txt, scale, image_ids=None, text_ids=None):
        seen.append((len(img), len(txt), text_ids is not None))
        return real(self, img, txt, scale, image_ids, text_ids)

    monkeypatch.setattr(ClipLoss, "forward", spy)
    result = train(_config(shapes, tmp_path / "whole", *tower))
    assert result["step"] >= 8 and seen and all(s == (8, 24, True) for s in seen)
    whole = _losses(tmp_path / "whole")
    train(_config(shapes, tmp_path / "accum", "train.batch_size=4", "train.accum_freq=2", *tower))
    accumulated = _losses(tmp_path / "accum")
    assert whole == pytest.approx(accumulated, abs=1e-5)
    assert all(torch.isfinite(torch.tensor(whole)))


@pytest.mark.parametrize("extra, match", [
    (["data.format=webdataset"], "one caption per sample"),
    (["train.label_smoothing=0.1"], "one caption per image"),
    (["train.captions_per_image=0"], "must be > 0"),
])
def test_config_errors(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _config(tmp_path, tmp_path / "run", *extra)
