"""clip_mini.builtin.delta: what a delta stores, and that applying it rebuilds the trained tensors."""
import pytest
import torch

from clip_mini.builtin.delta import apply_delta, delta_bytes, make_delta
from clip_mini.errors import ModelDirError


@pytest.fixture
def pair():
    g = torch.Generator().manual_seed(0)
    base = {"text.embeddings.word_embeddings.weight": torch.randn(5000, 32, generator=g),
            "visual.blocks.0.fc1.weight": torch.randn(96, 64, generator=g),
            "visual.norm.bias": torch.randn(64, generator=g),
            "visual.pos_embed": torch.randn(1, 5, 64, generator=g),
            "visual.blocks.1.fc1.weight": torch.randn(96, 64, generator=g),   # left as it was
            "steps": torch.tensor(3)}
    trained = {k: v.clone() for k, v in base.items()}
    emb = trained["text.embeddings.word_embeddings.weight"]
    emb *= 0.995                                       # weight decay of rows whose tokens never occurred
    emb[[3, 70, 4999]] += torch.randn(3, 32, generator=g)
    trained["visual.blocks.0.fc1.weight"] += torch.randn(96, 3, generator=g) @ torch.randn(3, 64, generator=g) * 0.1
    trained["visual.norm.bias"] += 0.01
    trained["visual.pos_embed"] += 0.02
    trained["head_image.proj.weight"] = torch.randn(16, 64, generator=g)   # no base: a new head
    return base, trained


def test_delta_stores_only_what_changed_in_its_compact_form(pair):
    base, trained = pair
    delta = make_delta(trained, base, rank=4)
    assert set(delta) == {"text.embeddings.word_embeddings.weight@scale", "text.embeddings.word_embeddings.weight@rows",
                          "text.embeddings.word_embeddings.weight@values", "visual.blocks.0.fc1.weight@a",
                          "visual.blocks.0.fc1.weight@b", "visual.norm.bias", "visual.pos_embed",
                          "head_image.proj.weight@whole"}
    assert delta["text.embeddings.word_embeddings.weight@rows"].tolist() == [3, 70, 4999]
    assert delta["visual.blocks.0.fc1.weight@a"].shape == (4, 64)
    assert delta["visual.blocks.0.fc1.weight@b"].shape == (96, 4)
    assert all(t.dtype in (torch.float16, torch.float32, torch.int64) for t in delta.values())
    full = sum(t.numel() * 2 for t in trained.values())
    assert delta_bytes(delta) < full / 10


def test_applying_the_delta_rebuilds_the_trained_tensors(pair):
    base, trained = pair
    state = apply_delta(base, make_delta(trained, base, rank=4))
    assert set(state) == set(trained)
    for key, want in trained.items():
        got = state[key]
        assert got.shape == want.shape
        # fp16 storage of differences: errors far below the changes themselves
        assert torch.allclose(got.float(), want.float(), atol=2e-3), key
    assert torch.equal(state["visual.blocks.1.fc1.weight"], base["visual.blocks.1.fc1.weight"])
    assert torch.equal(state["steps"], base["steps"])


def test_a_low_rank_cut_drops_the_small_directions_only(pair):
    base, trained = pair
    key = "visual.blocks.0.fc1.weight"
    g = torch.Generator().manual_seed(1)
    trained[key] = base[key] + torch.randn(96, 64, generator=g) * 0.05   # full-rank change
    err = {r: (apply_delta(base, make_delta(trained, base, rank=r))[key] - trained[key]).norm().item()
           for r in (2, 8, 16)}
    assert err[2] > err[8] > err[16]


def test_a_delta_that_does_not_fit_the_model_is_refused(pair):
    base, trained = pair
    delta = make_delta(trained, base, rank=4)
    bad = dict(delta)
    bad["visual.blocks.0.fc1.weight@a"] = torch.zeros(4, 65, dtype=torch.float16)
    with pytest.raises(ModelDirError, match="visual.blocks.0.fc1.weight"):
        apply_delta(base, bad)
    with pytest.raises(ModelDirError, match="missing.weight"):
        apply_delta(base, {"missing.weight@a": torch.zeros(1, 1), "missing.weight@b": torch.zeros(1, 1)})
    rows = dict(delta)
    rows["text.embeddings.word_embeddings.weight@rows"] = torch.tensor([3, 70, 5000])
    with pytest.raises(ModelDirError, match="do not fit"):
        apply_delta(base, rows)
    with pytest.raises(ValueError):
        make_delta(trained, base, rank=0)
    with pytest.raises(ModelDirError, match="visual.norm.bias"):
        apply_delta(base, {"visual.norm.bias": torch.zeros(3, dtype=torch.float16)})


def test_a_whole_tensor_replaces_what_the_base_holds_under_its_name(pair):
    base, trained = pair
    delta = make_delta(trained, base, rank=4)
    noisy = dict(base, **{"head_image.proj.weight": torch.randn(16, 64)})   # a freshly built model's random head
    state = apply_delta(noisy, delta)
    assert torch.allclose(state["head_image.proj.weight"], trained["head_image.proj.weight"], atol=2e-3)
