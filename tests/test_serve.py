"""`clip-mini serve`: the HTTP API through FastAPI's TestClient (no socket), the reload of new index generations
while `clip-mini index --add` runs, and the command itself over real HTTP. The page in a browser:
tests/test_serve_browser.py."""
from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="clip-mini serve needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (test extra)")

from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from conftest import make_model_dir, write_images  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _client(index_dir, **changes) -> TestClient:
    from clip_mini.serve.app import ServeConfig, create_app

    cfg = ServeConfig(index=str(index_dir), allowed_hosts=["testserver"], **changes)
    return TestClient(create_app(cfg))


@pytest.fixture(scope="module")
def small_index(model_dir, tmp_path_factory) -> Path:
    from clip_mini.retrieval.index import EmbeddingIndex

    tmp = tmp_path_factory.mktemp("serve")
    images = write_images(tmp / "photos", 12, seed=3)
    EmbeddingIndex.build(tmp / "index", model_dir, images, captions={str(images[0]): "a caption"}, progress=False)
    return tmp / "index"


@pytest.fixture(scope="module")
def client(small_index):
    with _client(small_index) as c:
        yield c


def _png(size=(24, 24), colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


# -- answers ---------------------------------------------------------------------------------------------------
def test_text_search_answers_like_the_library(client, small_index):
    from clip_mini.retrieval.engine import QueryEngine
    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(small_index)
    scores, ids = index.search(QueryEngine.load(index.manifest["model_dir"]).encode_text(["a red circle"]), 5)
    r = client.get("/api/search", params={"q": "a red circle", "k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["query"] == "a red circle" and body["k"] == 5 and body["generation"] == 1 and body["took_ms"] >= 0
    assert [h["rank"] for h in body["results"]] == [1, 2, 3, 4, 5]
    assert [h["id"] for h in body["results"]] == ids[0].tolist()
    # paths relative to the indexed folder: an answer does not say where the photos live
    photos = small_index.parent / "photos"
    assert [h["path"] for h in body["results"]] == [os.path.relpath(index.items["path"][i], photos) for i in ids[0]]
    np.testing.assert_allclose([h["score"] for h in body["results"]], scores[0], atol=1e-6)
    for h in body["results"]:
        assert h["thumb"] == f"/thumb/{h['id']}?gen=1" and h["image"] == f"/image/{h['id']}?gen=1"
        assert ("caption" in h) == (h["path"].endswith("img000.png"))
    # k larger than the index: every row once
    assert len(client.get("/api/search", params={"q": "a red circle", "k": 100}).json()["results"]) == 12


def test_image_search_by_upload_and_by_base64(client, small_index):
    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(small_index)
    data = Path(index.items["path"][7]).read_bytes()
    target = Path(index.items["path"][7]).name   # as the answer shows it: relative to the indexed folder
    r = client.post("/api/search/image", params={"k": 3}, files={"file": ("q.png", data, "image/png")})
    assert r.status_code == 200, r.text
    top = r.json()["results"][0]
    assert top["path"] == target and top["score"] == pytest.approx(1.0, abs=1e-3)   # an indexed image finds itself
    by_json = client.post("/api/search/image", json={"image": base64.b64encode(data).decode(), "k": 3}).json()
    data_url = client.post("/api/search/image",
                           json={"image": "data:image/png;base64," + base64.b64encode(data).decode()}).json()
    assert [h["id"] for h in by_json["results"]] == [h["id"] for h in r.json()["results"]]
    assert data_url["results"][0]["path"] == target and data_url["k"] == 10


def test_pictures_by_row_id(client, small_index):
    from clip_mini.retrieval.index import EmbeddingIndex

    path = EmbeddingIndex.load(small_index).items["path"][4]
    thumb = client.get("/thumb/4")
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(thumb.content)).size == (24, 24)   # small images are not enlarged
    original = client.get("/image/4?gen=1")
    assert original.headers["content-type"] == "image/png" and original.content == Path(path).read_bytes()
    attention = client.get("/api/attention/4")
    assert attention.status_code == 200 and attention.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(attention.content)).size == (448, 448)
    assert client.get("/healthz").json() == {"ok": True, "generation": 1}
    info = client.get("/api/info").json()
    assert info["index_size"] == 12 and info["generation"] == 1 and info["reload_error"] is None
    assert info["model_fingerprint"] == EmbeddingIndex.load(small_index).fingerprint
    assert info["backend"]["search"] == "exact" and 0 < info["index_open_s"] < 60
    # 12 rows: below FLOAT32_MAX_ROWS, searched from a float32 copy (12 x 32 floats)
    assert info["backend"]["float32_rows_in_memory"] and info["backend"]["float32_rows_bytes"] == 12 * 32 * 4


def test_page_and_its_assets_are_served_locally(client):
    page = client.get("/")
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    for asset in ("/static/app.js", "/static/style.css"):
        assert asset in html and client.get(asset).status_code == 200
    assert "http://" not in html and "https://" not in html and "//" not in client.get("/static/style.css").text


def test_attention_needs_a_vit(tmp_path):
    from clip_mini.retrieval.index import EmbeddingIndex

    model = make_model_dir(tmp_path / "cnn", vision=dict(backbone="efficientnet_lite0", image_size=32))
    images = write_images(tmp_path / "photos", 3)
    EmbeddingIndex.build(tmp_path / "index", model, images, progress=False)
    with _client(tmp_path / "index") as c:
        r = c.get("/api/attention/0")
        assert r.status_code == 409 and "ViT" in r.json()["error"] and "efficientnet_lite0" in r.json()["error"]
        assert c.get("/api/search", params={"q": "a red circle"}).status_code == 200


# -- bad input: 4xx JSON, and the server keeps serving ---------------------------------------------------------
def _bomb_png() -> bytes:
    # 10000 x 10000 = 100 MP of one colour compresses to ~100 KB: over the 36 MP upload limit, refused undecoded.
    buf = io.BytesIO()
    Image.new("L", (10000, 10000)).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


BAD_GETS = [
    ("/api/search", 400, "empty"),
    ("/api/search?q=", 400, "empty"),
    ("/api/search?q=%20%20", 400, "empty"),
    ("/api/search?q=" + "a" * 1001, 400, "limit is 1000"),
    ("/api/search?q=red&k=0", 400, "between 1 and 100"),
    ("/api/search?q=red&k=101", 400, "between 1 and 100"),
    ("/api/search?q=red&k=-5", 400, "between 1 and 100"),
    ("/api/search?q=red&k=ten", 400, "k: "),
    ("/api/search?q=red&k=99999999999999999999999", 400, "k"),
    ("/thumb/12", 404, "no image with id 12"),
    ("/thumb/-1", 404, "no image with id -1"),
    ("/image/99999", 404, "no image with id"),
    ("/thumb/1.5", 400, "row"),
    ("/thumb/0?gen=2", 410, "generation 2 is not loaded"),
    ("/thumb/0?gen=..%2F..", 400, "gen"),
    ("/api/attention/12", 404, "no image with id"),
    # path tricks: an encoded slash is decoded before routing, so these match no route at all
    ("/thumb/..%2F..%2F..%2Fetc%2Fpasswd", 404, "Not Found"),
    ("/image/%2Fetc%2Fpasswd", 404, "Not Found"),
    ("/image/0/../../../../etc/passwd", 404, "Not Found"),
    ("/static/..%2F..%2F..%2Fpyproject.toml", 404, "Not Found"),
    ("/static/../app.py", 404, "Not Found"),
    ("/thumb/0;cat%20/etc/passwd", 404, "Not Found"),
    ("/thumb/0%00", 400, "row"),
    ("/api/nothing", 404, "Not Found"),
]


@pytest.mark.parametrize("url,status,message", BAD_GETS, ids=[u[:40] for u, _, _ in BAD_GETS])
def test_bad_requests_get_json_errors(client, url, status, message):
    r = client.get(url)
    assert r.status_code == status, (url, r.text)
    assert r.headers["content-type"] == "application/json" and message in r.json()["error"], r.text
    assert client.get("/api/search", params={"q": "a red circle", "k": 1}).status_code == 200


def _truncated_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()[:-300]


BAD_UPLOADS = [
    ("not an image", dict(files={"file": ("x.png", b"hello, not a picture", "image/png")}), 415, "not an image"),
    ("empty file", dict(files={"file": ("x.png", b"", "image/png")}), 422, "empty upload"),
    ("truncated png", dict(files={"file": ("x.png", _truncated_png(), "image/png")}), 422, "cannot decode"),
    ("decompression bomb", dict(files={"file": ("bomb.png", _bomb_png(), "image/png")}), 413, "pixels"),
    ("svg", dict(files={"file": ("x.svg", b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")}), 415,
     "not an image"),
    ("eps", dict(files={"file": ("x.eps", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "image/eps")}),
     415, "not an image"),
    ("no file field", dict(data={"other": "1"}, files={"notfile": ("x.png", b"1", "image/png")}), 400, "'file'"),
    ("bad base64", dict(json={"image": "!!!not base64!!!"}), 400, "base64"),
    ("json without image", dict(json={"picture": "abc"}), 400, '"image"'),
    ("k as text", dict(json={"image": base64.b64encode(_png()).decode(), "k": "3"}), 400, "k must be an integer"),
    ("k out of range", dict(json={"image": base64.b64encode(_png()).decode(), "k": 0}), 400, "between 1 and"),
    ("broken json", dict(content=b"{not json", headers={"content-type": "application/json"}), 400, "not valid JSON"),
    ("plain text body", dict(content=b"abc", headers={"content-type": "text/plain"}), 415, "multipart/form-data"),
    ("declared too large", dict(content=b"x" * (15 << 20), headers={"content-type": "application/json"}), 413,
     "over the limit"),
]


@pytest.mark.parametrize("kwargs,status,message", [u[1:] for u in BAD_UPLOADS], ids=[u[0] for u in BAD_UPLOADS])
def test_bad_uploads_get_json_errors(client, kwargs, status, message):
    r = client.post("/api/search/image", **kwargs)
    assert r.status_code == status, r.text
    assert message in r.json()["error"], r.text
    ok = client.post("/api/search/image", files={"file": ("ok.png", _png(), "image/png")})
    assert ok.status_code == 200, ok.text


def test_upload_cap_without_content_length(small_index):
    def chunks():
        for _ in range(64):
            yield b"x" * 65536

    with _client(small_index, max_upload_bytes=1 << 20) as c:
        r = c.post("/api/search/image", content=chunks(), headers={"content-type": "application/json"})   # chunked
        assert r.status_code == 413 and "over the limit" in r.json()["error"]
        big = Image.fromarray(np.random.default_rng(1).integers(0, 256, (700, 700, 3), dtype=np.uint8))
        buf = io.BytesIO()
        big.save(buf, "PNG")   # ~1.5 MB of noise: over the 1 MB image cap, under the body cap
        r = c.post("/api/search/image", files={"file": ("big.png", buf.getvalue(), "image/png")})
        assert r.status_code == 413, r.text


def test_body_cap_stops_reading():
    """A body without (or lying about) its length is not read past the cap."""
    import asyncio

    from starlette.requests import Request

    from clip_mini.serve.limits import BodyTooLarge, LimitBody

    received = []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}   # endless

    async def app(scope, receive, send):
        await Request(scope, receive).body()

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"10")]}
    with pytest.raises(BodyTooLarge):
        asyncio.run(LimitBody(app, max_bytes=10_000)(scope, receive, None))
    assert len(received) == 11


