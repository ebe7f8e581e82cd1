"""Safe image loading: mode conversions, the header check's skip reasons, load_table's report, and bytes in memory
(uploads, tar members) through the same error ladder as files."""
import io

import cv2
import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from clip_mini.config import DataConfig
from clip_mini.data.dataset import load_table
from clip_mini.data.images import ImageError, check_images, load_image
from clip_mini.data.readers import DataError


def _noise_jpeg(path, size=(64, 48)):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=95)


# --- conversions ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, value, expected", [
    ("L", 77, (77, 77, 77)),
    ("1", 1, (255, 255, 255)),
    ("RGB", (1, 2, 3), (1, 2, 3)),
    ("RGBA", (255, 0, 0, 0), (255, 255, 255)),        # fully transparent -> white background
    ("RGBA", (255, 0, 0, 255), (255, 0, 0)),
    ("RGBA", (0, 0, 0, 128), (127, 127, 127)),         # half black over white
    ("LA", (0, 0), (255, 255, 255)),
])
def test_modes_become_rgb_uint8(tmp_path, mode, value, expected):
    p = tmp_path / "x.png"
    Image.new(mode, (5, 4), value).save(p)
    arr = load_image(p)
    assert arr.shape == (4, 5, 3) and arr.dtype == np.uint8
    assert np.abs(arr.astype(int) - expected).max() <= 1


def test_palette_with_transparency_composites_on_white(tmp_path):
    im = Image.new("P", (4, 4), 0)
    im.putpalette([10, 20, 30, 200, 0, 0] + [0] * 762)
    im.putpixel((0, 0), 1)
    im.save(tmp_path / "p.png", transparency=0)
    arr = load_image(tmp_path / "p.png")
    assert tuple(arr[0, 0]) == (200, 0, 0) and tuple(arr[1, 1]) == (255, 255, 255)
    im.save(tmp_path / "q.png")   # same palette, no transparency
    assert tuple(load_image(tmp_path / "q.png")[1, 1]) == (10, 20, 30)


def test_cmyk_jpeg(tmp_path):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=100)
    r, g, b = load_image(tmp_path / "c.jpg")[4, 4].astype(int)
    assert r > 230 and g < 25 and b < 25


def test_16bit_grayscale_and_rgb_are_scaled_not_clipped(tmp_path):
    gray = np.array([[0, 32896, 65535]], dtype=np.uint16)
    Image.fromarray(gray).save(tmp_path / "g16.png")
    assert load_image(tmp_path / "g16.png")[0, :, 0].tolist() == [0, 128, 255]
    rgb = np.zeros((2, 2, 3), np.uint16)
    rgb[..., 2] = 65535   # cv2 writes BGR: this is red
    rgb[..., 1] = 32896
    cv2.imwrite(str(tmp_path / "c16.png"), rgb)
    assert load_image(tmp_path / "c16.png")[0, 0].tolist() == [255, 128, 0]


