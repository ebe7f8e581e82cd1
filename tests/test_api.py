"""The Python API as open_clip / sentence-transformers users expect it: one item or a list, per-call batch size,
normalisation, output type, progress and error policy; every error class importable from ``clip_mini``."""
import re

import numpy as np
import pytest
import torch
from PIL import Image

import clip_mini
from clip_mini.model.clip import CLIPModel
from conftest import tiny_model_config

CAPTIONS = ["a red circle", "a blue square at the top left", "two green triangles", "a yellow star"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("m") / "model"
    CLIPModel.build(tiny_model_config(embed_dim=16), captions=CAPTIONS * 4).save_pretrained(out)
    return clip_mini.load(out, device="cpu", batch_size=3)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("img")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(7):
        p = root / f"im{i}.png"
        Image.fromarray(rng.integers(0, 255, (30 + 5 * i, 41, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    return paths


def test_single_items_give_one_row_equal_to_the_list_form(embedder, images):
    one = embedder.encode_text("a red circle")
    assert one.shape == (16,)
    np.testing.assert_allclose(one, embedder.encode_text(["a red circle"])[0], atol=1e-6)
    img = embedder.encode_image(images[2])
    assert img.shape == (16,)
    np.testing.assert_allclose(img, embedder.encode_image([images[2]])[0], atol=1e-6)
    pil = embedder.encode_image(Image.open(images[2]))
    np.testing.assert_allclose(pil, img, atol=1e-6)


def test_batch_size_normalize_and_torch_output(embedder, images):
    base = embedder.encode_text(CAPTIONS)
    np.testing.assert_allclose(embedder.encode_text(CAPTIONS, batch_size=1), base, atol=1e-5)
    raw = embedder.encode_text(CAPTIONS, normalize=False)
    norms = np.linalg.norm(raw, axis=1)
    assert not np.allclose(norms, 1.0, atol=1e-3)            # really not normalised
    np.testing.assert_allclose(raw / norms[:, None], base, atol=1e-5)
    t = embedder.encode_image(images, output="torch", batch_size=2)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (7, 16)
    np.testing.assert_allclose(t.cpu().numpy(), embedder.encode_image(images), atol=1e-6)


def test_threaded_decoding_equals_serial_and_keeps_order(embedder, images):
    serial = embedder.encode_image(images, workers=0, batch_size=2)
    threaded = embedder.encode_image(images, workers=3, batch_size=2)
    np.testing.assert_array_equal(serial, threaded)
    np.testing.assert_allclose(serial[4], embedder.encode_image(images[4]), atol=1e-6)


def test_on_error_skip_reports_failed_inputs_and_keeps_the_rest(embedder, images, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    mixed = [images[0], str(broken), images[1], str(tmp_path / "missing.png"), images[2]]
    feats, failed = embedder.encode_image(mixed, on_error="skip", batch_size=2)
    assert sorted(failed) == [1, 3]
    assert "broken.jpg" in failed[1] and "missing" in failed[3]
    np.testing.assert_allclose(feats, embedder.encode_image([images[0], images[1], images[2]]), atol=1e-6)
    with pytest.raises(clip_mini.InputError, match=r"image 1: .*broken\.jpg"):
        embedder.encode_image(mixed)
    texts, bad = embedder.encode_text(["a red circle", "  ", 7, "a yellow star"], on_error="skip")
    assert sorted(bad) == [1, 2] and texts.shape == (2, 16)
    np.testing.assert_allclose(texts, embedder.encode_text(["a red circle", "a yellow star"]), atol=1e-6)
    none, why = embedder.encode_image(str(broken), on_error="skip")
    assert none is None and list(why) == [0]


@pytest.mark.parametrize("call, match", [
    (lambda e: e.encode_text(CAPTIONS, output="list"), "output must be"),
    (lambda e: e.encode_text(CAPTIONS, on_error="ignore"), "on_error must be"),
    (lambda e: e.encode_text(CAPTIONS, batch_size=0), "batch_size must be a positive integer"),
    (lambda e: e.encode_image(np.zeros((2, 8, 8, 3), np.uint8)), "4-D array"),
])
def test_bad_options_are_named(embedder, call, match):
    with pytest.raises(clip_mini.InputError, match=match):
        call(embedder)


def test_show_progress_draws_a_bar(embedder, images, capsys):
    embedder.encode_image(images, show_progress=True)
    embedder.encode_text(CAPTIONS, show_progress=True)
    err = capsys.readouterr().err
    assert "embedding images" in err and "7/7" in err and "embedding captions" in err


def test_repr_names_the_model_and_device(embedder):
    r = repr(embedder)
    assert re.search(r"Embedder\('.*model', dim=16, image=vit 32px, .*device='cpu'", r), r
    assert embedder.fingerprint in r


def test_every_readme_error_class_is_importable_and_shares_the_base():
    for name in ["InputError", "ModelDirError", "EmbeddingIndexError", "ConfigError", "DataError", "ImageError",
                 "OutputError", "EvalError", "TokenizerError", "WeightsError", "DeviceError"]:
        cls = getattr(clip_mini, name)
        assert issubclass(cls, clip_mini.ClipMiniError), name
    assert issubclass(clip_mini.OutputError, OSError) and issubclass(clip_mini.ConfigError, ValueError)
    with pytest.raises(AttributeError):
        clip_mini.NoSuchError


def test_load_errors_share_the_base(tmp_path):
    with pytest.raises(clip_mini.ClipMiniError):
        clip_mini.load(tmp_path / "nowhere")


def test_device_resolution():
    from clip_mini.runtime.devices import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    with pytest.raises(clip_mini.DeviceError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    with pytest.raises(clip_mini.DeviceError, match="unknown device"):
        resolve_device("cpu:1")
    if not torch.cuda.is_available():
        with pytest.raises(clip_mini.DeviceError, match="CUDA is not available"):
            resolve_device("cuda:0")
    else:
        with pytest.raises(clip_mini.DeviceError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