def test_host_header_checked_on_loopback(small_index):
    from clip_mini.serve.app import ServeConfig, create_app
    from clip_mini.serve.server import allowed_hosts

    app = create_app(ServeConfig(index=str(small_index), allowed_hosts=allowed_hosts("127.0.0.1")))
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        assert c.get("/healthz").status_code == 200
        # a DNS name rebound to 127.0.0.1 by some web page must not read the photos
        r = c.get("/thumb/0", headers={"host": "attacker.example:8000"})
        assert r.status_code == 400 and "invalid Host header 'attacker.example:8000'" in r.json()["error"]
        assert c.get("/healthz", headers={"host": "localhost:8000"}).status_code == 200
        assert c.get("/healthz", headers={"host": "[::1]:8000"}).status_code == 200
    assert allowed_hosts("0.0.0.0") == ["*"] and "127.0.0.2" in allowed_hosts("127.0.0.2")


# -- generations -----------------------------------------------------------------------------------------------
def _generation_files(index_dir: Path, gen: int):
    """One generation's rows and item paths, read straight from its files (paths as stored: maybe relative)."""
    from clip_mini.retrieval.format import read_items

    return (np.load(index_dir / f"embeddings-{gen}.npy"), list(read_items(index_dir / f"items-{gen}.cols")["path"]))


