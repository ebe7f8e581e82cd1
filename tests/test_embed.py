"""clip_mini.load(dir): embedding functions over a saved model directory."""
import numpy as np
import pytest
import torch
from PIL import Image

import clip_mini
from clip_mini.embed import InputError
from clip_mini.model.clip import CLIPModel
from conftest import tiny_model_config

CAPTIONS = ["a red circle", "a blue square at the top left", "two green triangles", "a yellow star"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("m") / "model"
    CLIPModel.build(tiny_model_config(embed_dim=16), captions=CAPTIONS * 4).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("img")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(5):
        arr = rng.integers(0, 255, (40 + 7 * i, 50, 3), dtype=np.uint8)  # non-square, varied sizes
        p = root / f"im{i}.png"
        Image.fromarray(arr).save(p)
        paths.append(p)
    return paths


def test_encode_text_and_image_shapes_and_norms(model_dir, images):
    emb = clip_mini.load(model_dir, batch_size=2)
    t = emb.encode_text(CAPTIONS + ["a much longer caption " * 40])  # truncated, not an error
    assert t.shape == (5, 16) and t.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, atol=1e-5)
    i = emb.encode_image([str(p) for p in images])
    assert i.shape == (5, 16) and i.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(i, axis=1), 1.0, atol=1e-5)


def test_path_pil_and_array_inputs_agree_and_match_the_model(model_dir, images):
    emb = clip_mini.load(model_dir, precision="fp32")   # compared with the model's own fp32 pass below
    pil = Image.open(images[0])
    arr = np.asarray(pil.convert("RGB"))
    a, b, c = emb.encode_image([images[0]]), emb.encode_image([pil]), emb.encode_image([arr])
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(a, c, atol=1e-6)
    # batching does not change results
    single = np.concatenate([emb.encode_text([c]) for c in CAPTIONS])
    np.testing.assert_allclose(single, emb.encode_text(CAPTIONS), atol=1e-5)
    # same numbers as the model itself with the saved preprocessing
    model = CLIPModel.from_pretrained(model_dir)
    with torch.no_grad():
        direct = model.encode_image(emb.transform(arr)[None]).numpy()
    np.testing.assert_allclose(a, direct, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    ([], "empty"),
    (3, "string or a list"),
    (["ok", 3], "caption 1"),
    (["ok", "   "], "caption 1 is empty"),
])
def test_bad_text_inputs_are_named(model_dir, bad, match):
    with pytest.raises(InputError, match=match):
        clip_mini.load(model_dir).encode_text(bad)


def test_bad_image_inputs_are_named(model_dir, images, tmp_path):
    emb = clip_mini.load(model_dir)
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(InputError, match="image 1.*broken.jpg"):
        emb.encode_image([images[0], tmp_path / "broken.jpg"])
    with pytest.raises(InputError, match="image 0.*missing.png"):
        emb.encode_image([tmp_path / "missing.png"])
    with pytest.raises(InputError, match="empty"):
        emb.encode_image([])
    with pytest.raises(InputError):
        emb.encode_image([12345])


def test_text_embedding_never_imports_the_image_pipeline(model_dir, images):
    # albumentations takes seconds to import; a text-only user (and the text half of search) must not pay for it
    import subprocess
    import sys

    code = ("import sys, clip_mini; e = clip_mini.load(sys.argv[1]); e.encode_text(['a red circle']); "
            "print('albumentations' in sys.modules); e.encode_image([sys.argv[2]]); "
            "print('albumentations' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(model_dir), str(images[0])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_bf16_autocast_still_gives_float32_unit_rows(model_dir, images):
    """Rows are normalised in fp32 whatever the caller's autocast (bf16 normalisation left them ~6e-4 off)."""
    emb = clip_mini.load(model_dir, batch_size=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [emb.encode_text(CAPTIONS), emb.encode_image(images),
                emb.encode_pixels(torch.randn(3, 3, 32, 32))]
    for out in outs:
        assert out.dtype == np.float32
        assert np.abs(np.linalg.norm(out.astype(np.float64), axis=1) - 1).max() < 1e-6
