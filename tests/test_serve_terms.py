"""`clip-mini serve` and query arithmetic: the API's `without` terms (the page's "without" box) are combined by the
library's own combiner, and bad terms get the command line's errors as 400s."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="clip-mini serve needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from conftest import write_images  # noqa: E402


@pytest.fixture(scope="module")
def index_dir(model_dir, tmp_path_factory) -> Path:
    from clip_mini.retrieval.index import EmbeddingIndex

    tmp = tmp_path_factory.mktemp("serve-terms")
    EmbeddingIndex.build(tmp / "index", model_dir, write_images(tmp / "photos", 12, seed=5), progress=False)
    return tmp / "index"


@pytest.fixture(scope="module")
def client(index_dir):
    from clip_mini.serve.app import ServeConfig, create_app

    with TestClient(create_app(ServeConfig(index=str(index_dir), allowed_hosts=["testserver"],
                                           preload_attention=False))) as c:
        yield c


def _ids(answer: dict) -> list[int]:
    return [h["id"] for h in answer["results"]]


def test_without_terms_search_as_the_library_combines_them(client, index_dir):
    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(index_dir)
    scores, ids = index.search([("a red circle", 2.0), ("a blue square", -1.0), ("green", -1.0)], k=6)
    r = client.get("/api/search", params=[("q", "2:a red circle"), ("without", "a blue square"),
                                          ("without", "green"), ("without", "  "), ("k", 6)])
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["query"] == "2:a red circle" and answer["without"] == ["a blue square", "green"]
    assert _ids(answer) == ids[0].tolist()
    np.testing.assert_allclose([h["score"] for h in answer["results"]], scores[0], atol=1e-5)
    # an empty "without" box changes nothing: the answer of a plain query
    plain = client.get("/api/search", params={"q": "a red circle", "without": "", "k": 6}).json()
    assert "without" not in plain and _ids(plain) == index.search("a red circle", k=6)[1][0].tolist()


def test_an_image_query_takes_without_terms(client, index_dir):
    from PIL import Image

    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(index_dir)
    path = Path(index.items["path"][3])
    pixels = np.asarray(Image.open(path).convert("RGB"))
    scores, ids = index.search([(pixels, 1.0), ("a red circle", -1.0)], k=5)
    r = client.post("/api/search/image", params={"k": 5, "without": "a red circle"},
                    files={"file": ("q.png", path.read_bytes(), "image/png")})
    assert r.status_code == 200, r.text
    assert r.json()["without"] == ["a red circle"] and _ids(r.json()) == ids[0].tolist()
    np.testing.assert_allclose([h["score"] for h in r.json()["results"]], scores[0], atol=1e-5)


@pytest.mark.parametrize("params, status, message", [
    ({"q": "x:dog"}, 400, "malformed weight 'x'"),
    ({"q": "2:"}, 400, "has a weight but nothing to weight"),
    ({"q": "a dog", "without": "0:grass"}, 400, "malformed weight '0'"),
    ({"without": "grass"}, 400, "the query q is empty"),
    ({"q": "a dog", "without": "a dog"}, 400, "cancel out"),
    ({"q": "a dog", "without": ["w"] * 9}, 400, "9 'without' terms; the limit is 8"),
    ({"q": "a dog", "without": "x" * 1001}, 400, "characters long; the limit is 1000"),
])
def test_bad_terms_are_400s_naming_the_term(client, params, status, message):
    r = client.get("/api/search", params=params)
    assert r.status_code == status and message in r.json()["error"], r.text


def test_a_path_in_a_request_is_a_caption_never_a_file(client, index_dir):
    from clip_mini.retrieval.index import EmbeddingIndex

    image = EmbeddingIndex.load(index_dir).items["path"][0]   # a real file on the server
    answer = client.get("/api/search", params={"q": image, "k": 3}).json()
    assert answer["query"] == image and answer["results"][0]["score"] < 0.9   # an image would find itself at 1.0
    assert _ids(answer) == EmbeddingIndex.load(index_dir).search([(image, 1.0)], k=3)[1][0].tolist()   # as text


def test_the_page_has_a_without_box(client):
    html = client.get("/").text
    assert 'id="without"' in html and 'name="without"' in html
    assert 'params.append("without"' in client.get("/static/app.js").text
