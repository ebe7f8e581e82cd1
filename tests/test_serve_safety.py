"""`clip-mini serve` beyond loopback: files confined to the index's image root, the token and the page login, the
exposure rules of --host, headers and errors, and deadlines on half-sent requests. Uploads under load:
tests/test_serve_load.py; the API itself: tests/test_serve.py."""
from __future__ import annotations

import asyncio
import csv
import io
import json
import logging
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="clip-mini serve needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from conftest import write_images  # noqa: E402

TOKEN = "s3cret-token-for-tests-0123456789"


def _client(index_dir, **changes) -> TestClient:
    from clip_mini.serve.app import ServeConfig, create_app

    changes.setdefault("preload_attention", False)
    return TestClient(create_app(ServeConfig(index=str(index_dir), allowed_hosts=["testserver"], **changes)))


@pytest.fixture(scope="module")
def photo_index(model_dir, tmp_path_factory) -> Path:
    from clip_mini.retrieval.index import EmbeddingIndex

    tmp = tmp_path_factory.mktemp("safety")
    EmbeddingIndex.build(tmp / "index", model_dir, write_images(tmp / "photos", 6, seed=4), progress=False)
    return tmp / "index"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- files confined to the image root ----------------------------------------------------------------------------
def _tamper(index_dir: Path, new_paths: dict[int, str]) -> None:
    """Replace item paths of the current generation and recompute every checksum, as someone with write access to
    the index could: the checksums then pass, so only the server's own confinement stands in the way."""
    from clip_mini.fileio.atomic import atomic_write_json, sha256_file
    from clip_mini.retrieval.format import _manifest_digest

    manifest = json.loads((index_dir / "manifest.json").read_text())
    items_file = index_dir / manifest["files"]["items"]
    if items_file.suffix == ".cols":   # index format 4: columnar items
        from clip_mini.retrieval.items import read_items, write_items

        cols = read_items(items_file)
        names = list(cols)
        items = {c: list(cols[c]) for c in names}
        del cols
        for row, path in new_paths.items():
            items["path"][row] = path
        write_items(items_file, items, names)
    else:
        with open(items_file, newline="") as f:
            rows = list(csv.reader(f))
        for row, path in new_paths.items():
            rows[row + 1][0] = path
        with open(items_file, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(rows)
    manifest["checksums"][items_file.name] = sha256_file(items_file)
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    atomic_write_json(index_dir / "manifest.json", manifest)


def test_only_files_under_the_image_root_are_served(model_dir, tmp_path, caplog):
    from PIL import Image

    from clip_mini.retrieval.index import EmbeddingIndex

    photos = tmp_path / "photos"
    images = write_images(photos, 6, seed=5)
    EmbeddingIndex.build(tmp_path / "index", model_dir, images, progress=False)
    outside = tmp_path / "private"
    outside.mkdir()
    Image.new("RGB", (16, 16), (9, 9, 9)).save(outside / "secret.jpg")
    Image.new("RGB", (16, 16), (9, 9, 9)).save(outside / "other.jpg")
    (photos / "link.jpg").symlink_to(outside / "secret.jpg")           # a symlink inside that leads outside
    (photos / "folder.png").mkdir()                                     # not a regular file
    (photos / "inner.png").symlink_to(images[5])                        # a symlink that stays inside: fine
    _tamper(tmp_path / "index", {1: "../private/secret.jpg", 2: str(outside / "other.jpg"), 3: "link.jpg",
                                 4: "folder.png", 5: "inner.png"})
    EmbeddingIndex.load(tmp_path / "index")   # the checksums pass: the edit is not detectable as damage
    with caplog.at_level(logging.WARNING, logger="clip_mini.serve"), _client(tmp_path / "index") as c:
        assert c.get("/image/0").content == images[0].read_bytes()
        assert c.get("/image/5").content == images[5].read_bytes()
        for row in (1, 2, 3, 4):
            for route in ("image", "thumb", "api/attention"):
                r = c.get(f"/{route}/{row}")
                assert r.status_code == 404 and r.json() == {"error": f"image {row} is not available"}, (row, r.text)
                assert str(tmp_path) not in r.text
        c.get("/image/1")
    refused = [r.getMessage() for r in caplog.records if "not serving image" in r.getMessage()]
    assert len(refused) == 4, refused   # once per file, however often it is asked for
    assert any("outside the index's image root" in m and "secret.jpg" in m for m in refused)
    assert any("folder.png is not a regular file" in m for m in refused)


def _tar_with(path: Path, name: str, data: bytes) -> tuple[int, int]:
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        member = tar.getmember(name)
        return member.offset_data, member.size


def test_shard_rows_are_read_only_from_shards_under_the_root(tmp_path):
    import hashlib

    from clip_mini.serve.generations import Generation, NotServed

    png = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 0, 0)).save(png, format="PNG")
    data = png.getvalue()
    (tmp_path / "shards").mkdir()
    (tmp_path / "elsewhere").mkdir()
    inside = _tar_with(tmp_path / "shards/000000.tar", "a.png", data)
    outside = _tar_with(tmp_path / "elsewhere/x.tar", "a.png", data)
    digest = hashlib.sha256(data).hexdigest()
    items = {"path": ["000000.tar#a", "x.tar#a", "000000.tar#a"],
             "shard": [str(tmp_path / "shards/000000.tar"), str(tmp_path / "elsewhere/x.tar"),
                       str(tmp_path / "shards/000000.tar")],
             "offset": [inside[0], outside[0], inside[0]], "length": [inside[1], outside[1], inside[1]],
             "sha256": [digest, digest, "../../../../tmp/planted"]}
    root = str(tmp_path / "shards")
    gen = Generation(SimpleNamespace(items=items), (), 0.0, None, root, os.path.realpath(root))
    assert Path(gen.image_file(0)).read_bytes() == data   # a copy read out of the shard
    with pytest.raises(NotServed, match="outside the index's image root"):
        gen.image_file(1)
    with pytest.raises(NotServed, match="not a hex digest"):   # the copy's name comes from the row: checked
        gen.image_file(2)


