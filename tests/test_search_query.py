"""Queries through onnxruntime (clip_mini.retrieval.query) match the torch model; a broken ONNX copy is refused.

The ONNX graphs are checked on the same inputs as torch (1e-4), the whole query path (tokenizer or Pillow + numpy
preprocessing, then ONNX) against ``clip_mini.load``; the numpy eval transform against the albumentations one.
"""
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import clip_mini
from clip_mini.model.onnx_export import INDEX, ONNX_DIR, OnnxError, ensure_onnx
from clip_mini.retrieval.query import ImageQueryEncoder, QueryEncoderError, TextQueryEncoder

from conftest import FLICKR8K, TINY, make_model_dir

ROOT = Path(__file__).resolve().parents[1]
CAPTIONS = ["a red circle", "A Small BLUE square at the top left, next to a green star!",
            "unknownword zzz qqq", "a " + "very " * 40 + "long caption that is truncated"]


@pytest.fixture(scope="module", params=["mlp", "linear"])
def exported(tmp_path_factory, request) -> Path:
    model_dir = make_model_dir(tmp_path_factory.mktemp("onnx") / "m", seed=3, head=request.param)
    ensure_onnx(model_dir, "text")
    return model_dir


def test_image_graph_of_a_partly_locked_cls_mean_vit_matches_torch(tmp_path):
    """The tower of configs/flickr8k-vit.yaml, in small: a locked block prefix, trainable blocks that drop patch
    tokens in training, [CLS ; patch mean] read-out. The graph is the eval forward: every token kept."""
    import torch

    from clip_mini.model.clip import CLIPModel

    vision = {**TINY["vision"], "pooling": "cls_mean", "trainable_blocks": 1, "patch_drop": 0.5}
    model_dir = make_model_dir(tmp_path / "m", seed=4, vision=vision)
    model = CLIPModel.from_pretrained(model_dir).eval()
    pixels = torch.randn(3, 3, model.preprocess.image_size, model.preprocess.image_size)
    with torch.no_grad():
        ref = model.encode_image(pixels).numpy()
        model.train()
        dropped = model.encode_image(pixels).numpy()   # the same weights, tokens dropped: the graph must not be this
    got = ImageQueryEncoder.load(model_dir).session.run(None, {"pixels": pixels.numpy()})[0]
    np.testing.assert_allclose(got, ref, atol=1e-4)
    assert np.abs(got - dropped).max() > 1e-3


def _images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(24, 24), (100, 300), (300, 100), (32, 32), (7, 90)]
    return [rng.integers(0, 256, shapes[i % len(shapes)] + (3,), dtype=np.uint8) for i in range(n)]


def test_onnx_graphs_match_torch(exported):
    import torch

    from clip_mini.model.clip import CLIPModel

    model = CLIPModel.from_pretrained(exported)
    text = TextQueryEncoder.load(exported)
    tokens = model.tokenize(CAPTIONS)   # padded batch: the graph must honour the attention mask
    with torch.no_grad():
        ref = model.encode_text(tokens["input_ids"], tokens["attention_mask"]).numpy()
    got = text.session.run(None, {"input_ids": tokens["input_ids"].numpy(),
                                  "attention_mask": tokens["attention_mask"].numpy()})[0]
    np.testing.assert_allclose(got, ref, atol=1e-4)
    np.testing.assert_allclose(text.encode_text(CAPTIONS), ref, atol=1e-4)   # tokenizers + padding path
    pixels = torch.randn(3, 3, model.preprocess.image_size, model.preprocess.image_size)
    with torch.no_grad():
        ref = model.encode_image(pixels).numpy()
    image = ImageQueryEncoder.load(exported)
    np.testing.assert_allclose(image.session.run(None, {"pixels": pixels.numpy()})[0], ref, atol=1e-4)


def test_query_path_matches_clip_mini_load(exported):
    embedder = clip_mini.load(exported, precision="fp32")   # the ONNX query path computes in fp32 on every CPU
    encoder = ImageQueryEncoder.load(exported)
    rng = np.random.default_rng(0)
    shrinking = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((100, 300), (300, 100))]
    # Area averaging (both sides shrink, the usual photo) is reproduced (OpenCV rounds exact halves in float32).
    np.testing.assert_allclose(encoder.encode_image(shrinking), embedder.encode_image(shrinking), atol=1e-4)
    # Growing sides go through OpenCV's fixed-point bilinear: a grey level here and there, on random pixels.
    np.testing.assert_allclose(encoder.encode_image(_images(5)), embedder.encode_image(_images(5)), atol=3e-3)
    for c in CAPTIONS:   # one at a time too (no padding)
        np.testing.assert_allclose(TextQueryEncoder.load(exported).encode_text([c]), embedder.encode_text([c]),
                                   atol=1e-4)


def test_tokenizer_matches_model_tokenizer(exported):
    from clip_mini.model.clip import CLIPModel

    model = CLIPModel.from_pretrained(exported)
    fast = TextQueryEncoder.load(exported)
    for c in CAPTIONS:
        assert fast.tokenizer.encode(c).ids == model.tokenize([c])["input_ids"][0].tolist()


