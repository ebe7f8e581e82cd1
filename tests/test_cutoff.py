"""clip_mini.retrieval.cutoff: the index's score distribution per query, and the cut-off read against it."""
import numpy as np
import pytest

from clip_mini.retrieval.cutoff import DEFAULT_Z, IndexStats, keep_mask


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture
def rows():
    rng = np.random.default_rng(0)
    return _unit(rng.normal(size=(3000, 32)) + 0.5).astype(np.float16)   # off-centre, as real embeddings are


def test_moments_equal_those_of_the_scores_themselves(rows):
    rng = np.random.default_rng(1)
    q = _unit(rng.normal(size=(4, 32)))
    mu, sd = IndexStats.from_rows(rows).moments(q)
    scores = q @ rows.astype(np.float64).T
    np.testing.assert_allclose(mu, scores.mean(1), atol=1e-9)
    np.testing.assert_allclose(sd, scores.std(1), rtol=1e-9)


def test_a_sample_of_rows_gives_nearly_the_same_z(rows):
    rng = np.random.default_rng(2)
    q = _unit(rng.normal(size=(8, 32)))
    scores = q @ rows.astype(np.float64).T[:, :5]
    full = IndexStats.from_rows(rows).z(q, scores)
    sampled = IndexStats.from_rows(rows, sample=1000)
    assert sampled.rows == 1000
    np.testing.assert_allclose(sampled.z(q, scores), full, atol=0.15)


def test_a_row_that_stands_out_passes_and_the_crowd_does_not(rows):
    stats = IndexStats.from_rows(rows)
    q = _unit(np.asarray(rows[:1], dtype=np.float64))           # the query is row 0 itself
    scores = q @ rows.astype(np.float64).T
    order = np.argsort(-scores[0])
    top = scores[:, order[:10]]
    mask = keep_mask(stats, q, top)
    assert mask[0, 0]                                          # itself: cosine 1, far out in the tail
    z = stats.z(q, scores)[0]
    assert (z >= DEFAULT_Z).mean() < 0.01                      # almost all of the index falls below the default


def test_min_score_overrides_and_none_keeps_everything(rows):
    stats = IndexStats.from_rows(rows)
    q = _unit(np.ones((1, 32)))
    s = np.array([[0.9, 0.5, 0.1]])
    assert keep_mask(stats, q, s, min_score=0.5).tolist() == [[True, True, False]]
    assert keep_mask(stats, q, s, min_z=None).all()
    assert keep_mask(None, q, s).all()
    with pytest.raises(ValueError):
        IndexStats.from_rows(rows[:0])
