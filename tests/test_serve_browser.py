"""The search page in a real browser: Debian's headless chromium driven through selenium and chromium-driver, against
`clip-mini serve` running as its own process on a free loopback port.

Needs `apt-get install -y chromium chromium-driver` (`.ci/run` installs them when it runs as root) and selenium (test
extra); skipped with the reason otherwise. Nothing downloads a browser: selenium is given both executables.
"""
from __future__ import annotations

import csv
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
QUERY, COLOUR, SHAPE = "a large red circle", "red", "circle"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs Debian's chromium and chromium-driver: apt-get install -y chromium "
                              "chromium-driver (as root; .ci/run does it)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _labels(shapes_dir: Path) -> dict[str, dict]:
    with open(shapes_dir / "labels.csv", newline="") as f:
        return {r["image"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def photos(heldout_images, shapes_dir, tmp_path_factory) -> tuple[Path, Path]:
    """48 held-out shapes images (none seen in training): one large red circle alone, and 47 with nothing red.

    The expected top result for "a large red circle" is then one image, by construction, and the margin is wide
    (a red circle against images without red: 0.97 vs 0.63 cosine with the fixture model).
    """
    labels = _labels(shapes_dir)
    names = sorted(p.name for p in heldout_images.iterdir())
    target = next(n for n in names if labels[n]["n_objects"] == "1" and labels[n]["size"] == "large"
                  and (labels[n]["colour"], labels[n]["shape"]) == (COLOUR, SHAPE))
    others = [n for n in names if COLOUR not in (labels[n]["colour"], labels[n]["colour2"])][:47]
    folder = tmp_path_factory.mktemp("browser") / "photos"
    folder.mkdir()
    for n in [target, *others]:
        shutil.copy2(heldout_images / n, folder / n)
    return folder, folder / target


TOKEN = "browser-test-token-0123456789"


@pytest.fixture(scope="module")
def index(trained_model_dir, photos, tmp_path_factory) -> Path:
    from clip_mini.retrieval.index import EmbeddingIndex

    index = tmp_path_factory.mktemp("browser") / "index"
    EmbeddingIndex.build(index, trained_model_dir, photos[0], progress=False)
    return index


@pytest.fixture(scope="module")
def server(index):
    yield from _serve(index, {})


@pytest.fixture(scope="module")
def token_server(index):
    yield from _serve(index, {"CLIP_MINI_TOKEN": TOKEN})


def _serve(index: Path, env: dict):
    """`clip-mini serve` over ``index``, as its own process."""
    pytest.importorskip("fastapi", reason="clip-mini serve needs the serve extra: pip install -e '.[serve]'")
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clip_mini", "serve", "--index", str(index), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300   # a loaded machine can take minutes to start it
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                pytest.fail(f"clip-mini serve exited: {proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("clip-mini serve did not answer /healthz within 300 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (test extra)")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")   # selenium-manager must never fetch a driver or browser
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    except Exception as e:   # a chromium that cannot start here (no /dev/shm, missing libraries) is no test failure
        pytest.skip(f"headless chromium did not start: {type(e).__name__}: {str(e)[:300]}")
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


def test_search_page_in_chromium(server, browser, photos, tmp_path):
    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120)
    browser.get(server + "/")
    assert browser.title == "clip-mini search"
    # the search box has focus on load: type and press Enter
    assert browser.switch_to.active_element.get_attribute("id") == "q"
    browser.switch_to.active_element.send_keys(QUERY, Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}”")
    hits = browser.find_elements(By.CSS_SELECTOR, "#results a.hit")
    api = httpx.get(f"{server}/api/search", params={"q": QUERY, "k": 24}, timeout=60).json()
    assert len(hits) == 24 and [h.get_attribute("data-path") for h in hits] == [r["path"] for r in api["results"]]
    top = hits[0].get_attribute("data-path")   # relative to the indexed folder
    assert top == photos[1].name, f"top result {top}, expected the only {COLOUR} {SHAPE} {photos[1]}"
    assert "#1" in hits[0].text and f"{api['results'][0]['score']:.3f}" in hits[0].text
    wait.until(lambda d: d.execute_script(
        "return [...document.querySelectorAll('#results img')].slice(0, 8)"
        ".every(i => i.complete && i.naturalWidth > 0)"))
    assert "24 results" in browser.find_element(By.ID, "status").text

    # keyboard: down from the box to the first result, Enter opens it with its attention map, Esc closes
    browser.find_element(By.ID, "q").send_keys(Keys.ARROW_DOWN)
    assert browser.switch_to.active_element.get_attribute("data-rank") == "1"
    browser.switch_to.active_element.send_keys(Keys.ARROW_RIGHT)
    assert browser.switch_to.active_element.get_attribute("data-rank") == "2"
    browser.switch_to.active_element.send_keys(Keys.ARROW_LEFT, Keys.ENTER)
    wait.until(lambda d: d.execute_script(
        "const v = document.getElementById('viewer'), a = document.getElementById('viewer-attention'),"
        " o = document.getElementById('viewer-image');"
        "return v.open && a.complete && a.naturalWidth > 0 && o.complete && o.naturalWidth > 0"))
    assert Path(top).name in browser.find_element(By.ID, "viewer-title").text
    browser.save_screenshot(str(tmp_path / "viewer.png"))
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)
    wait.until(lambda d: not d.execute_script("return document.getElementById('viewer').open"))

    # image search: choose a file (what a drop does too); the indexed image itself comes first
    query_image = api["results"][5]["path"]
    browser.find_element(By.ID, "image-file").send_keys(str(photos[0] / query_image))
    wait.until(lambda d: (d.find_element(By.ID, "results").get_attribute("data-query") or "").startswith("image "))
    first = browser.find_element(By.CSS_SELECTOR, "#results a.hit")
    assert first.get_attribute("data-path") == query_image and "1.000" in first.text
    assert browser.find_element(By.ID, "query-preview").is_displayed()

    # the "without" box: sent as the API's `without` term, named in the status
    browser.find_element(By.ID, "without").send_keys("red")
    browser.find_element(By.ID, "q").send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}” without “red”")
    minus = httpx.get(f"{server}/api/search", params={"q": QUERY, "without": "red", "k": 24}, timeout=60).json()
    hits = browser.find_elements(By.CSS_SELECTOR, "#results a.hit")
    assert [h.get_attribute("data-path") for h in hits] == [r["path"] for r in minus["results"]]
    assert minus["without"] == ["red"] and "without=red" in browser.current_url

    # everything the page loaded came from this server
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(u.startswith(server + "/") for u in loaded), loaded
    shot = tmp_path / "search.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"screenshots: {shot}, {tmp_path / 'viewer.png'}")