@pytest.mark.parametrize("mode", ["squash", "center_crop"])
@pytest.mark.parametrize("size", [32, 224])
def test_numpy_preprocessing_equals_eval_transform(mode, size):
    from clip_mini.config import PreprocessConfig
    from clip_mini.data import build_eval_transform
    from clip_mini.retrieval.preprocess_np import eval_pixels

    pre = PreprocessConfig(image_size=size, resize_mode=mode, mean=(0.48, 0.46, 0.41), std=(0.27, 0.26, 0.28))
    transform = build_eval_transform(pre)
    rng = np.random.default_rng(1)
    smooth = np.clip(np.cumsum(rng.integers(-3, 4, (375, 500, 3)), axis=1) + 128, 0, 255).astype(np.uint8)
    for image in _images(5, seed=2) + [smooth, smooth[:160, :160], smooth[:, :90]]:
        ref = transform(image).numpy()
        got = eval_pixels(image, dataclasses.asdict(pre))
        assert got.shape == ref.shape == (3, size, size)
        # OpenCV's bilinear works in 11-bit fixed point: at most one grey level apart, on a few pixels.
        grey = np.abs(got - ref) * np.asarray(pre.std)[:, None, None] * 255
        assert grey.max() <= 1 + 1e-3 and (grey > 0.5).mean() < 0.03, (image.shape, grey.max(), (grey > 0.5).mean())
    shrink = smooth[:300, :450]   # area averaging (every axis shrinks) is reproduced exactly
    if mode == "squash" and size == 224:
        np.testing.assert_allclose(eval_pixels(shrink, dataclasses.asdict(pre)), transform(shrink).numpy(), atol=1e-5)


@pytest.mark.parametrize("area", [True, False])
def test_resize_window_is_the_full_resize_sliced(area):
    from clip_mini.retrieval.preprocess_np import resize_uint8

    rng = np.random.default_rng(7)
    for h, w, height, width in [(90, 40, 30, 20), (37, 300, 20, 160), (5, 50, 60, 10), (64, 64, 64, 64)]:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        full = resize_uint8(image, height, width, area)
        for top, left, ch, cw in [(0, 0, height, width), (3, 2, 7, 5), (height - 4, width - 3, 4, 3)]:
            got = resize_uint8(image, height, width, area, crop=(top, left, ch, cw))
            np.testing.assert_array_equal(got, full[top:top + ch, left:left + cw])


@pytest.mark.parametrize("shape,mode", [((20_000, 1, 3), "squash"), ((1, 20_000, 3), "squash"),
                                        ((1, 100, 3), "center_crop"), ((3000, 2, 3), "center_crop"),
                                        ((1500, 1000, 3), "squash")])
def test_thin_images_preprocess_in_memory_the_size_of_the_output(shape, mode):
    """A 1 x 1,000,000 upload took 5.6 GB here: the bilinear pass made (H, 224, 3) int64 temporaries, area
    averaging a dense (224, H) matrix, and a centre crop resized the whole 224 x 224,000,000 strip first."""
    import tracemalloc

    from clip_mini.retrieval.preprocess_np import eval_pixels

    image = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    tracemalloc.start()
    try:
        out = eval_pixels(image, dict(image_size=224, resize_mode=mode, mean=(0.5,) * 3, std=(0.5,) * 3))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (3, 224, 224)
    # a few float64 arrays of the output's size (1.2 MB each); the old kernels peaked at 300 to 460 MB on the thin ones
    assert peak < (16 << 20) + 2 * image.nbytes, peak


@pytest.mark.skipif(not (FLICKR8K / "images").is_dir(), reason="Flickr8k dev data not present")
def test_numpy_preprocessing_on_real_photos():
    from clip_mini.config import PreprocessConfig
    from clip_mini.data import build_eval_transform, load_image
    from clip_mini.retrieval.preprocess_np import eval_pixels

    pre = PreprocessConfig(image_size=224)
    transform = build_eval_transform(pre)
    for path in sorted((FLICKR8K / "images").glob("*.jpg"))[:10]:
        image = load_image(path)
        grey = np.abs(eval_pixels(image, dataclasses.asdict(pre)) - transform(image).numpy()) * 127.5
        assert grey.max() <= 1 + 1e-3 and (grey > 0.5).mean() < 0.01