# -- the token ------------------------------------------------------------------------------------------------------
PROTECTED = ["/", "/api/info", "/api/search?q=red", "/thumb/0", "/image/0", "/api/attention/0", "/api/explain/0?q=red",
             "/static/app.js", "/static/index.html"]


@pytest.fixture(scope="module")
def token_client(photo_index):
    with _client(photo_index, token=TOKEN) as c:
        yield c


def test_with_a_token_every_route_but_healthz_needs_it(token_client):
    c = token_client
    assert c.get("/healthz").status_code == 200
    for url in PROTECTED:
        r = c.get(url, follow_redirects=False)
        if url == "/":   # a browser is sent to the login form
            assert r.status_code == 303 and r.headers["location"] == "/login", r.text
            continue
        assert r.status_code == 401, (url, r.status_code)
        assert "Bearer" in r.json()["error"] and r.headers["www-authenticate"].startswith("Bearer")
    upload = c.post("/api/search/image", files={"file": ("q.png", b"x", "image/png")})
    assert upload.status_code == 401
    for bad in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer "):
        assert c.get("/api/info", headers={"authorization": bad}).status_code == 401, bad
    good = {"authorization": f"Bearer {TOKEN}"}
    for url in PROTECTED:
        assert c.get(url, headers=good).status_code == 200, url
    assert c.get("/api/info", headers=good).json()["auth"] == "token"


def test_page_login_sets_a_cookie_that_opens_every_route(photo_index):
    with _client(photo_index, token=TOKEN) as c:
        form = c.get("/login")
        assert form.status_code == 200 and 'action="/login"' in form.text and 'name="token"' in form.text
        assert "default-src 'self'" in form.headers["content-security-policy"]
        assert c.get("/static/style.css").status_code == 200   # the form's stylesheet: no inline style allowed
        wrong = c.post("/login", data={"token": "not-the-token-at-all"}, follow_redirects=False)
        assert wrong.status_code == 401 and 'class="error">' in wrong.text and "set-cookie" not in wrong.headers
        assert c.get("/api/info").status_code == 401
        ok = c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert ok.status_code == 303 and ok.headers["location"] == "/"
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert TOKEN not in cookie   # the cookie is derived from the token, not the token itself
        for url in PROTECTED:
            assert c.get(url).status_code == 200, url   # the client keeps the cookie, as a browser does
        c.cookies.clear()
        c.cookies.set("clip_mini_session", "0" * 64)
        assert c.get("/api/info").status_code == 401