def test_why_this_match_in_chromium(server, browser, photos, tmp_path):
    """The "why this match" box: ticked, each result shows the match map of the query over it (/api/explain, the
    same picture the API answers); unticked, the thumbnails again. A query it cannot explain (a "without" term, an
    image) disables it with a tooltip saying why, and the next plain text query brings the maps back."""
    import io
    from urllib.parse import parse_qs, urlsplit

    import httpx
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120)
    srcs = "return [...document.querySelectorAll('#results img')].map(i => i.getAttribute('src'))"
    loaded = ("return [...document.querySelectorAll('#results img')].slice(0, 8)"
              ".every(i => i.complete && i.naturalWidth > 0 && i.getAttribute('src').startsWith(arguments[0]))")
    browser.get(server + "/")
    box = browser.find_element(By.ID, "explain")
    assert not box.is_enabled()   # nothing to explain yet
    browser.find_element(By.ID, "q").send_keys(QUERY, Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}”")
    wait.until(lambda d: d.execute_script(loaded, "/thumb/"))
    assert box.is_enabled() and not box.is_selected() and "where each result matches" in box.get_attribute("title")

    box.click()   # on: every result's picture is its match map
    wait.until(lambda d: all(s.startswith("/api/explain/") for s in d.execute_script(srcs)))
    wait.until(lambda d: d.execute_script(loaded, "/api/explain/"))
    api = httpx.get(f"{server}/api/search", params={"q": QUERY, "k": 24}, timeout=60).json()
    shown = browser.execute_script(srcs)
    assert [urlsplit(s).path for s in shown] == [f"/api/explain/{h['id']}" for h in api["results"]]
    assert all(parse_qs(urlsplit(s).query) == {"q": [QUERY], "gen": [str(api["generation"])]} for s in shown)
    first = httpx.get(server + shown[0], timeout=120)
    assert first.status_code == 200 and first.headers["content-type"] == "image/png"
    width = browser.execute_script("return document.querySelector('#results img').naturalWidth")
    assert width == Image.open(io.BytesIO(first.content)).width
    shot = tmp_path / "why-this-match.png"
    assert browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")

    box.click()   # off: the thumbnails again
    wait.until(lambda d: all(s.startswith("/thumb/") for s in d.execute_script(srcs)))
    wait.until(lambda d: d.execute_script(loaded, "/thumb/"))
    box.click()

    # a "without" term: no single caption to explain; the box is disabled and says why, the thumbnails are shown
    browser.find_element(By.ID, "without").send_keys("red")
    browser.find_element(By.ID, "q").send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}” without “red”")
    assert not box.is_enabled() and not box.is_selected()
    assert "single text query" in box.get_attribute("title")
    assert "single text query" in browser.find_element(By.ID, "explain-label").get_attribute("title")
    assert all(s.startswith("/thumb/") for s in browser.execute_script(srcs))
    # an image query: the same
    browser.find_element(By.ID, "image-file").send_keys(str(photos[0] / api["results"][3]["path"]))
    wait.until(lambda d: (d.find_element(By.ID, "results").get_attribute("data-query") or "").startswith("image "))
    assert not box.is_enabled() and not box.is_selected() and "single text query" in box.get_attribute("title")
    assert all(s.startswith("/thumb/") for s in browser.execute_script(srcs))
    # the plain text query again: the box comes back ticked, with the maps
    browser.find_element(By.ID, "without").clear()
    browser.find_element(By.ID, "q").send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}”")
    assert box.is_enabled() and box.is_selected()
    wait.until(lambda d: d.execute_script(loaded, "/api/explain/"))


def test_login_page_in_chromium(token_server, browser):
    """With a token, the page sends the browser to the login form; the right token opens the search page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120)
    browser.delete_all_cookies()
    browser.get(token_server + "/")
    wait.until(lambda d: d.title == "clip-mini: log in")
    assert browser.current_url == token_server + "/login"
    assert not browser.find_element(By.ID, "status").is_displayed()
    browser.find_element(By.ID, "token").send_keys("not-the-right-token-at-all", Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "status").is_displayed())
    browser.find_element(By.ID, "token").send_keys(TOKEN, Keys.ENTER)
    wait.until(lambda d: d.title == "clip-mini search")
    assert browser.execute_script("return document.cookie") == ""   # HttpOnly: no script can read the login
    browser.switch_to.active_element.send_keys(QUERY, Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}”")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#results a.hit")) == 24
    wait.until(lambda d: d.execute_script(
        "return [...document.querySelectorAll('#results img')].slice(0, 4)"
        ".every(i => i.complete && i.naturalWidth > 0)"))   # thumbnails load with the cookie too
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(u.startswith(token_server + "/") for u in loaded), loaded
