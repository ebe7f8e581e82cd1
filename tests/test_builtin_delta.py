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


@pytest.fixture
def low_rank_pair():
    """A matrix changed by a rank-16 update plus small full-rank noise, and an embedding table with moved rows."""
    g = torch.Generator().manual_seed(2)
    base = {"visual.blocks.0.fc1.weight": torch.randn(256, 192, generator=g),
            "text.embeddings.word_embeddings.weight": torch.randn(5000, 32, generator=g)}
    trained = {k: v.clone() for k, v in base.items()}
    trained["visual.blocks.0.fc1.weight"] += (torch.randn(256, 16, generator=g) @ torch.randn(16, 192, generator=g)
                                              * 0.02 + torch.randn(256, 192, generator=g) * 0.002)
    trained["text.embeddings.word_embeddings.weight"][[5, 600, 4000]] += torch.randn(3, 32, generator=g)
    return base, trained


def test_an_int8_delta_rebuilds_what_the_fp16_delta_does(low_rank_pair):
    base, trained = low_rank_pair
    fp16, int8 = (apply_delta(base, make_delta(trained, base, rank=32, factors=f)) for f in ("fp16", "int8"))
    for key in base:
        change = fp16[key] - base[key]
        rel = ((int8[key] - fp16[key]).norm() / change.norm()).item()
        assert 0 < rel < 1e-2, (key, rel)   # int8 rounding with per-row/column scales: ~0.5% of the change
    delta = make_delta(trained, base, rank=32, factors="int8")
    assert delta["visual.blocks.0.fc1.weight@a"].dtype == delta["visual.blocks.0.fc1.weight@b"].dtype == torch.int8
    assert delta["visual.blocks.0.fc1.weight@a_scale"].shape == (192,)    # one per column of a (256x32 @ 32x192)
    assert delta["visual.blocks.0.fc1.weight@b_scale"].shape == (256,)    # one per row of b
    assert delta["text.embeddings.word_embeddings.weight@values"].dtype == torch.int8
    assert delta["text.embeddings.word_embeddings.weight@values_scale"].shape == (3,)
    with pytest.raises(ValueError, match="factors"):
        make_delta(trained, base, rank=32, factors="int4")


def test_int8_factors_take_half_the_bytes_plus_their_scales(low_rank_pair):
    base, trained = low_rank_pair
    fp16, int8 = (make_delta(trained, base, rank=32, factors=f) for f in ("fp16", "int8"))
    for key, scales in (("visual.blocks.0.fc1.weight", ("a", "b")), ("text.embeddings.word_embeddings.weight",
                                                                      ("values",))):
        old = delta_bytes({k: v for k, v in fp16.items() if k.startswith(f"{key}@")})
        new = delta_bytes({k: v for k, v in int8.items() if k.startswith(f"{key}@")})
        scale_bytes = sum(int8[f"{key}@{s}_scale"].numel() * 4 for s in scales)
        stored = sum(fp16[f"{key}@{s}"].numel() for s in scales)   # the values halved: 2 bytes each -> 1
        assert new == old - stored + scale_bytes, key
    factors = delta_bytes({k: v for k, v in int8.items() if k.startswith("visual.")})
    assert 0.5 < factors / delta_bytes({k: v for k, v in fp16.items() if k.startswith("visual.")}) < 0.6


def test_an_fp16_delta_of_the_shipped_form_still_applies():
    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(12, 10, generator=g), "emb": torch.randn(6, 4, generator=g)}
    delta = {"w@b": torch.randn(12, 2, generator=g).half(), "w@a": torch.randn(2, 10, generator=g).half(),
             "emb@rows": torch.tensor([1, 4]), "emb@values": torch.randn(2, 4, generator=g).half(),
             "emb@scale": torch.tensor([0.5])}
    state = apply_delta(base, delta)
    assert torch.equal(state["w"], base["w"] + delta["w@b"].float() @ delta["w@a"].float())
    want = base["emb"] * 0.5
    want[[1, 4]] += delta["emb@values"].float()
    assert torch.equal(state["emb"], want)


def test_a_malformed_int8_group_is_refused_by_name(low_rank_pair):
    base, trained = low_rank_pair
    delta = make_delta(trained, base, rank=32, factors="int8")
    key, emb = "visual.blocks.0.fc1.weight", "text.embeddings.word_embeddings.weight"
    no_scale = {k: v for k, v in delta.items() if k != f"{key}@a_scale"}
    with pytest.raises(ModelDirError, match=rf"{key}.*without its a_scale"):
        apply_delta(base, no_scale)
    no_scale = {k: v for k, v in delta.items() if k != f"{emb}@values_scale"}
    with pytest.raises(ModelDirError, match=rf"{emb}.*without its values_scale"):
        apply_delta(base, no_scale)
    for part, wrong in (("a_scale", torch.ones(32)), ("b_scale", torch.ones(255)),
                        ("values_scale", torch.ones(4)), ("b_scale", torch.ones(256, dtype=torch.int8))):
        name = emb if part == "values_scale" else key
        with pytest.raises(ModelDirError, match=rf"{part} for '{name}'"):
            apply_delta(base, dict(delta, **{f"{name}@{part}": wrong}))
    fp16 = make_delta(trained, base, rank=32)
    with pytest.raises(ModelDirError, match=rf"{key}.*b_scale"):   # a scale beside a float factor: ambiguous
        apply_delta(base, dict(fp16, **{f"{key}@b_scale": delta[f"{key}@b_scale"]}))