@pytest.mark.slow
def test_reload_while_clip_mini_index_add_runs(model_dir, tmp_path):
    """Every answer comes from exactly one generation (ids, paths and scores all of it), old before new."""
    from clip_mini.retrieval.engine import QueryEngine
    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.retrieval.search import exact_search

    first = write_images(tmp_path / "photos", 30, seed=5)
    EmbeddingIndex.build(tmp_path / "index", model_dir, first, progress=False)
    more = write_images(tmp_path / "more", 200, seed=6, prefix="a_new")   # sorts before img*: every row id moves
    queries = ["a red circle", "a blue square", "a green star"]
    answers = []
    with _client(tmp_path / "index", poll_s=0.05) as c:
        add = subprocess.Popen([sys.executable, "-m", "clip_mini", "index", "--model", str(model_dir), "--images",
                                str(tmp_path / "more"), "--out", str(tmp_path / "index"), "--add", "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        i = 0
        while time.monotonic() < deadline:
            r = c.get("/api/search", params={"q": queries[i % 3], "k": 8})
            assert r.status_code == 200, r.text
            answers.append((queries[i % 3], r.json()))
            i += 1
            if add.poll() is not None and answers[-1][1]["generation"] == 2:
                break
            time.sleep(0.01)
        out = add.communicate()[0]
        assert add.returncode == 0, out
        # the previous generation's rows are still shown for pages that were rendered from it
        old_row = next(h for h in answers[0][1]["results"])
        assert c.get(old_row["thumb"]).status_code == 200
        assert c.get(f"/image/{old_row['id']}?gen=1").content == (tmp_path / "photos" / old_row["path"]).read_bytes()
    gens = [a["generation"] for _, a in answers]
    assert gens[0] == 1 and gens[-1] == 2 and gens == sorted(gens), gens   # never back to the old one
    assert len(more) + len(first) == len(_generation_files(tmp_path / "index", 2)[1])
    engine = QueryEngine.load(model_dir)
    for gen in (1, 2):
        emb, paths = _generation_files(tmp_path / "index", gen)
        for q, a in ((q, a) for q, a in answers if a["generation"] == gen):
            scores, ids = exact_search(emb, engine.encode_text([q]), 8)
            assert [h["id"] for h in a["results"]] == ids[0].tolist()
            assert [Path(h["path"]).name for h in a["results"]] == [Path(paths[j]).name for j in ids[0]]
            np.testing.assert_allclose([h["score"] for h in a["results"]], scores[0], atol=1e-5)


def test_a_bad_new_generation_leaves_the_old_one_serving(model_dir, tmp_path):
    from clip_mini.fileio.atomic import atomic_write_text
    from clip_mini.retrieval.index import EmbeddingIndex

    EmbeddingIndex.build(tmp_path / "index", model_dir, write_images(tmp_path / "photos", 5), progress=False)
    manifest = tmp_path / "index" / "manifest.json"
    good = manifest.read_text()
    with _client(tmp_path / "index", poll_s=3600) as c:
        watcher = c.app.state.service.watcher
        broken = json.loads(good)
        broken["count"] = 6   # no longer matches its own digest
        atomic_write_text(manifest, json.dumps(broken))
        assert watcher.refresh() is False
        info = c.get("/api/info").json()
        assert info["generation"] == 1 and "manifest.json is corrupt" in info["reload_error"]
        assert len(c.get("/api/search", params={"q": "a red circle"}).json()["results"]) == 5
        atomic_write_text(manifest, good)   # the writer fixes it: the error clears, the same generation serves
        assert watcher.refresh() is False and c.get("/api/info").json()["reload_error"] is None


def test_index_of_another_model_is_refused(model_dir, other_model_dir, tmp_path):
    from clip_mini.retrieval.format import EmbeddingIndexError
    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.serve.generations import IndexWatcher

    EmbeddingIndex.build(tmp_path / "index", other_model_dir, write_images(tmp_path / "p", 3), progress=False)
    with pytest.raises(EmbeddingIndexError, match="not comparable"):
        IndexWatcher(tmp_path / "index", EmbeddingIndex.load(tmp_path / "index").fingerprint + "x")
    from clip_mini.cli.main import main

    assert main(["serve", "--index", str(tmp_path / "index"), "--model", str(model_dir)]) == 2


@pytest.mark.parametrize("k", [1, 5, 40, 41, 100])
def test_float32_rows_search_equals_the_library(k):
    from clip_mini.retrieval.search import exact_search
    from clip_mini.serve.generations import _search_rows32

    rng = np.random.default_rng(0)
    rows = rng.standard_normal((41, 16)).astype(np.float32)
    rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16)
    rows[7] = rows[3]   # a tie: the lower row id ranks first, as in the library
    queries = np.concatenate([rows[3:4].astype(np.float32), rng.standard_normal((4, 16)).astype(np.float32)])
    scores, ids = _search_rows32(rows.astype(np.float32), queries, k)
    want_scores, want_ids = exact_search(rows, queries, k)
    assert ids.dtype == np.int64 and ids.tolist() == want_ids.tolist()
    np.testing.assert_allclose(scores, want_scores, atol=1e-6)


def test_batcher_searches_waiting_queries_together(small_index):
    """Queries that arrive while a search runs are answered by one search, each exactly as if alone."""
    from concurrent.futures import ThreadPoolExecutor

    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.serve.batching import SearchBatcher
    from clip_mini.serve.generations import IndexWatcher

    gen = IndexWatcher(small_index, EmbeddingIndex.load(small_index).fingerprint).current
    assert gen.rows32 is not None and gen.rows32.dtype == np.float32
    gate, calls = threading.Event(), []

    def search(g, queries, k):
        calls.append(len(queries))
        if len(calls) == 1:
            gate.wait(60)   # hold the first batch so the others queue up behind it
        if len(calls) == 3:
            raise RuntimeError("search failed")
        return g.search(queries, k)

    batcher = SearchBatcher(lambda: gen, search)
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((9, gen.index.dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ks = [3, 1, 12, 5, 2, 7, 4, 12, 9]
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(batcher.search, queries[0], ks[0])]
        while calls != [1]:
            time.sleep(0.01)
        futures += [pool.submit(batcher.search, q, k) for q, k in zip(queries[1:], ks[1:])]
        while batcher._queue.qsize() < 8:
            time.sleep(0.01)
        gate.set()
        answers = [f.result(timeout=60) for f in futures]
    assert calls == [1, 8] and batcher.batches == 2 and batcher.queries == 9
    for q, k, (g, scores, ids) in zip(queries, ks, answers):
        want_scores, want_ids = gen.index.search(q[None], k)   # the library alone, on the float16 rows
        assert g is gen and ids.tolist() == want_ids[0].tolist()
        np.testing.assert_allclose(scores, want_scores[0], atol=1e-6)
    with pytest.raises(RuntimeError, match="search failed"):   # an error reaches the request ...
        batcher.search(queries[0], 3)
    assert batcher.search(queries[0], 3)[2].tolist() == answers[0][2].tolist()   # ... and the thread lives on


# -- the command -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [(["--index", "missing"], "does not exist"),
                                          (["--index", "X", "--port", "0"], "--port"),
                                          (["--index", "X", "--workers", "0"], "--workers"),
                                          (["--index", "X", "--device", "tpu"], "tpu"),
                                          (["--index", "X", "--device", "cuda:99"], "cuda:99")])
def test_cli_errors(args, message, capsys, tmp_path):
    from clip_mini.cli.main import main

    assert main(["serve", *[str(tmp_path / a) if a in ("missing", "X") else a for a in args]]) == 2
    assert message in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_over_http(small_index):
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clip_mini", "serve", "--index", str(small_index), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert f"on http://127.0.0.1:{port}/" in line and "12 images, generation 1 opened in " in line, line
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):   # the URL is printed before uvicorn binds
            try:
                health = httpx.get(f"{url}/healthz", timeout=5)
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        assert health.json()["ok"] is True
        r = httpx.get(f"{url}/api/search", params={"q": "a red circle", "k": 3}, timeout=30)
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        assert httpx.get(f"{url}/api/search", params={"q": ""}, timeout=30).status_code == 400
    finally:
        proc.terminate()
        proc.wait(timeout=30)
