"""`clip-mini serve`'s "why this match": ``GET /api/explain/ID?q=TEXT``, the PNG of a hit with the match map of the
text query over it (``Embedder.explain``, drawn as ``clip-mini search --explain`` draws a hit), through FastAPI's
TestClient on the fixtures of tests/test_serve.py. The page's toggle in a browser: tests/test_serve_browser.py."""
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="clip-mini serve needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (test extra)")

from PIL import Image  # noqa: E402

from conftest import make_model_dir, write_images  # noqa: E402
from test_serve import _client, small_index  # noqa: E402,F401 (small_index: the fixture, shared)

TOKEN = "explain-token-for-tests-0123456789"
CACHED = {"cache-control": "private, max-age=3600", "cross-origin-resource-policy": "same-origin"}


@pytest.fixture(scope="module")
def client(small_index):  # noqa: F811
    with _client(small_index, preload_attention=False) as c:
        yield c


def _service(client):
    return client.app.state.service


def _picture(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _drawn_by_the_library(model_dir, path: str, text: str) -> np.ndarray:
    """What ``clip-mini search --explain`` draws for this hit, at a server thumbnail's size."""
    import clip_mini
    from clip_mini.data.images import load_image
    from clip_mini.pictures.draw import match_overlay
    from clip_mini.serve.pictures import THUMB_PX

    image = load_image(path)
    return np.asarray(match_overlay(image, clip_mini.load(model_dir).explain(image, text), THUMB_PX))


class _CountDrawings:
    """Wraps the service's ``maps.explain_png``: how many maps were really drawn (not answered from the cache)."""

    def __init__(self, monkeypatch, client, pause_s: float = 0.0):
        maps = _service(client).maps
        self.calls, self._draw, self._pause = 0, maps.explain_png, pause_s
        self._lock = threading.Lock()
        monkeypatch.setattr(maps, "explain_png", self)

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
        time.sleep(self._pause)
        return self._draw(*args, **kwargs)


# -- answers ---------------------------------------------------------------------------------------------------
def test_explain_answers_the_hit_with_the_library_s_match_map(client, small_index, model_dir):
    from clip_mini.retrieval.index import EmbeddingIndex

    answer = client.get("/api/search", params={"q": "a red circle", "k": 3}).json()
    assert answer["explainable"] is True
    hit = answer["results"][0]
    r = client.get(f"/api/explain/{hit['id']}", params={"q": "a red circle", "gen": answer["generation"]})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    assert {k: r.headers[k] for k in CACHED} == CACHED   # as /thumb and /image: a page of another site cannot embed it
    drawn = _picture(r.content)
    thumb = Image.open(io.BytesIO(client.get(hit["thumb"]).content))
    assert drawn.shape == (thumb.height, thumb.width, 3) == (24, 24, 3)   # the thumbnail's size (small: as it is)
    path = EmbeddingIndex.load(small_index).items["path"][hit["id"]]
    want = _drawn_by_the_library(model_dir, path, "a red circle")
    assert np.abs(drawn.astype(int) - want).max() <= 1
    assert not np.array_equal(drawn, _picture(Path(path).read_bytes()))   # a map is over it
    other = _picture(client.get(f"/api/explain/{hit['id']}", params={"q": "a blue square"}).content)
    assert not np.array_equal(other, drawn)   # the map is the query's


def test_a_large_image_is_drawn_at_its_thumbnail_s_size(model_dir, tmp_path):
    from clip_mini.retrieval.index import EmbeddingIndex

    photos = tmp_path / "photos"
    write_images(photos, 2, seed=7)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(photos / "wide.png")
    EmbeddingIndex.build(tmp_path / "index", model_dir, sorted(photos.iterdir()), progress=False)
    with _client(tmp_path / "index", preload_attention=False) as c:
        row = next(i for i, p in enumerate(EmbeddingIndex.load(tmp_path / "index").items["path"])
                   if p.endswith("wide.png"))
        r = c.get(f"/api/explain/{row}", params={"q": "a green star"})
        assert r.status_code == 200, r.text
        thumb = Image.open(io.BytesIO(c.get(f"/thumb/{row}").content))
        assert Image.open(io.BytesIO(r.content)).size == thumb.size == (256, 192)
        want = _drawn_by_the_library(model_dir, str(photos / "wide.png"), "a green star")
        assert np.abs(_picture(r.content).astype(int) - want).max() <= 1


def test_a_second_request_is_answered_from_the_cache(client, monkeypatch):
    drawings = _CountDrawings(monkeypatch, client)
    stats = lambda: client.get("/api/info").json()["backend"]["match_map_cache"]   # noqa: E731
    before = stats()
    first = client.get("/api/explain/5", params={"q": "a yellow triangle"})
    assert first.status_code == 200 and drawings.calls == 1
    after_first = stats()
    assert after_first["misses"] == before["misses"] + 1 and after_first["entries"] == before["entries"] + 1
    # the same picture: generation 1 named or implied, the caption with spaces around it
    for params in ({"q": "a yellow triangle"}, {"q": "a yellow triangle", "gen": 1}, {"q": "  a yellow triangle "}):
        again = client.get("/api/explain/5", params=params)
        assert again.status_code == 200 and again.content == first.content, params
    assert drawings.calls == 1
    assert stats()["hits"] == after_first["hits"] + 3 and stats()["entries"] == after_first["entries"]
    # another row, another caption: drawn
    assert client.get("/api/explain/6", params={"q": "a yellow triangle"}).status_code == 200
    assert client.get("/api/explain/5", params={"q": "a yellow star"}).status_code == 200
    assert drawings.calls == 3 and stats()["entries"] == after_first["entries"] + 2


def test_the_cache_is_bounded(small_index, monkeypatch):  # noqa: F811
    with _client(small_index, preload_attention=False, explain_cache_bytes=3000) as c:   # one 24 px PNG: ~2 KB
        drawings = _CountDrawings(monkeypatch, c)
        for row in (0, 1, 0):
            last = c.get(f"/api/explain/{row}", params={"q": "a red circle"})
            assert last.status_code == 200
        assert drawings.calls == 3   # row 1 pushed row 0 out
        cache = c.get("/api/info").json()["backend"]["match_map_cache"]
        assert cache["entries"] == 1 and cache["bytes"] == len(last.content)
        assert c.get("/api/explain/0", params={"q": "a red circle"}).content == last.content and drawings.calls == 3


def test_concurrent_requests_for_one_picture_share_one_drawing(client, monkeypatch):
    drawings = _CountDrawings(monkeypatch, client, pause_s=0.5)   # slow enough for every request to arrive
    answers: list = [None] * 6

    def get(k):
        answers[k] = client.get("/api/explain/3", params={"q": "a green circle"})

    threads = [threading.Thread(target=get, args=(k,)) for k in range(len(answers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert len({a.content for a in answers}) == 1 and drawings.calls == 1


def test_maps_drawn_at_once_equal_maps_drawn_alone(small_index, model_dir):  # noqa: F811
    """Three explain threads draw at once (each a forward and a backward pass through the one shared model), beside
    text searches: every map equals the library's, drawn alone."""
    from clip_mini.retrieval.index import EmbeddingIndex

    paths = EmbeddingIndex.load(small_index).items["path"]
    jobs = [(row, q) for row in (1, 2, 4) for q in ("a red circle", "a blue square")]
    with _client(small_index, preload_attention=False, explain_threads=3) as c:
        answers: dict = {}
        start = threading.Barrier(len(jobs) + 2)

        def explain(row, q):
            start.wait()
            answers[(row, q)] = c.get(f"/api/explain/{row}", params={"q": q})

        def search():
            start.wait()
            for _ in range(5):
                assert c.get("/api/search", params={"q": "a red circle"}).status_code == 200

        threads = [threading.Thread(target=explain, args=job) for job in jobs]
        threads += [threading.Thread(target=search) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for row, q in jobs:
        r = answers[(row, q)]
        assert r.status_code == 200, r.text
        assert np.abs(_picture(r.content).astype(int) - _drawn_by_the_library(model_dir, paths[row], q)).max() <= 1


def test_the_search_answer_says_whether_its_query_can_be_explained(client, small_index):
    """The page's toggle follows it: one caption of weight 1, as ``clip-mini search --explain`` requires."""
    from clip_mini.retrieval.index import EmbeddingIndex

    search = lambda **params: client.get("/api/search", params=params).json()   # noqa: E731
    assert search(q="a red circle")["explainable"] is True
    assert search(q="1:a red circle")["explainable"] is True
    assert search(q="note: a red circle")["explainable"] is True   # prose with a colon is a caption
    assert search(q="2:a red circle")["explainable"] is False
    assert search(q="a red circle", without="grass")["explainable"] is False
    data = Path(EmbeddingIndex.load(small_index).items["path"][0]).read_bytes()
    image = client.post("/api/search/image", files={"file": ("q.png", data, "image/png")}).json()
    assert image["explainable"] is False


# -- bad input --------------------------------------------------------------------------------------------------
BAD = [
    ("/api/explain/12?q=a+red+circle", 404, "no image with id 12 in generation 1 (ids are 0..11)"),
    ("/api/explain/-1?q=a+red+circle", 404, "no image with id -1"),
    ("/api/explain/999999999999999999999?q=red", 404, "no image with id 999999999999999999999"),
    ("/api/explain/abc?q=red", 400, "row:"),
    ("/api/explain/0", 400, "the query q is empty"),
    ("/api/explain/0?q=", 400, "the query q is empty"),
    ("/api/explain/0?q=+++%09", 400, "the query q is empty"),
    ("/api/explain/0?q=" + "a" * 1001, 400, "is 1001 characters long; the limit is 1000"),
    ("/api/explain/0?q=2:a+red+circle", 400, "is weighted: a match map shows where one caption matches"),
    ("/api/explain/0?q=x:red", 400, "malformed weight"),
    ("/api/explain/0?q=red&gen=7", 410, "index generation 7 is not loaded"),
]


@pytest.fixture(scope="module")
def untouched_client(small_index):  # noqa: F811
    """A server that has drawn nothing: bad requests must leave it so."""
    with _client(small_index, preload_attention=False) as c:
        yield c


@pytest.mark.parametrize("url,status,message", BAD, ids=[u[13:40] for u, _, _ in BAD])
def test_bad_requests_get_json_errors_before_any_work(untouched_client, url, status, message):
    """Refused before the torch model is even loaded, and before anything is drawn or looked up in the cache."""
    r = untouched_client.get(url)
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json" and message in r.json()["error"], r.json()
    svc = _service(untouched_client)
    assert svc.maps.state == "not loaded" and svc.explain_cache.stats()["misses"] == 0


def test_with_a_token_explain_needs_it(small_index):  # noqa: F811
    with _client(small_index, preload_attention=False, token=TOKEN) as c:
        r = c.get("/api/explain/0", params={"q": "a red circle"})
        assert r.status_code == 401 and "Bearer" in r.json()["error"]
        assert c.get("/api/explain/0", params={"q": "a red circle"},
                     headers={"authorization": "Bearer not-the-token-at-all-0123"}).status_code == 401
        assert _service(c).maps.state == "not loaded"   # nothing was drawn for it
        good = c.get("/api/explain/0", params={"q": "a red circle"}, headers={"authorization": f"Bearer {TOKEN}"})
        assert good.status_code == 200 and good.headers["content-type"] == "image/png"
        login = c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert login.status_code == 303
        by_cookie = c.get("/api/explain/0", params={"q": "a red circle"})   # the page's <img>: the login cookie
        assert by_cookie.status_code == 200 and by_cookie.content == good.content


def test_a_cnn_tower_is_explained_and_a_tower_without_maps_is_a_501(tmp_path):
    """An EfficientNet tower gets Grad-CAM on its last feature map. Every tower the config builds can be explained,
    so a tower without maps is made here by taking away what Grad-CAM reads (the head conv and its BatchNorm, which a
    timm CNN other than an EfficientNet may lack): a 501 that says why, as JSON, and searches go on."""
    from clip_mini.retrieval.index import EmbeddingIndex

    model = make_model_dir(tmp_path / "cnn", vision=dict(backbone="efficientnet_lite0", image_size=32))
    EmbeddingIndex.build(tmp_path / "index", model, write_images(tmp_path / "photos", 3), progress=False)
    with _client(tmp_path / "index", preload_attention=False) as c:
        r = c.get("/api/explain/1", params={"q": "a red circle"})
        assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text
        trunk = _service(c).maps._model().model.visual.trunk
        trunk.bn2 = trunk.conv_head = None
        r = c.get("/api/explain/1", params={"q": "a blue square"})
        assert r.status_code == 501 and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert error.startswith("this server cannot draw match maps: Grad-CAM needs a ViT image tower or a CNN tower")
        assert "efficientnet_lite0" in error
        assert c.get("/api/search", params={"q": "a red circle"}).status_code == 200
