"""clip-mini dupes --features embedding: planted copies of shapes images are grouped with their originals, from the
index alone.

The session's tiny trained model tells colours apart far better than shapes (two different-shape images of one
colour can score 0.99), so the originals here differ in colour: one single-object image per colour. Its planted
copies (``EDITS_HERE``) score >= 0.97 with their originals and different colours <= 0.9, hence ``--threshold 0.95``
(the default threshold belongs to photo models: ``benchmarks/studies/dupes_planted.py``). The study's other edits
are not for this model: on its 64-pixel images the 10% crop scores down to 0.95, the 5-degree turn 0.79 and the
screenshot frame below 0.
"""
from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest

from benchmarks.lib.planted import pair_scores, plant_copies
from clip_mini.cli.main import main


THRESHOLD = "0.95"
# these tests group the stored embeddings; the tower features (the default where the model is at hand) are
# tested in test_dupe_features.py
DUPES = ("dupes", "--features", "embedding")
EDITS_HERE = ("jpeg40", "half", "colour", "caption")


def _distinct_originals(shapes_dir, n: int) -> list:
    """``n`` single-object images of different colours (see the module docstring)."""
    seen, out = set(), []
    with open(shapes_dir / "labels.csv", newline="") as f:
        for r in csv.DictReader(f):
            key = r["colour"]
            if r["split"] == "train" and key not in seen and r["n_objects"] == "1":
                seen.add(key)
                out.append(shapes_dir / "images" / r["image"])
            if len(out) == n:
                break
    return out


@pytest.fixture(scope="module")
def planted_index(shapes_dir, trained_model_dir, tmp_path_factory):
    from clip_mini.retrieval.index import EmbeddingIndex

    root = tmp_path_factory.mktemp("dupes")
    photos = root / "photos"
    photos.mkdir()
    originals = _distinct_originals(shapes_dir, 6)
    for p in originals:
        shutil.copy2(p, photos / p.name)
    planted = plant_copies([photos / p.name for p in originals[:4]], photos / "copies", copies_each=3,
                           edits=EDITS_HERE)
    (photos / "broken.png").write_bytes(b"not a png")
    index = EmbeddingIndex.build(root / "index", str(trained_model_dir), photos, workers=0)
    return root / "index", planted, index