def test_exif_rotation_is_applied(tmp_path):
    arr = np.zeros((10, 20, 3), np.uint8)
    arr[:, :10] = (255, 0, 0)   # stored left half red
    arr[:, 10:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6            # "rotate 90 CW to display": stored left becomes displayed top
    Image.fromarray(arr).save(tmp_path / "r.jpg", exif=exif, quality=100)
    out = load_image(tmp_path / "r.jpg")
    assert out.shape == (20, 10, 3)
    assert out[2, 5, 0] > 200 and out[17, 5, 2] > 200


@pytest.mark.parametrize("arr, expected", [
    (np.full((3, 4), 9, np.uint8), (9, 9, 9)),
    (np.full((3, 4, 1), 9, np.uint8), (9, 9, 9)),
    (np.full((3, 4, 3), 0.5, np.float32), (128, 128, 128)),
    (np.concatenate([np.zeros((3, 4, 3)), np.zeros((3, 4, 1))], axis=2).astype(np.uint8), (255, 255, 255)),
])
def test_arrays_and_pil_inputs(arr, expected):
    out = load_image(arr)
    assert out.shape == (3, 4, 3) and out.dtype == np.uint8 and tuple(out[0, 0]) == expected
    assert np.array_equal(load_image(Image.new("L", (4, 3), 9)), np.full((3, 4, 3), 9, np.uint8))


@pytest.mark.parametrize("bad", [np.zeros((3, 4, 2), np.uint8), np.zeros((2, 3, 4, 3)), np.full((2, 2), np.nan)])
def test_bad_arrays_raise(bad):
    with pytest.raises(ImageError, match="<array>"):
        load_image(bad)


# --- header check and read-time errors --------------------------------------------------------------------

@pytest.fixture()
def bad_files(tmp_path):
    """A folder with one good image and one of each bad kind; returns (folder, {name: reason fragment})."""
    d = tmp_path / "images"
    d.mkdir()
    _noise_jpeg(d / "good.jpg")
    Image.new("RGB", (8, 8)).save(d / "good.png")
    (d / "empty.jpg").write_bytes(b"")
    (d / "text.jpg").write_text("<html>404 not found</html>")
    Image.new("RGB", (8, 8)).save(d / "png_named.jpg", format="PNG")
    _noise_jpeg(d / "trunc.jpg")
    (d / "trunc.jpg").write_bytes((d / "trunc.jpg").read_bytes()[:1500])
    _noise_jpeg(d / "trunc.png")
    Image.fromarray(np.asarray(Image.open(d / "trunc.png"))).save(d / "trunc.png")
    (d / "trunc.png").write_bytes((d / "trunc.png").read_bytes()[:-30])
    Image.new("1", (9000, 9000)).save(d / "bomb.png")   # 81 MP, a few KB on disk
    Image.new("RGB", (8, 8)).save(d / "Upper.PNG")
    expected = {"empty.jpg": "empty file", "text.jpg": "not an image", "png_named.jpg": "wrongly named",
                "trunc.jpg": "truncated", "trunc.png": "truncated", "bomb.png": "exceeds the limit",
                "missing.jpg": "missing file", "upper.png": "a file named 'Upper.PNG' exists"}
    return d, expected


def test_check_images_reports_each_bad_kind(bad_files):
    d, expected = bad_files
    bad = check_images([d / n for n in ["good.jpg", "good.png", "Upper.PNG", *expected]])
    assert {p.split("/")[-1]: r for p, r in bad.items()}.keys() == expected.keys()
    for name, fragment in expected.items():
        assert fragment in bad[str(d / name)], (name, bad[str(d / name)])


def test_load_image_errors_name_path_and_reason(bad_files):
    d, _ = bad_files
    for name, fragment in [("missing.jpg", "missing"), ("empty.jpg", "empty"), ("text.jpg", "not an image"),
                           ("trunc.jpg", "cannot decode"), ("bomb.png", "exceeds the limit")]:
        with pytest.raises(ImageError) as e:
            load_image(d / name)
        assert e.value.path == str(d / name) and fragment in e.value.reason
    with pytest.raises(ImageError, match="exceeds the limit of 100"):
        load_image(d / "good.jpg", max_pixels=100)


def test_load_table_skips_and_reports(bad_files, tmp_path, capsys):
    d, expected = bad_files
    names = ["good.jpg", "good.png", *expected]
    rows = [(n, f"caption of {n}") for n in names] + [("good.png", "second"), ("good.jpg", "")]
    pd.DataFrame(rows, columns=["image", "caption"]).to_csv(tmp_path / "captions.csv", index=False)
    df = load_table(DataConfig(captions=str(tmp_path / "captions.csv")), report_dir=tmp_path / "run")
    assert df["image"].tolist() == ["good.jpg", "good.png", "good.png"]
    assert df["image_id"].tolist() == [0, 1, 1]
    out = capsys.readouterr().out
    assert f"2 images, 3 captions" in out and f"skipped {len(expected)} bad images" in out
    assert "1 empty captions" in out
    report = pd.read_csv(tmp_path / "run" / "skipped.csv")
    assert list(report.columns) == ["path", "reason"] and len(report) == len(expected) + 1
    assert report["path"].iloc[-1].endswith("captions.csv:row 12")


def test_load_table_without_usable_images(tmp_path):
    (tmp_path / "captions.csv").write_text("image,caption\nnope.jpg,x\n")
    with pytest.raises(DataError, match="none of its 1 images is usable.*missing file"):
        load_table(DataConfig(captions=str(tmp_path / "captions.csv")))


def test_load_table_writes_no_report_when_clean(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "captions.csv").write_text("image,caption\na.png,x\n")
    load_table(DataConfig(captions=str(tmp_path / "captions.csv")), report_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "skipped.csv").exists()


def test_only_the_image_formats_we_claim_are_decoded(tmp_path):
    # Pillow would otherwise try all of its ~40 decoders on any file (EPS among them, which runs Ghostscript):
    # a TGA under a .png name decoded before; now it is refused like any other non-image.
    Image.new("RGB", (8, 8), (1, 2, 3)).save(tmp_path / "tga.png", format="TGA")
    with pytest.raises(ImageError, match="not an image .*format other than") as e:
        load_image(tmp_path / "tga.png")
    assert e.value.path == str(tmp_path / "tga.png")
    assert "not an image" in check_images([tmp_path / "tga.png"])[str(tmp_path / "tga.png")]


def test_header_longer_than_the_probe_is_read_whole(tmp_path):
    # A 200 KB ICC profile puts the JPEG's frame header past the first 64 KB the header check reads.
    rng = np.random.default_rng(0)
    path = tmp_path / "big_header.jpg"
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(
        path, quality=90, icc_profile=rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    assert check_images([path]) == {}
    assert load_image(path).shape == (16, 16, 3)


def test_nul_byte_and_directory_paths_raise_image_error(tmp_path):
    with pytest.raises(ImageError, match="NUL byte"):
        load_image(str(tmp_path / "a\0b.png"))
    with pytest.raises(ImageError, match="not a regular file but a directory"):
        load_image(tmp_path)
    assert "NUL byte" in check_images([str(tmp_path / "a\0b.png")])[str(tmp_path / "a\0b.png")]


def _camera_jpeg(path, size=(2000, 1500), orientation=None):
    # photo-like content: smooth low-frequency structure plus fine grain, as a camera JPEG has
    rng = np.random.default_rng(0)
    low = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
    arr = np.clip(np.asarray(low, np.int16) + rng.integers(-6, 7, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    kw = {}
    if orientation:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif
    Image.fromarray(arr).save(path, quality=90, **kw)
    return path


def test_large_jpeg_decodes_at_reduced_scale_never_below_the_size_asked(tmp_path):
    path = _camera_jpeg(tmp_path / "cam.jpg")
    assert load_image(path).shape == (1500, 2000, 3)
    assert load_image(path, min_size=288).shape == (375, 500, 3)      # 1/4: both sides stay >= 288
    assert min(load_image(path, min_size=700).shape[:2]) >= 700       # 1/2 only
    assert load_image(path, min_size=1000).shape == (1500, 2000, 3)   # no smaller scale keeps 1000
    # EXIF rotation still applies after the reduced decode (a portrait phone photo)
    rotated = _camera_jpeg(tmp_path / "rot.jpg", orientation=6)
    assert load_image(rotated, min_size=288).shape == (500, 375, 3)
    # the decompression-bomb limit reads the file's own size, not the reduced one
    with pytest.raises(ImageError, match="exceeds the limit"):
        load_image(path, max_pixels=2_000_000, min_size=288)
    png = tmp_path / "cam.png"
    Image.open(path).save(png)
    assert load_image(png, min_size=288).shape == (1500, 2000, 3)   # only JPEG has a reduced-scale decode


def test_reduced_decode_gives_nearly_the_same_model_input(tmp_path):
    from clip_mini.config import PreprocessConfig
    from clip_mini.data import build_eval_transform

    path = _camera_jpeg(tmp_path / "cam.jpg")
    for mode in ("squash", "center_crop"):
        tf = build_eval_transform(PreprocessConfig(image_size=224, resize_mode=mode))
        full, reduced = tf(load_image(path)), tf(load_image(path, min_size=224))
        assert full.shape == reduced.shape == (3, 224, 224)
        diff = (full - reduced).abs()   # normalised units (a pixel step is about 0.016)
        assert diff.mean() < 0.02 and float(torch.nn.functional.cosine_similarity(
            full.flatten(), reduced.flatten(), dim=0)) > 0.999, (mode, float(diff.mean()))


def test_every_embedding_pass_asks_for_the_reduced_decode(tmp_path, monkeypatch):
    """ImageDataset (index, eval), the transform itself, the image cache and encode_image all pass the model's
    resize size, so a photo's pixels agree across them."""
    from clip_mini.config import PreprocessConfig
    from clip_mini.data import ImageDataset, build_eval_transform
    from clip_mini.data import cache as cache_mod
    from clip_mini.data.cache import ImageCache

    path = str(_camera_jpeg(tmp_path / "cam.jpg"))
    tf = build_eval_transform(PreprocessConfig(image_size=96))
    direct = tf(load_image(path, min_size=96))
    ds_pixels = ImageDataset([path], tf)[0][0]
    torch.testing.assert_close(ds_pixels, direct)
    torch.testing.assert_close(tf(path), direct)   # the transform decoding a path itself
    cached = ImageCache(tmp_path / "cache", size=96, mode="squash")
    torch.testing.assert_close(tf(cached.get(path, tf.base)), direct, atol=1e-6, rtol=0)
    seen = []
    real = cache_mod.load_image
    monkeypatch.setattr(cache_mod, "load_image", lambda *a, **k: seen.append(k.get("min_size")) or real(*a, **k))
    cache_mod.decode_resized(path, 96, "squash")
    assert seen == [96]


# --- bytes in memory (uploads to the query encoder, WebDataset tar members): the same ladder as files ---------

def _png_bytes(size=(32, 24)):
    buf = io.BytesIO()
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_bytes_errors_name_the_source_like_files(tmp_path, monkeypatch):
    from clip_mini.data.images import load_image_bytes
    from clip_mini.data.webdataset import decode_image

    good = _png_bytes()
    assert np.array_equal(load_image_bytes(good, "mem"), load_image(Image.open(io.BytesIO(good))))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)   # Pillow's own bomb limit: 2x this refuses at open
    cases = [(b"", "empty"), (good[:-30], "cannot decode"), (b"not an image at all", "not an image"),
             (_png_bytes((50, 50)), "too many pixels")]
    for data, fragment in cases:
        for decode, name in [(load_image_bytes, "upload #3"), (decode_image, "a.tar:key7")]:
            with pytest.raises(ImageError) as e:
                decode(data, name)
            assert e.value.path == name and fragment in e.value.reason, (decode.__name__, fragment, e.value)
    monkeypatch.undo()
    big = _png_bytes((40, 40))   # clip_mini's own pixel limit, read from the header
    with pytest.raises(ImageError, match="exceeds the limit of 100") as e:
        load_image_bytes(big, "upload #4", max_pixels=100)
    assert e.value.path == "upload #4"
    # the same reason for the same damage, from a file and from its bytes
    (tmp_path / "t.png").write_bytes(good[:-30])
    with pytest.raises(ImageError) as from_file:
        load_image(tmp_path / "t.png")
    with pytest.raises(ImageError) as from_bytes:
        load_image_bytes(good[:-30], "t")
    assert from_file.value.reason == from_bytes.value.reason


def test_bytes_decode_equals_the_file_decode_reduced_jpeg_included(tmp_path):
    from clip_mini.data.images import load_image_bytes

    path = _camera_jpeg(tmp_path / "cam.jpg")
    data = path.read_bytes()
    for min_size in (None, 288):
        assert np.array_equal(load_image_bytes(data, "cam", min_size=min_size), load_image(path, min_size=min_size))
    assert load_image_bytes(data, "cam", min_size=288).shape == (375, 500, 3)


def test_query_encoder_routes_bytes_through_the_ladder(monkeypatch):
    """ImageQueryEncoder decodes bytes with load_image_bytes (the model's size for the reduced decode) and its error
    names the item."""
    from clip_mini.data import images
    from clip_mini.errors import QueryEncoderError
    from clip_mini.retrieval.query import ImageQueryEncoder

    calls = []
    real = images.load_image_bytes
    monkeypatch.setattr(images, "load_image_bytes", lambda *a, **k: calls.append(k) or real(*a, **k))
    enc = ImageQueryEncoder(session=None, preprocess={"image_size": 16, "mean": [0.5] * 3, "std": [0.5] * 3}, fingerprint="x")
    with pytest.raises(QueryEncoderError, match=r"image 1: <bytes>: cannot decode"):
        enc.encode_image([_png_bytes(), _png_bytes()[:-30]])
    assert calls == [{"min_size": 16}, {"min_size": 16}]
