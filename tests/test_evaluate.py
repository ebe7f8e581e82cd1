"""Retrieval and zero-shot metrics: ties count against the query, median rank of an even count, bad input."""
import numpy as np
import pytest
import torch

from clip_mini.evaluate import median_rank, retrieval_metrics, zero_shot_accuracy


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