def test_dupes_finds_planted_copies(planted_index, tmp_path, capsys):
    index_dir, planted, index = planted_index
    assert "broken.png" not in " ".join(index.items["path"])   # the unreadable file was skipped at index time
    grid = tmp_path / "dupes.png"
    assert main([*DUPES, "--index", str(index_dir), "--threshold", THRESHOLD, "--json", "--grid", str(grid),
                 "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    groups = [g["paths"] for g in out["groups"]]
    scores = pair_scores(groups, planted)
    assert scores["true_pairs"] == 4 * 6 and scores["recall"] == 1.0 and scores["precision"] == 1.0, scores
    assert all(0 < g["similarity"] <= 1 for g in out["groups"])
    assert [g["similarity"] for g in out["groups"]] == sorted((g["similarity"] for g in out["groups"]), reverse=True)
    from PIL import Image

    assert Image.open(grid).size[1] > 100


def test_dupes_faiss_range_search_matches_exact_on_the_planted_index(planted_index):
    pytest.importorskip("faiss")
    from clip_mini.retrieval.dupes import find_duplicates

    _, _, index = planted_index
    rows = np.asarray(index.embeddings, np.float32)
    for threshold in (0.5, 0.95):
        exact = find_duplicates(rows, threshold, "exact")
        approx = find_duplicates(rows, threshold, "faiss")
        assert [g.rows for g in approx] == [g.rows for g in exact]
        assert np.allclose([g.similarity for g in approx], [g.similarity for g in exact], atol=1e-5)


def test_dupes_text_output_and_threshold_one(planted_index, capsys):
    index_dir, _, _ = planted_index
    assert main([*DUPES, "--index", str(index_dir), "--threshold", "1", "--json", "-q"]) == 0
    # threshold 1 is "identical up to the float16 rounding of the stored rows" (scores from 1 - 1e-3): only the
    # half-size copies, which the 32 px model sees as the same pixels as their 64 px originals, get there
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert groups and all(len(g["paths"]) == 2 and g["paths"][0].endswith("__half.png") for g in groups)
    assert all(g["paths"][1].endswith(g["paths"][0].rsplit("/", 1)[1].replace("__half", "")) for g in groups)
    assert all(1 >= g["similarity"] >= 1 - 1.1e-3 for g in groups)
    assert main([*DUPES, "--index", str(index_dir), "--threshold", THRESHOLD]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("group 1  similarity ") and "dupes: " in captured.err


@pytest.mark.parametrize("bad", ["1.5", "0", "-0.2", "nan", "high"])
def test_dupes_refuses_threshold_outside_0_1(planted_index, bad, capsys):
    index_dir, _, _ = planted_index
    with pytest.raises(SystemExit) as e:
        main([*DUPES, "--index", str(index_dir), "--threshold", bad])
    assert e.value.code == 2
    assert "--threshold" in capsys.readouterr().err


def test_dupes_library_checks():
    from clip_mini.retrieval.dupes import EmbeddingIndexError, find_duplicates

    with pytest.raises(EmbeddingIndexError, match="threshold"):
        find_duplicates(np.eye(3, dtype=np.float32), 1.2)
    with pytest.raises(EmbeddingIndexError, match="backend"):
        find_duplicates(np.eye(3, dtype=np.float32), 0.9, "annoy")
    assert find_duplicates(np.eye(1, 3, dtype=np.float32), 0.9) == []
    x = np.eye(4, dtype=np.float16)
    x[3] = x[0]
    [g] = find_duplicates(x, 0.99)
    assert g.rows == [0, 3] and g.similarity == pytest.approx(1.0)


def test_dupes_missing_index(tmp_path, capsys):
    assert main([*DUPES, "--index", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _unit(x) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _pairs(groups) -> set:
    return {(a, b) for g in groups for k, a in enumerate(g.rows) for b in g.rows[k + 1:]}


def test_threshold_one_finds_every_image_stored_twice():
    """float16 rows score 1 +- 1e-3 with themselves: ``>= 1`` alone missed about half of the identical pairs."""
    from clip_mini.retrieval.dupes import find_duplicates, score_tolerance
    from clip_mini.retrieval.rows import BF16Rows, f32_to_bf16_bits

    x = _unit(np.random.default_rng(0).standard_normal((200, 512)))
    twice = np.concatenate([x, x])
    for rows in (twice.astype(np.float16), BF16Rows(f32_to_bf16_bits(twice))):
        for backend in ("exact", "faiss"):
            groups = find_duplicates(rows, 1.0, backend)
            assert sorted(g.rows for g in groups) == [[k, k + 200] for k in range(200)], (rows, backend)
            assert all(g.similarity == g.lowest == pytest.approx(1, abs=score_tolerance(rows)) for g in groups)
    # the tolerance is the rounding bound, not a looser threshold: a pair at 0.99 stays apart at 1
    near = _unit(x[0] + 0.15 * x[1])
    assert 0.985 < float(near @ x[0]) < 0.995
    assert find_duplicates(np.stack([x[0], near]).astype(np.float16), 1.0) == []
    assert score_tolerance(np.zeros((1, 512), np.float16)) == pytest.approx(1.009e-3, rel=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_score_tolerance_bounds_the_rounding_of_stored_rows(dtype):
    from clip_mini.retrieval.dupes import score_tolerance
    from clip_mini.retrieval.rows import BF16Rows, bf16_bits_to_f32, f32_to_bf16_bits

    rng = np.random.default_rng(1)
    x = _unit(rng.standard_normal((300, 256)))
    y = _unit(x + rng.standard_normal(x.shape) * 0.05)   # close pairs, where rounding matters
    if dtype == "bfloat16":
        xs, ys = bf16_bits_to_f32(f32_to_bf16_bits(x)), bf16_bits_to_f32(f32_to_bf16_bits(y))
        rows = BF16Rows(f32_to_bf16_bits(x))
    else:
        xs, ys = x.astype(dtype).astype(np.float32), y.astype(dtype).astype(np.float32)
        rows = x.astype(dtype)
    err = np.abs((xs * ys).sum(-1) - (x.astype(np.float64) * y).sum(-1)).max()
    tol = score_tolerance(rows)
    assert err <= tol


def _near_duplicate_rows(n_base: int = 2000, dim: int = 16, seed: int = 0) -> np.ndarray:
    """``n_base`` random rows and a noisy copy of each (cosine about 0.97-0.99), in shuffled order."""
    rng = np.random.default_rng(seed)
    base = _unit(rng.standard_normal((n_base, dim)))
    copies = _unit(base + rng.standard_normal(base.shape) * 0.04)
    rows = np.concatenate([base, copies])
    return rows[rng.permutation(len(rows))].astype(np.float16)


def test_faiss_path_with_many_lists_matches_exact_and_keeps_both_directions(monkeypatch):
    """The planted index has 18 rows and one inverted list: this one has 63 lists, so probes miss some."""
    pytest.importorskip("faiss")
    from clip_mini.retrieval import dupes

    rows = _near_duplicate_rows()
    exact = dupes.find_duplicates(rows, 0.95, "exact")
    assert len(exact) == 2000
    built = []
    real_index = dupes._ivf_index
    # the auto path with a small row threshold, every list probed: the same pairs as exact
    monkeypatch.setattr(dupes, "_ivf_index", lambda rows, _nprobe, seed: built.append(real_index(rows, 10_000, seed))
                        or built[-1])
    auto = dupes.find_duplicates(rows, 0.95, "auto", approx_from=1000)
    assert built and built[-1].nlist == 63 and built[-1].nprobe == 63
    by_rows = {tuple(g.rows): g.similarity for g in exact}
    assert sorted(g.rows for g in auto) == sorted(g.rows for g in exact)   # scores alike to 1e-7: order may differ
    assert all(g.similarity == pytest.approx(by_rows[tuple(g.rows)], abs=1e-6) for g in auto)
    monkeypatch.undo()
    # two lists probed: some pairs are proposed from only one of their rows, and only from the higher one
    cutoff = 0.95 - dupes.score_tolerance(rows)
    index = real_index(rows, 2, 0)
    lims, _, ids = index.range_search(np.asarray(rows, np.float32), cutoff - dupes.SQ_MARGIN)
    proposed = {(q, int(t)) for q in range(len(rows)) for t in ids[lims[q]:lims[q + 1]] if t != q}
    true_pairs = {(int(a), int(b)) for i, j, _ in dupes.exact_pairs(rows, cutoff) for a, b in zip(i, j)}
    from_lower = {p for p in true_pairs if p in proposed}
    from_higher_only = {p for p in true_pairs if p not in proposed and p[::-1] in proposed}
    assert from_higher_only, "the data no longer shows one-sided probes: choose other rows"
    found = {(int(a), int(b)) for i, j, _ in dupes.faiss_pairs(rows, cutoff, nprobe=2) for a, b in zip(i, j)}
    assert found == from_lower | from_higher_only


def test_faiss_pairs_keeps_a_pair_proposed_from_its_higher_row_only(monkeypatch):
    """An index that proposes each row's lower neighbours only (as probing can): every pair still comes back."""
    from clip_mini.retrieval import dupes

    rows = _near_duplicate_rows(200)

    class LowerOnly:
        def range_search(self, q, radius):
            assert len(q) == len(rows)   # one block
            sims = q @ np.asarray(rows, np.float32).T
            hits = [np.flatnonzero((sims[k] >= radius) & (np.arange(len(rows)) < k)) for k in range(len(q))]
            lims = np.cumsum([0] + [len(h) for h in hits])
            ids = np.concatenate(hits)
            return lims, sims[np.repeat(np.arange(len(q)), np.diff(lims)), ids], ids

    monkeypatch.setattr(dupes, "_ivf_index", lambda *a: LowerOnly())
    exact = _pairs(dupes.find_duplicates(rows, 0.95, "exact"))
    approx = dupes.find_duplicates(rows, 0.95, "faiss")
    assert len(exact) == 200 and _pairs(approx) == exact


def test_a_threshold_that_links_most_pairs_is_refused(planted_index, capsys):
    from clip_mini.retrieval.dupes import EmbeddingIndexError, exact_pairs, find_duplicates

    rows = _near_duplicate_rows(1500)   # 3000 rows: 4.5M pairs
    with pytest.raises(EmbeddingIndexError, match=r"--threshold 0\.01 links about .* more than --max-pairs 10,000"):
        find_duplicates(rows, 0.01, max_pairs=10_000)
    assert len(find_duplicates(rows, 0.95, max_pairs=10_000)) == 1500
    # counted while the pairs are gathered too, for what the sampled estimate misses
    with pytest.raises(EmbeddingIndexError, match="links more than"):
        list(exact_pairs(rows, 0.01, max_pairs=10_000))
    index_dir, _, _ = planted_index
    assert main([*DUPES, "--index", str(index_dir), "--threshold", "0.05", "--max-pairs", "10", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--threshold 0.05 links about" in err and "raise --threshold" in err and "--max-pairs 10" in err


def _chain() -> np.ndarray:
    """Rows A, B, C on a circle (in 8 dimensions): A.B 0.975, B.C 0.970, A.C 0.892; and a far row D."""
    angles = np.cumsum([0.0, np.arccos(0.975), np.arccos(0.970)])
    rows = np.zeros((4, 8), np.float32)
    rows[:3, 0], rows[:3, 1] = np.cos(angles), np.sin(angles)
    rows[3, 5] = 1
    return rows


def test_single_linkage_reports_a_chains_lowest_pair_and_complete_linkage_splits_it():
    from clip_mini.retrieval.dupes import find_duplicates

    rows = _chain()
    [single] = find_duplicates(rows, 0.96)
    assert single.rows == [0, 1, 2]
    assert single.similarity == pytest.approx(0.970, abs=1e-5)
    assert single.lowest == pytest.approx(float(rows[0] @ rows[2]), abs=1e-5) and single.lowest < 0.9
    [complete] = find_duplicates(rows, 0.96, linkage="complete")
    assert complete.rows == [0, 1] and complete.similarity == complete.lowest == pytest.approx(0.975, abs=1e-5)
    assert [g.rows for g in find_duplicates(rows, 0.85, linkage="complete")] == [[0, 1, 2]]


def test_a_single_linkage_group_too_large_for_its_lowest_pair_says_so(monkeypatch):
    from clip_mini.retrieval import dupe_groups
    from clip_mini.retrieval.dupes import find_duplicates

    monkeypatch.setattr(dupe_groups, "LOWEST_MAX_ROWS", 2)
    [chain] = find_duplicates(_chain(), 0.96)
    assert chain.rows == [0, 1, 2] and chain.lowest is None and chain.similarity == pytest.approx(0.970, abs=1e-5)
    [pair] = find_duplicates(_chain()[:2], 0.96)   # every pair linked: its lowest pair is its weakest link
    assert pair.lowest == pair.similarity


def test_complete_linkage_groups_are_cliques_and_split_single_components():
    from clip_mini.retrieval.dupes import find_duplicates

    rng = np.random.default_rng(3)
    centres = _unit(rng.standard_normal((40, 32)))
    rows = _unit(np.repeat(centres, 6, axis=0) + rng.standard_normal((240, 32)) * 0.04)
    sims = rows @ rows.T
    single = find_duplicates(rows, 0.93)
    complete = find_duplicates(rows, 0.93, linkage="complete")
    assert any(g.lowest < 0.93 for g in single)   # some single-linkage groups are chains
    for g in complete:
        block = sims[np.ix_(g.rows, g.rows)][np.triu_indices(len(g.rows), 1)]
        assert block.min() >= 0.93 - 1e-6 and g.lowest == pytest.approx(block.min(), abs=1e-6)
    assert _pairs(complete) <= _pairs(single) and len(complete) > len(single)
    for g in single:
        block = sims[np.ix_(g.rows, g.rows)][np.triu_indices(len(g.rows), 1)]
        assert g.lowest == pytest.approx(block.min(), abs=1e-6)
    # the same groups whatever the order of the rows
    perm = rng.permutation(len(rows))
    again = find_duplicates(rows[perm], 0.93, linkage="complete")
    assert sorted(sorted(perm[g.rows].tolist()) for g in again) == sorted(g.rows for g in complete)


def test_dupes_cli_linkage_and_lowest_pair(planted_index, capsys):
    index_dir, _, _ = planted_index
    for linkage in ("single", "complete"):
        assert main([*DUPES, "--index", str(index_dir), "--threshold", THRESHOLD, "--linkage", linkage, "--json",
                     "-q"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["linkage"] == linkage and out["groups"]
        assert all(g["lowest"] <= g["similarity"] for g in out["groups"])
        if linkage == "complete":
            assert all(g["lowest"] == g["similarity"] >= float(THRESHOLD) - 1e-3 for g in out["groups"])
    assert main([*DUPES, "--index", str(index_dir), "--threshold", THRESHOLD]) == 0
    assert " lowest pair 0." in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*DUPES, "--index", str(index_dir), "--linkage", "average"])
    assert "--linkage" in capsys.readouterr().err
