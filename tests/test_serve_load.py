"""Image queries under load (functional, not timed; the timings are in benchmarks/bench_serve.py's mixed arm): the
bounded image pool answers 503 with Retry-After when full while text search keeps answering, and uploads are
decoded at reduced scale."""
from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="clip-mini serve needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (test extra)")

from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from conftest import write_images  # noqa: E402


@pytest.fixture(scope="module")
def load_index(model_dir, tmp_path_factory) -> Path:
    from clip_mini.retrieval.index import EmbeddingIndex

    tmp = tmp_path_factory.mktemp("load")
    EmbeddingIndex.build(tmp / "index", model_dir, write_images(tmp / "photos", 8, seed=9), progress=False)
    return tmp / "index"


def _png(size, colour=(200, 30, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_fifth_upload_gets_503_while_text_search_answers(load_index):
    from clip_mini.serve.app import ServeConfig, create_app

    app = create_app(ServeConfig(index=str(load_index), allowed_hosts=["testserver"], preload_attention=False))
    svc = app.state.service
    assert (svc.cfg.image_threads, svc.cfg.image_queue) == (1, 4)
    gate, started = threading.Event(), []
    encode = svc._encode_image

    def held(data, name, *rest):   # an image query that takes as long as the test wants
        started.append(name)
        gate.wait(120)
        return encode(data, name, *rest)

    svc._encode_image = held
    upload = {"file": ("q.png", _png((32, 32)), "image/png")}
    with TestClient(app) as c, ThreadPoolExecutor(4) as pool:
        uploads = [pool.submit(c.post, "/api/search/image", files=upload) for _ in range(4)]
        deadline = time.monotonic() + 60
        while svc.image_pool.admitted < 4:   # one decoding, three waiting for the image thread
            assert time.monotonic() < deadline and not any(f.done() for f in uploads), [f.result() for f in uploads]
            time.sleep(0.01)
        assert len(started) == 1
        fifth = c.post("/api/search/image", files=upload)
        assert fifth.status_code == 503, fifth.text
        assert int(fifth.headers["retry-after"]) >= 1 and "busy" in fifth.json()["error"]
        # text search does not wait behind the image queries
        text = c.get("/api/search", params={"q": "a red circle", "k": 3})
        assert text.status_code == 200 and len(text.json()["results"]) == 3
        info = c.get("/api/info").json()["backend"]
        assert info["image_queries_in_flight"] == 4 and info["image_queries_refused"] == 1
        assert not any(f.done() for f in uploads)
        gate.set()
        assert [f.result(timeout=120).status_code for f in uploads] == [200] * 4
        assert c.post("/api/search/image", files=upload).status_code == 200   # a slot is free again
        assert c.get("/api/info").json()["backend"]["image_queries_in_flight"] == 0


def test_a_6000_square_png_is_searched_reduced(load_index):
    """The upload of the issue (36 MP of one colour, ~120 KB): accepted, decoded, box-reduced before any array."""
    from clip_mini.serve.app import ServeConfig, create_app

    app = create_app(ServeConfig(index=str(load_index), allowed_hosts=["testserver"], preload_attention=False))
    seen = []
    encode = app.state.service.engine.encode_image
    app.state.service.engine.encode_image = lambda images: seen.extend(a.shape for a in images) or encode(images)
    with TestClient(app) as c:
        big = c.post("/api/search/image", files={"file": ("big.png", _png((6000, 6000)), "image/png")})
        assert big.status_code == 200, big.text
        size = app.state.service.image_size
        assert seen and all(2 * size <= min(s[:2]) < 4 * size for s in seen), (seen, size)
        over = c.post("/api/search/image", files={"file": ("big.png", _png((6001, 6000), colour=0, mode="L"), "image/png")})
        assert over.status_code == 413 and "exceeds the limit of 36000000" in over.json()["error"]


def _smooth(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([255 * x / w, 255 * y / h, 128 + 100 * np.sin(x / w * 6) * np.cos(y / h * 4)], -1)
    return img.astype(np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_reduced_decode_keeps_the_embedding(model_dir, fmt):
    from clip_mini.retrieval.engine import QueryEngine
    from clip_mini.serve.pictures import decode_upload

    engine = QueryEngine.load(model_dir)
    size = engine.image_input_size()
    image = _smooth(30 * size, 20 * size)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=fmt, quality=95)
    small = decode_upload(buf.getvalue(), min_size=size)
    full = decode_upload(buf.getvalue())
    assert full.shape == image.shape and 2 * size <= min(small.shape[:2]) < 4 * size, small.shape
    assert small.shape[0] > small.shape[1]   # same orientation and aspect
    cos = float(engine.encode_image([small])[0] @ engine.encode_image([full])[0])
    assert cos > 0.999, cos


def test_reduced_decode_keeps_orientation_and_palette_colours():
    from clip_mini.serve.pictures import decode_upload

    exif = Image.Exif()
    exif[0x0112] = 6   # stored landscape, shown rotated 90 degrees: portrait
    buf = io.BytesIO()
    Image.new("RGB", (1200, 600), (0, 0, 255)).save(buf, format="PNG", exif=exif.tobytes())
    upright = decode_upload(buf.getvalue(), min_size=32)
    assert upright.shape[0] > upright.shape[1] and min(upright.shape[:2]) < 600
    buf = io.BytesIO()
    Image.new("RGB", (900, 900), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE).save(buf, format="PNG")
    paletted = decode_upload(buf.getvalue(), min_size=32)   # palette indices are converted, never averaged
    assert paletted.shape[0] < 900 and (np.abs(paletted.astype(int) - [10, 200, 30]) <= 2).all()