def test_tokens_are_compared_in_constant_time(monkeypatch, token_client):
    import hmac

    from clip_mini.serve import guards

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(guards.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert token_client.get("/api/info", headers={"authorization": "Bearer wrong-guess"}).status_code == 401
    assert calls == [(b"wrong-guess", TOKEN.encode())]
    assert token_client.get("/api/info", cookies={"clip_mini_session": "abc"}).status_code == 401
    assert calls[-1][0] == b"abc"


# -- exposure: --host, --token, --no-auth ---------------------------------------------------------------------
def test_exposure_rules(monkeypatch):
    from clip_mini.serve.server import ServeError, exposure, is_loopback

    monkeypatch.delenv("CLIP_MINI_TOKEN", raising=False)
    assert exposure("127.0.0.1", None, False) == (None, None)
    assert exposure("::1", TOKEN, False) == (TOKEN, None)
    assert [is_loopback(h) for h in ("127.0.0.2", "localhost", "[::1]", "0.0.0.0", "192.168.1.5", "::", "example.com")] \
        == [True, True, True, False, False, False, False]
    with pytest.raises(ServeError, match="--host 0.0.0.0 makes the index reachable.*--token TOKEN.*CLIP_MINI_TOKEN.*"
                                         "--no-auth"):
        exposure("0.0.0.0", None, False)
    token, warning = exposure("0.0.0.0", TOKEN, False)
    assert token == TOKEN and warning.startswith("warning: serving on 0.0.0.0") and "TLS" in warning
    token, warning = exposure("192.168.1.5", None, True)
    assert token is None and "WITHOUT authentication" in warning
    with pytest.raises(ServeError, match="at least 16"):
        exposure("0.0.0.0", "short", False)
    with pytest.raises(ServeError, match="contradicts"):
        exposure("0.0.0.0", TOKEN, True)
    monkeypatch.setenv("CLIP_MINI_TOKEN", TOKEN)
    assert exposure("0.0.0.0", None, False)[0] == TOKEN   # from the environment: not visible in `ps`


def test_non_loopback_host_without_a_token_exits_2(photo_index, capsys, monkeypatch):
    from clip_mini.cli.main import main

    monkeypatch.delenv("CLIP_MINI_TOKEN", raising=False)
    assert main(["serve", "--index", str(photo_index), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 makes the index reachable from other machines" in err and "--no-auth" in err


def _serve(args: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clip_mini", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            httpx.get(f"{url}/healthz", timeout=5)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None:
                raise AssertionError(f"clip-mini serve exited: {proc.communicate()}")
            time.sleep(0.1)
    raise AssertionError("clip-mini serve did not start")


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    return proc.communicate(timeout=30)[1]


@pytest.mark.parametrize("how", ["token from the environment", "--no-auth"])
def test_non_loopback_host_serves_with_a_warning(photo_index, how):
    import httpx

    env = {"CLIP_MINI_TOKEN": TOKEN} if how.startswith("token") else {"CLIP_MINI_TOKEN": ""}
    extra = ["--no-auth"] if how == "--no-auth" else []
    proc, url = _serve(["--index", str(photo_index), "--host", "0.0.0.0", *extra], env)
    try:
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        search = httpx.get(f"{url}/api/search", params={"q": "red"}, timeout=30)
        if extra:
            assert search.status_code == 200
        else:
            assert search.status_code == 401
            ok = httpx.get(f"{url}/api/search", params={"q": "red"}, timeout=30,
                           headers={"authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200 and not ok.json()["results"][0]["path"].startswith("/")
    finally:
        err = _stop(proc)
    assert "warning: serving on 0.0.0.0" in err
    assert ("WITHOUT authentication" in err) == bool(extra)


# -- headers, errors, HEAD, /api/info ---------------------------------------------------------------------------
def test_every_answer_says_nosniff(photo_index):
    with _client(photo_index, max_upload_bytes=1000) as c:
        answers = [c.get("/api/info"), c.get("/static/app.js"), c.get("/thumb/999"), c.get("/"),
                   c.get("/healthz", headers={"host": "evil.example"}),
                   c.post("/api/search/image", content=b"x" * 100_000, headers={"content-type": "application/json"})]
        assert [a.status_code for a in answers] == [200, 200, 404, 200, 400, 413]
        for a in answers:
            assert a.headers["x-content-type-options"] == "nosniff" and a.headers["referrer-policy"] == "no-referrer"


def test_invalid_host_header_is_json(photo_index):
    from clip_mini.serve.app import ServeConfig, create_app

    app = create_app(ServeConfig(index=str(photo_index), allowed_hosts=["127.0.0.1"], preload_attention=False))
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        r = c.get("/api/search?q=red", headers={"host": "rebound.example"})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        assert r.json() == {"error": "invalid Host header 'rebound.example': this server answers to 127.0.0.1"}


def test_head_requests(photo_index):
    with _client(photo_index) as c:
        for url in ("/image/2", "/thumb/2", "/", "/healthz"):
            get, head = c.get(url), c.head(url)
            assert head.status_code == 200 and head.content == b"", url
            assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content)), url
            assert head.headers["content-type"] == get.headers["content-type"]
        assert c.head("/image/99").status_code == 404


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_info_reports_towers_runtime_and_no_absolute_path(photo_index):
    with _client(photo_index, preload_attention=True) as c:
        info = c.get("/api/info").json()
        assert info["towers"]["text"] == info["towers"]["image"] == "loaded"
        assert info["backend"]["query_encoder"]["runtime"] == "onnxruntime"
        assert info["backend"]["query_encoder"]["towers"] == {"text": ["CPUExecutionProvider"],
                                                              "image": ["CPUExecutionProvider"]}
        assert info["index"] == "index" and info["auth"] == "none"
        assert not [s for s in _strings(info) if s.startswith("/") or str(photo_index.parent) in s], info
        # the attention model loads in the background as the server starts, and says when it is ready
        deadline = time.monotonic() + 120
        while (state := c.get("/api/info").json()["towers"]["attention"]) != "loaded":
            assert state == "loading"   # one reading per turn: it may finish loading between two requests
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert c.get("/api/attention/0").status_code == 200


def test_client_leaving_mid_upload_logs_one_line(photo_index, caplog):
    """What uvicorn hands the app when the client goes away half-way through its body."""
    with _client(photo_index) as c:
        app = c.app
    messages = [{"type": "http.request", "body": b"--b\r\nContent-Disposition: form-data; name=\"file\"; "
                                                 b"filename=\"q.png\"\r\n\r\n\x89PNG", "more_body": True},
                {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/search/image", "raw_path": b"/api/search/image",
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("testserver", 80),
             "client": ("10.0.0.7", 5000), "http_version": "1.1",
             "headers": [(b"host", b"testserver"), (b"content-type", b"multipart/form-data; boundary=b"),
                         (b"content-length", b"100000")]}
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))
    lines = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith(("clip_mini", "uvicorn"))]
    assert [r.getMessage() for r in lines] == ["client 10.0.0.7 left before sending all of POST /api/search/image"]
    assert lines[0].exc_info is None and not [r for r in caplog.records if r.exc_info]


# -- deadlines on half-sent requests -------------------------------------------------------------------------
class _Quick:
    """A live uvicorn server in a thread with short deadlines, answering any request with the body's length."""

    def __init__(self):
        import uvicorn

        from clip_mini.serve.protocol import TimedH11Protocol, uvicorn_settings

        class Short(TimedH11Protocol):
            header_timeout_s = 0.5
            body_timeout_s = 0.5

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            size, more = 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                size, more = size + len(message.get("body", b"")), message.get("more_body", False)
            body = str(size).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        self.port = _free_port()
        settings = {**uvicorn_settings(), "http": Short}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="off",
                                                    **settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def closed_after(self, *chunks: bytes, read_reply: bool = False) -> float:
        """Send ``chunks`` (with ``read_reply``, read the answer to the first before the rest), then seconds until
        the server closes the connection (60 if it never does)."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.settimeout(60)
            start = time.monotonic()
            for n, chunk in enumerate(chunks):
                s.sendall(chunk)
                reply = b""
                while read_reply and n == 0 and not reply.endswith(b"\r\n\r\n0"):   # the body: 0 bytes read
                    reply += s.recv(1000)
            try:
                while s.recv(1000):
                    pass
            except socket.timeout:
                return 60.0
            return time.monotonic() - start


def test_half_sent_requests_are_timed_out():
    with _Quick() as srv:
        assert srv.closed_after(b"GET / HTTP/1.1\r\nHost: x\r\n") < 5   # headers never finished
        assert srv.closed_after(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123") < 5   # body
        # a finished request is answered, and a second one half-sent on the same connection is cut off too
        assert srv.closed_after(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HT", read_reply=True) < 5
        with socket.create_connection(("127.0.0.1", srv.port)) as s:   # a slow but complete request is answered
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n01")
            time.sleep(0.2)
            s.sendall(b"23")
            reply = b""
            while not reply.endswith(b"\r\n\r\n4"):
                reply += s.recv(1000)
            assert reply.startswith(b"HTTP/1.1 200")


def test_cli_runs_uvicorn_with_the_deadlines(photo_index, monkeypatch):
    import uvicorn

    from clip_mini.cli.main import main
    from clip_mini.serve.protocol import TimedH11Protocol

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    assert main(["serve", "--index", str(photo_index), "--port", "8123"]) == 0
    assert seen["http"] is TimedH11Protocol and seen["timeout_keep_alive"] == 5 and seen["port"] == 8123


# -- uploads at the limits ------------------------------------------------------------------------------------
def _png(size, colour=(200, 30, 30), mode="RGB", **save) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG", **save)
    return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds no pixels: only a header check can answer it fast."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + data)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _upload(client, data: bytes, name: str = "q.png"):
    return client.post("/api/search/image", files={"file": (name, data, "image/png")})


def test_thin_uploads_past_the_aspect_limit_are_refused_from_the_header(photo_index):
    """The probe's uploads: a 1 x 1,000,000 PNG (4 KB) peaked at 5.6 GB, a 1 x 36,000,000 one asked for 51.5 GiB."""
    with _client(photo_index) as c:
        for data in (_png((1, 1_000_000)), _png_header_only(1, 36_000_000), _png_header_only(283_464, 127),
                     _png((127, 2541))):
            r = _upload(c, data)
            assert r.status_code == 422 and r.headers["content-type"] == "application/json", r.text
            assert "aspect ratio 20:1" in r.json()["error"] and "crop it" in r.json()["error"]
        assert _upload(c, _png((20, 400))).status_code == 200   # at the limit: served
        assert c.get("/api/info").json()["limits"]["max_upload_pixels"] == 36_000_000


def test_a_long_strip_is_reduced_along_its_length(photo_index):
    """Images whose short side was under 4x the model's input were never reduced, whatever their length."""
    from clip_mini.serve.app import ServeConfig, create_app
    from clip_mini.serve.pictures import decode_upload

    app = create_app(ServeConfig(index=str(photo_index), allowed_hosts=["testserver"], preload_attention=False))
    svc, seen = app.state.service, []
    encode = svc.engine.encode_image
    svc.engine.encode_image = lambda images: seen.extend(a.shape for a in images) or encode(images)
    size = svc.image_size
    assert not svc.keep_aspect   # the test model squashes: each axis may shrink on its own
    strip = _png((300, 6000))
    with TestClient(app) as c:
        assert _upload(c, strip).status_code == 200
    assert seen and 2 * size <= min(seen[0][:2]) and max(seen[0][:2]) < 4 * size, (seen, size)
    # a model that centre-crops needs the true proportions: one factor for both axes
    kept = decode_upload(strip, min_size=size, keep_aspect=True)
    assert kept.shape[0] == 20 * kept.shape[1] and kept.shape[1] < 300, kept.shape


def test_memory_error_while_decoding_is_413_and_the_server_goes_on(photo_index):
    from clip_mini.serve.app import ServeConfig, create_app

    app = create_app(ServeConfig(index=str(photo_index), allowed_hosts=["testserver"], preload_attention=False))
    svc = app.state.service
    encode, calls = svc.engine.encode_image, []

    def starved(images):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError()
        if len(calls) == 3:
            raise RuntimeError("a bug")
        return encode(images)

    svc.engine.encode_image = starved
    with TestClient(app, raise_server_exceptions=False) as c:
        r = _upload(c, _png((64, 64)))
        assert r.status_code == 413 and r.headers["content-type"] == "application/json"
        assert "more memory than the server has free" in r.json()["error"]
        assert _upload(c, _png((64, 64))).status_code == 200
        r = _upload(c, _png((64, 64)))   # a bug is a 500, answered in JSON like every other error
        assert r.status_code == 500 and r.json() == {"error": "internal error (RuntimeError); the server log has "
                                                              "the details"}
        assert c.get("/api/info").json()["backend"]["image_queries_in_flight"] == 0


def test_deep_or_huge_json_gets_a_json_400(photo_index):
    with _client(photo_index) as c:
        json_body = {"content-type": "application/json"}
        deep = b'{"image": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = c.post("/api/search/image", content=deep, headers=json_body)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"], r.text
        r = c.post("/api/search/image", content=b'{"image": "AAAA", "k": ' + b"9" * 5000 + b"}", headers=json_body)
        assert r.status_code == 400 and "4,300 digits" in r.json()["error"], r.text
        r = c.post("/api/search/image", content=b'{"image": "AAAA", "k": ' + b"9" * 4000 + b"}", headers=json_body)
        assert r.status_code == 400 and r.json()["error"].endswith("got a number of about 4000 digits"), r.text
        for r in (c.get("/api/search", params={"q": "red", "k": "9" * 5000}),
                  c.post("/api/search/image", params={"k": "9" * 5000}, files={"file": ("q.png", b"x", "image/png")})):
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text


def test_pictures_may_not_be_embedded_by_other_sites(photo_index):
    with _client(photo_index) as c:
        for url in ("/image/0", "/thumb/0", "/api/attention/0", "/api/explain/0?q=red"):
            r = c.get(url)
            assert r.status_code == 200 and r.headers["cross-origin-resource-policy"] == "same-origin", url


def test_tokens_no_client_can_send_are_refused_at_start(photo_index, capsys, monkeypatch):
    from clip_mini.cli.main import main
    from clip_mini.serve.server import ServeError, exposure

    monkeypatch.delenv("CLIP_MINI_TOKEN", raising=False)
    for token, why in [("é" * 20, "non-ASCII"), ("tok\x00" * 5, "non-ASCII or control"), (" " * 20, "only whitespace"),
                       (TOKEN + " ", "starts or ends with whitespace"), ("\t" + TOKEN, "non-ASCII or control")]:
        with pytest.raises(ServeError, match=why):
            exposure("0.0.0.0", token, False)
        with pytest.raises(ServeError, match=why):
            exposure("127.0.0.1", token, False)   # on loopback too: the page's login could never succeed
    assert exposure("0.0.0.0", "inner spaces are fine", False)[0] == "inner spaces are fine"
    monkeypatch.setenv("CLIP_MINI_TOKEN", " " * 20)
    assert main(["serve", "--index", str(photo_index), "--host", "0.0.0.0"]) == 2
    assert "whitespace" in capsys.readouterr().err


def test_retry_after_counts_the_time_already_spent():
    """Four slow uploads held the only image thread for 80 s while Retry-After said 2: the mean moved only when a
    call finished. A fake clock stands for a call that has run 30 s and is still running."""
    from clip_mini.serve.admission import BoundedPool, Busy

    now = [100.0]
    pool = BoundedPool(1, 2, "image", clock=lambda: now[0])
    gate = threading.Event()

    async def scenario():
        first = asyncio.ensure_future(pool.run(gate.wait, 60))
        second = asyncio.ensure_future(pool.run(lambda: None))
        while not pool._started:   # the first call is on the thread
            await asyncio.sleep(0.01)
        assert pool.retry_after() == 2   # nothing has run long yet: the first guess of 1 s a call, two calls
        now[0] += 30
        with pytest.raises(Busy) as refused:
            await pool.run(lambda: None)
        gate.set()
        await asyncio.gather(first, second)
        return refused.value.retry_after

    try:
        wait = asyncio.run(scenario())
    finally:
        pool.shutdown()
    # the running call is expected to need about as long again (30 s), the waiting one as long as it (30 s)
    assert wait == 60, wait
    assert pool.retry_after() == 1 and pool._mean_s == pytest.approx(0.8 * (0.8 + 0.2 * 30))   # the 30 s call, then 0 s


def test_one_pillow_error_ladder_for_files_and_uploads(tmp_path):
    from clip_mini.data.images import ImageError, load_image
    from clip_mini.serve.pictures import decode_upload

    data = _png((64, 64))[:-30]   # truncated inside its pixel data
    (tmp_path / "t.png").write_bytes(data)
    with pytest.raises(ImageError) as from_file:
        load_image(tmp_path / "t.png")
    with pytest.raises(ImageError) as from_upload:
        decode_upload(data, "t.png")
    assert from_file.value.reason == from_upload.value.reason and from_file.value.reason.startswith("cannot decode")


UPLOAD_RSS_SCRIPT = r"""
import json, sys, time
from pathlib import Path
from fastapi.testclient import TestClient
from clip_mini.serve.app import ServeConfig, create_app

def peak_mb():   # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking process (pytest)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) >> 10

out = []
for index in sys.argv[2:]:
    app = create_app(ServeConfig(index=index, allowed_hosts=["testserver"], preload_attention=False))
    with TestClient(app) as c:
        out.append([Path(index).name, "(started)", 200, 0.0, peak_mb()])
        for path in sorted(Path(sys.argv[1]).iterdir()):
            start = time.perf_counter()
            r = c.post("/api/search/image", files={"file": (path.name, path.read_bytes(), "image/png")})
            out.append([Path(index).name, path.name, r.status_code, round(time.perf_counter() - start, 2),
                        peak_mb()])
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc (Linux)")
def test_server_memory_stays_under_2_gb_for_any_upload_within_the_limits(tmp_path):
    """The uploads that cost the most within the caps (36 MP, 20:1, 16-bit, alpha, palette), against a 224-pixel
    model that squashes and one that centre-crops; the server process's peak RSS (VmHWM) stays <= 2 GB."""
    from PIL import Image

    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.model.onnx_export import ensure_onnx
    from conftest import TINY, make_model_dir

    indexes = []
    for mode in ("squash", "center_crop"):
        vision = {**TINY["vision"], "image_size": 224, "patch_size": 32, "resize_mode": mode}
        model = make_model_dir(tmp_path / f"model-{mode}", vision=vision)
        for tower in ("text", "image"):   # the ONNX export imports torch: here, not in the measured process
            ensure_onnx(model, tower)
        EmbeddingIndex.build(tmp_path / mode, model, write_images(tmp_path / "photos", 2), progress=False)
        indexes.append(str(tmp_path / mode))
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    (uploads / "rgb.png").write_bytes(_png((6000, 6000), compress_level=1))
    (uploads / "wide.png").write_bytes(_png((26_820, 1341), compress_level=1))        # 36.0 MP at 20:1
    (uploads / "tall.png").write_bytes(_png((447, 8940), compress_level=1))            # 20:1, short side under 2x224
    (uploads / "grey16.png").write_bytes(_png((6000, 6000), 40_000, "I;16", compress_level=1))
    (uploads / "rgba.png").write_bytes(_png((6000, 6000), (200, 30, 30, 128), "RGBA", compress_level=1))
    palette = Image.new("RGB", (6000, 6000), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE)
    palette.save(uploads / "palette.png", transparency=0, compress_level=1)
    r = subprocess.run([sys.executable, "-c", UPLOAD_RSS_SCRIPT, str(uploads), *indexes], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 14 and all(status == 200 for _, _, status, _, _ in rows), rows
    assert max(rss for *_, rss in rows) <= 2048, rows
