"""The planted-copy edits of the dupes study (``benchmarks/lib/planted.py``): each writes a valid image that shows
its edit, and the copies are the same for one seed.

The original is a real JPEG written here: a landscape photo-like picture (sky and ground gradients, a sun, a
house), no dark pixels (so rotation filler would show) and about as much red as blue (so a colour cast shows).
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from benchmarks.lib.planted import EDITS, edit, edit_kind, edit_recall, pair_scores, plant_copies, straighten_scale

W, H = 200, 150


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    y = np.linspace(0, 1, H)[:, None, None]
    x = np.linspace(0, 1, W)[None, :, None]
    sky = np.array([110, 160, 230]) * (1 - 0.3 * y) + 20 * x
    ground = np.array([200, 170, 90]) * (0.8 + 0.2 * y) + 10 * x
    a = np.where(np.arange(H)[:, None, None] < H * 0.55, sky, ground)
    img = Image.fromarray(np.clip(a, 60, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    d.ellipse((140, 15, 175, 50), fill=(250, 220, 90))
    d.rectangle((40, 60, 100, 110), fill=(180, 70, 70))
    d.polygon([(35, 60), (70, 35), (105, 60)], fill=(120, 80, 160))
    d.rectangle((62, 85, 78, 110), fill=(90, 90, 120))
    path = tmp_path_factory.mktemp("planted") / "house.jpg"
    img.save(path, quality=95)
    return path


@pytest.fixture(scope="module")
def copies(original, tmp_path_factory):
    out = tmp_path_factory.mktemp("copies")
    planted = plant_copies([original], out, copies_each=len(EDITS), seed=0)
    return {edit_kind(p): p for p in planted}, planted


def _px(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), np.float32)


def test_every_edit_writes_a_valid_png_named_for_it(copies, original):
    by_kind, planted = copies
    assert sorted(by_kind) == sorted(EDITS)
    assert set(planted.values()) == {str(original)}
    for kind, path in by_kind.items():
        assert path.endswith(f"__{kind}.png")
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.mode == "RGB" and min(im.size) > 0


def test_jpeg40_is_the_quality_40_reencoding(copies, original):
    buf = io.BytesIO()
    Image.open(original).convert("RGB").save(buf, format="JPEG", quality=40)
    want = np.asarray(Image.open(buf).convert("RGB"), np.float32)
    got = _px(copies[0]["jpeg40"])
    assert np.array_equal(got, want)
    assert 0 < np.abs(got - _px(original)).mean() < 8


def test_half_is_half_the_size_and_the_same_picture(copies, original):
    got = _px(copies[0]["half"])
    assert got.shape == (H // 2, W // 2, 3)
    small = np.asarray(Image.open(original).convert("RGB").resize((W // 2, H // 2)), np.float32)
    assert np.abs(got - small).mean() < 4


def test_crop90_is_a_window_of_the_original(copies, original):
    got = _px(copies[0]["crop90"])
    assert got.shape == (round(H * 0.9), round(W * 0.9), 3)
    src = _px(original)
    ch, cw = got.shape[:2]
    hits = [(y, x) for y in range(H - ch + 1) for x in range(W - cw + 1)
            if np.array_equal(src[y:y + ch, x:x + cw], got)]
    assert len(hits) == 1


def _horizon(px: np.ndarray, x: int) -> int:
    """The first ground row (red over blue) below the last sky row (blue over red) of column ``x``."""
    sky = np.nonzero(px[:, x, 2] > px[:, x, 0])[0]
    return int(sky.max()) + 1


def test_rotate5_keeps_the_size_tilts_the_horizon_and_leaves_no_filler(copies, original):
    got, src = _px(copies[0]["rotate5"]), _px(original)
    assert got.shape == src.shape
    assert np.abs(got - src).mean() > 5          # pixels moved
    ring = np.concatenate([got[:2].reshape(-1, 3), got[-2:].reshape(-1, 3), got[:, :2].reshape(-1, 3),
                           got[:, -2:].reshape(-1, 3)])
    assert ring.min() > 40                        # the original has nothing under 60: no black corners
    # the level horizon now slopes by tan(5 degrees): about 15 rows over 170 columns
    assert _horizon(src, 15) == _horizon(src, 185)
    tilt = abs(_horizon(got, 15) - _horizon(got, 185))
    assert 0.7 * 170 * np.tan(np.radians(5)) < tilt < 1.3 * 170 * np.tan(np.radians(5)), tilt
    assert 0.8 < straighten_scale(W, H, 5) < straighten_scale(W, H, 2) < 1


def test_colour_shifts_the_colours_and_keeps_the_picture(copies, original):
    got, src = _px(copies[0]["colour"]), _px(original)
    assert got.shape == src.shape
    assert np.abs(got - src).mean() > 4
    cast = np.log(got[..., 0].mean() / got[..., 2].mean()) - np.log(src[..., 0].mean() / src[..., 2].mean())
    assert abs(cast) > 0.05                       # a warm or cool cast moves red against blue
    lum = lambda a: a @ np.array([0.299, 0.587, 0.114], np.float32)  # noqa: E731
    assert np.corrcoef(lum(got).ravel(), lum(src).ravel())[0, 1] > 0.95


def test_caption_draws_text_across_a_band_at_the_top_or_bottom(copies, original):
    got, src = _px(copies[0]["caption"]), _px(original)
    assert got.shape == src.shape
    rows = np.nonzero((got != src).any(-1).any(-1))[0]
    top, bottom = rows.min(), rows.max()
    assert bottom - top + 1 <= 0.3 * H            # one line of text: only a band of rows changed
    assert bottom < 0.35 * H or top > 0.65 * H    # at the top or at the bottom of the photo
    ys, xs = np.nonzero(np.abs(got - src).max(-1) > 60)
    assert len(ys) > 200                          # letters, not a speck
    assert xs.max() - xs.min() > 0.5 * W          # across the photo


def _photo_box(px: np.ndarray, floor: float = 62) -> tuple[int, int, int, int]:
    """Rows and columns (y0, y1, x0, x1) of the block whose pixels are mostly at least ``floor`` bright."""
    bright = px.min(-1) >= floor
    ys = np.nonzero(bright.mean(1) > 0.6)[0]
    xs = np.nonzero(bright[ys.min():ys.max() + 1].mean(0) > 0.6)[0]
    return ys.min(), ys.max() + 1, xs.min(), xs.max() + 1


def test_border_frames_the_photo_like_a_screenshot(copies, original):
    got = _px(copies[0]["border"])
    h, w = got.shape[:2]
    assert h > H * 1.1 and w > W                  # a frame around it and bars above and below
    # the frame: the top and bottom rows are one bar colour each, the side columns only frame colours
    assert len(np.unique(got[0].reshape(-1, 3), axis=0)) <= 2 and len(np.unique(got[-1], axis=0)) <= 2
    assert len(np.unique(np.concatenate([got[:, 0], got[:, -1]]), axis=0)) <= 4
    # the photo inside, at 80-100% of its size (the original has nothing under 60; the frame is darker)
    y0, y1, x0, x1 = _photo_box(got)
    ph, pw = y1 - y0, x1 - x0
    assert 0.78 * H <= ph <= H and 0.78 * W <= pw <= W
    assert y0 > 0.05 * H and h - y1 > 0.05 * H and x0 > 0 and w - x1 > 0
    want = np.asarray(Image.open(original).convert("RGB").resize((pw, ph), Image.Resampling.BICUBIC), np.float32)
    assert np.abs(got[y0:y1, x0:x1] - want).mean() < 6


def test_copies_are_the_same_for_one_seed_and_differ_for_another(original, copies, tmp_path):
    by_kind, _ = copies
    again = plant_copies([original], tmp_path / "again", copies_each=len(EDITS), seed=0)
    for path in again:
        assert np.array_equal(_px(path), _px(by_kind[edit_kind(path)])), edit_kind(path)
    other = {edit_kind(p): p for p in plant_copies([original], tmp_path / "other", copies_each=len(EDITS),
                                                   seed=1)}
    for kind in ("jpeg40", "half"):               # nothing random in these
        assert np.array_equal(_px(other[kind]), _px(by_kind[kind]))
    differ = [k for k in EDITS if _px(other[k]).shape != _px(by_kind[k]).shape
              or not np.array_equal(_px(other[k]), _px(by_kind[k]))]
    assert {"colour", "border"} <= set(differ)    # continuous draws: never the same twice


def test_copies_rotate_through_the_edits_asked_for(original, tmp_path):
    second = tmp_path / "second.jpg"
    second.write_bytes(original.read_bytes())
    planted = plant_copies([original, second], tmp_path / "c", copies_each=1, seed=0, edits=("half", "border"))
    assert {Path(p).name: Path(src).name for p, src in planted.items()} == {
        "house__half.png": "house.jpg", "second__border.png": "second.jpg"}
    with pytest.raises(ValueError, match="copies_each"):
        plant_copies([original], tmp_path / "d", copies_each=len(EDITS) + 1)
    with pytest.raises(ValueError, match="unknown edits"):
        plant_copies([original], tmp_path / "d", edits=("half", "sepia"))
    with pytest.raises(ValueError, match="unknown edit"):
        edit(Image.open(original).convert("RGB"), "sepia", np.random.default_rng(0))


def test_scores_count_pairs_overall_and_per_edit():
    planted = {"c/a__half.png": "a.jpg", "c/a__caption.png": "a.jpg", "c/b__half.png": "b.jpg",
               "c/b__caption.png": "b.jpg"}
    groups = [["a.jpg", "c/a__half.png", "c/a__caption.png"], ["b.jpg", "c/b__half.png"], ["x.jpg", "y.jpg"]]
    s = pair_scores(groups, planted)
    assert (s["true_pairs"], s["found_pairs"], s["correct_pairs"]) == (6, 5, 4)
    per = edit_recall(groups, planted)
    assert list(per) == ["half", "caption"]       # EDITS order
    assert per["half"] == {"pairs": 2, "found": 2, "recall": 1.0}
    assert per["caption"] == {"pairs": 2, "found": 1, "recall": 0.5}
    with pytest.raises(ValueError, match="planted copy"):
        edit_kind("c/a__sepia.png")