def test_queries_do_not_import_torch(exported, tmp_path):
    image = tmp_path / "query.png"
    code = ("import sys; from pathlib import Path; from PIL import Image; import numpy as np; "
            "from clip_mini.retrieval.engine import QueryEngine; e = QueryEngine.load(sys.argv[1]); "
            "t = e.encode_text(['a red circle']); p = Path(sys.argv[2]); "
            "Image.fromarray(np.full((40, 30, 3), 200, np.uint8)).save(p); i = e.encode_image([p, p.read_bytes()]); "
            "heavy = ('torch', 'timm', 'albumentations', 'cv2'); "
            "print(t.shape, i.shape, sorted(m for m in heavy if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(exported), str(image)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    dim = clip_mini.load(exported).dim
    assert r.stdout.strip() == f"(1, {dim}) (2, {dim}) []"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_damaged_onnx_refused_naming_the_file(exported, tmp_path):
    model_dir = _copy(exported, tmp_path / "m")
    onnx = model_dir / ONNX_DIR / "text.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))
    with pytest.raises(OnnxError, match=r"text\.onnx is corrupt"):
        TextQueryEncoder.load(model_dir)
    ImageQueryEncoder.load(model_dir)   # the other tower is intact and still loads
    ensure_onnx(model_dir, "text", repair=True)   # an explicit repair re-exports
    TextQueryEncoder.load(model_dir)
    (model_dir / ONNX_DIR / "image.onnx").write_bytes(b"")   # truncated to nothing
    with pytest.raises(OnnxError, match=r"image\.onnx is corrupt"):
        ImageQueryEncoder.load(model_dir)


def test_onnx_of_another_model_refused(exported, other_model_dir, tmp_path):
    model_dir = _copy(exported, tmp_path / "m")
    shutil.rmtree(model_dir / ONNX_DIR)
    ensure_onnx(other_model_dir, "text")
    shutil.copytree(other_model_dir / ONNX_DIR, model_dir / ONNX_DIR)
    with pytest.raises(OnnxError, match=r"onnx\.json was exported from model"):
        TextQueryEncoder.load(model_dir)


def test_read_only_model_dir_exports_into_the_user_cache(exported, tmp_path, monkeypatch):
    from clip_mini.fileio.atomic import OutputError
    from clip_mini.model import onnx_export

    model_dir = _copy(exported, tmp_path / "m")
    shutil.rmtree(model_dir / ONNX_DIR)
    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(tmp_path / "cache"))
    real_atomic_dir = onnx_export.atomic_dir

    def read_only(path):   # what atomic_dir raises where the directory cannot be written (root ignores chmod)
        if Path(path).parent == model_dir:
            raise OutputError(f"cannot write {path}: Permission denied")
        return real_atomic_dir(path)

    monkeypatch.setattr(onnx_export, "atomic_dir", read_only)
    path = ensure_onnx(model_dir, "text")
    assert path.parent.parent == tmp_path / "cache" / "onnx" and not (model_dir / ONNX_DIR).exists()
    assert json.loads((path.parent / INDEX).read_text())["fingerprint"] == path.parent.name
    TextQueryEncoder.load(model_dir)   # found there next time


def test_corrupt_model_files_detected(exported, tmp_path):
    model_dir = _copy(exported, tmp_path / "m")
    tok = model_dir / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"[CLS]"', '"[CLX]"', 1))
    with pytest.raises(QueryEncoderError, match="tokenizer.json is corrupt"):
        TextQueryEncoder.load(model_dir)
    with pytest.raises(Exception, match="model directory not found"):
        TextQueryEncoder.load(tmp_path / "nope")


def test_bad_queries_rejected(exported):
    text = TextQueryEncoder.load(exported)
    for bad in ([], "a red circle", ["  "], [3]):
        with pytest.raises(QueryEncoderError):
            text.encode_text(bad)
    image = ImageQueryEncoder.load(exported)
    for bad in ([], [b"not an image"], [np.zeros((4, 4, 5), np.uint8)]):
        with pytest.raises(QueryEncoderError):
            image.encode_image(bad)


def test_unchanged_onnx_is_hashed_once_and_an_edit_is_still_caught(exported, tmp_path, monkeypatch):
    import os
    import time

    from clip_mini.fileio import checksums

    monkeypatch.setenv("CLIP_MINI_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = _copy(exported, tmp_path / "m")
    hashed = []
    real = checksums.sha256_file
    monkeypatch.setattr(checksums, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    TextQueryEncoder.load(model_dir)
    TextQueryEncoder.load(model_dir)
    assert hashed == ["text.onnx", "text.onnx.data"]   # the second load trusted the stamps of the unchanged files
    onnx = model_dir / ONNX_DIR / "text.onnx"
    st = onnx.stat()
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    time.sleep(0.01)
    onnx.write_bytes(bytes(data))                               # same size,
    os.utime(onnx, ns=(st.st_atime_ns, st.st_mtime_ns))         # mtime set back: only the ctime tells
    with pytest.raises(OnnxError, match=r"text\.onnx is corrupt"):
        TextQueryEncoder.load(model_dir)
    assert hashed == ["text.onnx", "text.onnx.data", "text.onnx"]
    weights = model_dir / ONNX_DIR / "text.onnx.data"   # the weights file is checked the same way
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))                               # the graph back as exported
    w = bytearray(weights.read_bytes())
    w[len(w) // 3] ^= 0x01
    weights.write_bytes(bytes(w))
    with pytest.raises(OnnxError, match=r"text\.onnx\.data is corrupt"):
        TextQueryEncoder.load(model_dir)
