"""Search filters (issue 50, item 3): ``--under``, ``--glob``, ``--after``, ``--before`` on ``clip-mini search``, the
``EmbeddingIndex`` methods and ``clip-mini serve``, one implementation (``clip_mini.retrieval.filters``).

Real image files: JPEGs with an EXIF DateTimeOriginal (or only a DateTime, or damaged EXIF), PNGs dated by their
mtime; indexed with the tiny model. The filters run before the top-k and are exact (checked against brute force on
random rows with ties); an index built before dates were recorded refuses date filters with "re-index"."""
from __future__ import annotations

import calendar
import io
import json
import os
import shutil
import threading
import time
from datetime import date, datetime
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clip_mini.cli.main import main
from clip_mini.errors import DatesNotIndexedError, FilterError

# Pillow warns about the damaged EXIF it skips (one of the test photos has some, by construction).
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")
EXIF_IFD, DATETIME_ORIGINAL, DATETIME = 0x8769, 36867, 306
QUERY = "a red circle"


def _wall(dt: datetime) -> int:
    """Wall-clock seconds of a naive datetime (what the index records)."""
    return calendar.timegm(dt.timetuple())


def _pixels(i: int) -> np.ndarray:
    return np.random.default_rng(100 + i).integers(0, 256, (24, 24, 3), dtype=np.uint8)


def _jpeg(path: Path, i: int, original: datetime | None = None, plain: datetime | None = None) -> None:
    exif = Image.Exif()
    if original is not None:
        exif.get_ifd(EXIF_IFD)[DATETIME_ORIGINAL] = original.strftime("%Y:%m:%d %H:%M:%S")
    if plain is not None:
        exif[DATETIME] = plain.strftime("%Y:%m:%d %H:%M:%S")
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_pixels(i)).save(path, "JPEG", quality=95, exif=exif)


def _bad_exif_jpeg(path: Path, i: int) -> None:
    """A JPEG whose APP1 Exif segment is garbage (an IFD offset far past its end)."""
    buf = io.BytesIO()
    Image.fromarray(_pixels(i)).save(buf, "JPEG", quality=95)
    body = b"Exif\x00\x00" + b"II*\x00" + b"\xff\xff\xff\x7f" + b"\x13" * 40
    app1 = b"\xff\xe1" + (len(body) + 2).to_bytes(2, "big") + body
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data[:2] + app1 + data[2:])


def _png(path: Path, i: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_pixels(i)).save(path, "PNG")


def _set_mtime(path: Path, dt: datetime) -> None:
    t = time.mktime(dt.timetuple())   # this machine's local time: recorded back as the same wall-clock time
    os.utime(path, (t, t))


# relative path -> (taken, source); 20 images
def _layout() -> dict[str, tuple[datetime, str]]:
    out = {}
    for j in range(4):
        out[f"2023/trip/img{j}.jpg"] = (datetime(2023, 7, 1 + j, 10, 0, 0), "exif")
        out[f"2024/jan/img{j}.jpg"] = (datetime(2024, 1, 10 + j, 9, 30, 0), "exif")
        out[f"2024/summer/pic{j}.png"] = (datetime(2024, 7, 3 + j, 12, 0, 0), "mtime")
        out[f"misc/scan{j}.png"] = (datetime(2022, 2, 1 + j, 8, 0, 0), "mtime")
    out["top0.jpg"] = (datetime(2021, 5, 5, 5, 5, 5), "exif")    # DateTime (306) only: the fallback tag
    out["top1.jpg"] = (datetime(2021, 6, 1, 0, 0, 0), "mtime")   # damaged EXIF: the mtime
    out["top2.png"] = (datetime(2025, 1, 1, 0, 0, 0), "mtime")   # exactly the start of 2025
    out["top3.jpg"] = (datetime(2019, 3, 3, 3, 3, 3), "exif")
    return out


LAYOUT = _layout()


def _write_photos(folder: Path) -> None:
    for i, (rel, (when, source)) in enumerate(sorted(LAYOUT.items())):
        path = folder / rel
        if rel == "top0.jpg":
            _jpeg(path, i, plain=when)
        elif rel == "top1.jpg":
            _bad_exif_jpeg(path, i)
        elif source == "exif":
            _jpeg(path, i, original=when, plain=datetime(2000, 1, 1))   # DateTimeOriginal wins over DateTime
        else:
            _png(path, i)
        if source == "mtime":
            _set_mtime(path, when)
        else:   # a misleading mtime: the EXIF date must win
            _set_mtime(path, datetime(2030, 1, 1))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("filters") / "photos"
    _write_photos(folder)
    return folder


@pytest.fixture(scope="module")
def index_dir(model_dir, photos) -> Path:
    out = photos.parent / "index"
    assert main(["index", "--model", str(model_dir), "--images", str(photos), "--out", str(out), "--faiss", "none",
                 "--quiet"]) == 0
    return out


def _rel(index_dir: Path, paths) -> set[str]:
    root = index_dir.parent / "photos"
    return {Path(p).relative_to(root).as_posix() for p in paths}


def _search_json(capsys, index_dir: Path, *extra: str, k: int = 20) -> tuple[int, dict, str]:
    code = main(["search", "--index", str(index_dir), QUERY, "-k", str(k), "--json", *extra])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else {}), err


def _want(pred) -> set[str]:
    return {rel for rel, (when, _) in LAYOUT.items() if pred(rel, when)}


# -- what the index records ------------------------------------------------------------------------------------
def test_each_row_records_when_it_was_taken_and_from_what(index_dir):
    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(index_dir)
    assert len(index) == 20
    rel = [Path(p).relative_to(index_dir.parent / "photos").as_posix() for p in index.items["path"]]
    got = {r: (t, s) for r, t, s in zip(rel, index.items["taken"], index.items["taken_from"])}
    assert got == {r: (_wall(when), source) for r, (when, source) in LAYOUT.items()}


def test_exif_reading_never_fails_and_reads_headers_only(tmp_path):
    from clip_mini.retrieval.taken import exif_seconds, parse_exif_date

    _jpeg(tmp_path / "a.jpg", 0, original=datetime(2024, 2, 29, 23, 59, 58))
    with open(tmp_path / "a.jpg", "rb") as f:
        f.seek(17)   # wherever the caller left it
        assert exif_seconds(f) == _wall(datetime(2024, 2, 29, 23, 59, 58))
    for junk in (b"", b"\xff\xd8\xff\xe1\x00", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 30):
        assert exif_seconds(io.BytesIO(junk)) is None
    _bad_exif_jpeg(tmp_path / "b.jpg", 1)
    with open(tmp_path / "b.jpg", "rb") as f:
        assert exif_seconds(f) is None
    # a PNG whose pixels are never decoded: a truncated IDAT would fail a decode, the header read does not notice
    _png(tmp_path / "c.png", 2)
    data = (tmp_path / "c.png").read_bytes()
    assert exif_seconds(io.BytesIO(data[:-30])) is None
    assert parse_exif_date("2024:13:01 00:00:00") is None and parse_exif_date("0000:00:00 00:00:00") is None
    assert parse_exif_date("    :  :     :  :  ") is None and parse_exif_date(42) is None
    assert parse_exif_date(b"2024:01:02 03:04:05\x00") == _wall(datetime(2024, 1, 2, 3, 4, 5))
    assert parse_exif_date("2024:01:02 03:04") == _wall(datetime(2024, 1, 2, 3, 4))


# -- the command line ------------------------------------------------------------------------------------------
def test_cli_date_filters(index_dir, capsys):
    code, answer, _ = _search_json(capsys, index_dir, "--after", "2024-01-01", "--before", "2025-01-01")
    assert code == 0
    assert _rel(index_dir, [r["path"] for r in answer["results"]]) == _want(lambda r, w: w.year == 2024)
    assert answer["passing"] == 8 and answer["filters"] == {"after": "2024-01-01T00:00:00",
                                                            "before": "2025-01-01T00:00:00"}
    # the start of --before is excluded, the start of --after included
    code, answer, _ = _search_json(capsys, index_dir, "--after", "2025")
    assert _rel(index_dir, [r["path"] for r in answer["results"]]) == {"top2.png"}
    code, answer, _ = _search_json(capsys, index_dir, "--after", "2024-01-12T09:30", "--before", "2024-07")
    assert _rel(index_dir, [r["path"] for r in answer["results"]]) == {"2024/jan/img2.jpg", "2024/jan/img3.jpg"}
    code, answer, _ = _search_json(capsys, index_dir, "--before", "2021-06-01 00:00:01")
    assert _rel(index_dir, [r["path"] for r in answer["results"]]) == {"top0.jpg", "top1.jpg", "top3.jpg"}


def test_cli_folder_and_glob_filters(index_dir, capsys):
    root = index_dir.parent / "photos"
    cases = [
        (["--under", "2024"], _want(lambda r, w: r.startswith("2024/"))),
        (["--under", str(root / "2024" / "summer")], _want(lambda r, w: r.startswith("2024/summer/"))),
        (["--under", "2024/summer/pic1.png"], {"2024/summer/pic1.png"}),
        (["--under", str(root)], set(LAYOUT)),
        (["--glob", "*.jpg"], _want(lambda r, w: r.endswith(".jpg"))),               # any depth: no "/"
        (["--glob", "/*.jpg"], {"top0.jpg", "top1.jpg", "top3.jpg"}),               # anchored: * stays in a folder
        (["--glob", "2024/*"], set()),                                              # * does not cross "/"
        (["--glob", "2024/**"], _want(lambda r, w: r.startswith("2024/"))),
        (["--glob", "**/img[0-1].jpg"], {"2023/trip/img0.jpg", "2023/trip/img1.jpg", "2024/jan/img0.jpg",
                                         "2024/jan/img1.jpg"}),
        (["--glob", "2024/*/pic?.png"], _want(lambda r, w: r.startswith("2024/summer/"))),
        (["--glob", "trip/"], _want(lambda r, w: r.startswith("2023/trip/"))),
        (["--glob", "[!t]*.png"], _want(lambda r, w: r.endswith(".png") and not r.startswith("top"))),
        (["--under", "2024", "--glob", "*.png", "--after", "2024-07-05"], {"2024/summer/pic2.png",
                                                                           "2024/summer/pic3.png"}),
    ]
    for extra, want in cases:
        code, answer, err = _search_json(capsys, index_dir, *extra)
        got = _rel(index_dir, [r["path"] for r in answer.get("results", [])])
        assert got == want, extra
        assert code == (0 if want else 1), extra


def test_cli_filters_run_before_the_top_k_and_keep_the_ranking(index_dir, capsys):
    code, everything, _ = _search_json(capsys, index_dir)
    ranked = [r["path"] for r in everything["results"]]
    code, answer, err = _search_json(capsys, index_dir, "--under", "misc", "--glob", "scan[0-2].png", k=3)
    got = [r["path"] for r in answer["results"]]
    # 3 results from the 3 rows that pass, in the order the unfiltered search ranks them, with the same scores
    assert code == 0 and len(got) == 3 and got == [p for p in ranked if "/misc/scan" in p and "scan3" not in p]
    scores = {r["path"]: r["score"] for r in everything["results"]}
    assert [r["score"] for r in answer["results"]] == [scores[p] for p in got]
    code, answer, err = _search_json(capsys, index_dir, "--under", "misc", k=3)   # 4 pass, 3 asked: 3 shown
    assert len(answer["results"]) == 3 and "note" not in err
    code, answer, err = _search_json(capsys, index_dir, "--under", "misc", k=10)
    assert len(answer["results"]) == 4 and "keep 4 of the 20 images" in err


def test_cli_bad_filters_are_one_line_errors(index_dir, tmp_path, capsys):
    root = index_dir.parent / "photos"
    for extra, message in [
        (["--after", "2024-13-01"], "YYYY-MM-DDTHH:MM:SS"),
        (["--before", "last tuesday"], "is not a date: use one of YYYY, YYYY-MM, YYYY-MM-DD"),
        (["--after", "2024-06", "--before", "2024-01"], "no date lies between them"),
        (["--under", str(tmp_path)], f"lies outside the index's folder {root}"),
        (["--under", "../elsewhere"], f"lies outside the index's folder {root}"),
        (["--glob", "[abc"], "is never closed"),
    ]:
        code = main(["search", "--index", str(index_dir), QUERY, *extra])
        out, err = capsys.readouterr()
        assert code == 2 and message in err and "Traceback" not in err, (extra, err)
        assert len(err.strip().splitlines()) == 1 and not out
    # a pattern that matches nothing: no results, exit 1 (as any search with nothing to show), a note why
    code = main(["search", "--index", str(index_dir), QUERY, "--glob", "*.gif"])
    out, err = capsys.readouterr()
    assert code == 1 and "keep 0 of the 20 images" in err and f"relative to the index's folder {root}" in err
    code = main(["search", "--index", str(index_dir), QUERY, "--glob", "*.gif", "--paths"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""


# -- the Python API --------------------------------------------------------------------------------------------
def test_api_takes_the_same_filters(index_dir):
    from clip_mini.retrieval.filters import SearchFilter
    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(index_dir)
    root = index_dir.parent / "photos"
    hits = index.search_text(QUERY, k=20, after=date(2024, 1, 1), before="2025-01-01")
    assert _rel(index_dir, [p for p, _ in hits]) == _want(lambda r, w: w.year == 2024)
    hits = index.search_text(QUERY, k=20, under=Path("2023"), glob="img?.jpg")
    assert _rel(index_dir, [p for p, _ in hits]) == _want(lambda r, w: r.startswith("2023/"))
    flt = SearchFilter.of(under=root / "misc", after=datetime(2022, 2, 2, 8, 0))
    scores, ids = index.search(QUERY, k=10, filters=flt)
    assert _rel(index_dir, [index.items["path"][i] for i in ids[0]]) == {"misc/scan1.png", "misc/scan2.png",
                                                                         "misc/scan3.png"}
    assert ids.shape == (1, 3) and flt.rows(index).tolist() == sorted(ids[0].tolist())
    [found] = index.hits(texts=[QUERY], k=2, filters=flt)
    assert [h["row"] for h in found] == ids[0][:2].tolist()
    # features instead of a query: the same filters
    features = index.engine().encode_text([QUERY, "a blue square"])
    scores2, ids2 = index.search(features, k=10, filters=flt)
    assert ids2.shape == (2, 3) and ids2[0].tolist() == ids[0].tolist()
    assert index.search_image(root / "misc" / "scan1.png", k=1, glob="scan1.png")[0][0] == str(root / "misc/scan1.png")
    with pytest.raises(FilterError, match="not both"):
        index.search(QUERY, filters=flt, glob="*.jpg")
    with pytest.raises(FilterError, match="not a date"):
        index.search_text(QUERY, after="01/02/2024")
    # nothing passes: empty results, not an error
    assert index.search_text(QUERY, glob="*.tiff") == [] and index.search(QUERY, glob="*.tiff")[1].shape == (1, 0)


# -- exactness -------------------------------------------------------------------------------------------------
def _synthetic_index(path: Path, n: int, dim: int, dtype: str = "float16", seed: int = 0):
    """An index of random rows (with exact duplicates: ties), paths in 10 folders, dates over 10 years."""
    from clip_mini.retrieval.format import commit, writer_lock
    from clip_mini.retrieval.rows import encode
    from clip_mini.retrieval.reader import IndexReader

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x[n // 2: n // 2 + 40] = x[3]          # 40 exact copies of row 3: ties at whatever rank they fall
    x[7::50] = x[11]                        # and ties spread over the folders
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    paths = [f"/photos/f{i % 10}/{'sub/' if i % 3 == 0 else ''}img_{i:06d}.{'png' if i % 4 == 0 else 'jpg'}"
             for i in range(n)]
    order = sorted(range(n), key=lambda i: paths[i])   # rows sorted by path, as builds write them
    x, paths = x[order], [paths[i] for i in order]
    taken = [_wall(datetime(2015, 1, 1)) + int(s) for s in rng.integers(0, 10 * 365 * 86400, n)]
    items = {"path": paths, "size": [1] * n, "mtime_ns": [0] * n, "sha256": [f"{i:064x}" for i in range(n)],
             "caption": [""] * n, "taken": taken, "taken_from": ["exif"] * n}
    with writer_lock(path):
        np.save(path / "embeddings-1.npy", encode(x, dtype))
        commit(path, 1, items, {"model_fingerprint": "synthetic", "source": None, "shard": None, "model_dir": None},
               progress=False)
    return IndexReader.load(path)


def _brute_force(index, queries: np.ndarray, k: int, rows: np.ndarray):
    """float64 products of the rows as stored, rounded once to float32; best first, ties by row id."""
    from clip_mini.features.unit import unit_rows

    e = np.asarray(index.embeddings[rows], np.float64)
    out_s, out_i = [], []
    for q in unit_rows(np.asarray(queries, np.float32)):   # as the index scales queries
        s = (e @ q.astype(np.float64)).astype(np.float32)
        order = np.lexsort((rows, -s))[:k]
        out_s.append(s[order])
        out_i.append(rows[order])
    return np.array(out_s), np.array(out_i)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_filtered_search_is_exact_with_ties(tmp_path, monkeypatch, dtype):
    import clip_mini.retrieval.filters as F

    index = _synthetic_index(tmp_path / "idx", 3000, 32, dtype)
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((3, 32)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    stored = np.asarray(index.embeddings[:], np.float32)
    _, first, counts = np.unique(stored, axis=0, return_index=True, return_counts=True)
    queries[2] = stored[first[np.argmax(counts)]]   # a query on the row with 40 copies: ties at the top
    queries[2] /= np.linalg.norm(queries[2])
    paths = list(index.items["path"])
    taken = np.asarray(list(index.items["taken"]))
    filters = [
        (F.SearchFilter.of(under="f3"), [i for i, p in enumerate(paths) if p.startswith("/photos/f3/")]),
        (F.SearchFilter.of(glob="*.png"), [i for i, p in enumerate(paths) if p.endswith(".png")]),
        (F.SearchFilter.of(glob="f[1-2]/sub/**"), [i for i, p in enumerate(paths)
                                                   if p.startswith(("/photos/f1/sub/", "/photos/f2/sub/"))]),
        (F.SearchFilter.of(after="2019", before="2020-06"),
         np.flatnonzero((taken >= _wall(datetime(2019, 1, 1))) & (taken < _wall(datetime(2020, 6, 1)))).tolist()),
        (F.SearchFilter.of(under="f5", glob="*.jpg", after="2018-03-15"),
         [i for i, p in enumerate(paths) if p.startswith("/photos/f5/") and p.endswith(".jpg")
          and taken[i] >= _wall(datetime(2018, 3, 15))]),
    ]
    for block in (None, 1024 * 2 * 32):   # the default block, and blocks of 1,024 rows (several merged)
        if block:
            monkeypatch.setattr(F, "_GATHER_BYTES", block)
        for flt, want_rows in filters:
            index.__dict__.pop("_filter_rows", None)
            rows = flt.rows(index)
            assert rows.tolist() == sorted(want_rows), flt
            for k in (1, 10, 57, len(rows) + 5):
                scores, ids = F.search(index, queries, k, flt)
                want_s, want_i = _brute_force(index, queries, k, np.asarray(sorted(want_rows)))
                assert ids.tolist() == want_i.tolist(), (flt, k)
                np.testing.assert_array_equal(scores, want_s)
    # filtering keeps the order an unfiltered search gives: the same ids among the kept rows, ties by row id
    full_s, full_i = index.search(queries, k=3000, backend="exact")
    keep = set(filters[0][1])
    _, ids = F.search(index, queries, 3000, filters[0][0])
    assert ids.tolist() == [[i for i in row if i in keep] for row in full_i.tolist()]


def test_a_contiguous_folder_is_searched_in_place(tmp_path, monkeypatch):
    """The rows of one folder of a path-sorted index are a run: searched as a view of the memory map (no gather)."""
    import clip_mini.retrieval.filters as F

    index = _synthetic_index(tmp_path / "idx", 2000, 16)
    rows = F.SearchFilter.of(under="f4").rows(index)
    assert rows[-1] - rows[0] + 1 == len(rows)   # sorted by path: one run
    seen = []
    real = F._gather

    def spy(embeddings, ids):
        block = real(embeddings, ids)
        seen.append(np.shares_memory(block, np.asarray(index.embeddings)))
        return block

    monkeypatch.setattr(F, "_gather", spy)
    q = np.ones((1, 16), np.float32) / 4
    F.search(index, q, 5, F.SearchFilter.of(under="f4"))
    F.search(index, q, 5, F.SearchFilter.of(glob="*.png"))
    assert seen == [True, False]


def test_kept_rows_are_cached_within_bounds(tmp_path, monkeypatch):
    import clip_mini.retrieval.filters as F

    index = _synthetic_index(tmp_path / "idx", 1000, 8)
    a, b = F.SearchFilter.of(glob="*.png"), F.SearchFilter.of(under="f1")
    assert a.rows(index) is a.rows(index) and F.SearchFilter.of(glob="*.png").rows(index) is a.rows(index)
    assert not a.rows(index).flags.writeable
    monkeypatch.setattr(F, "_CACHE_BYTES", a.rows(index).nbytes + 8)   # room for one of them
    b.rows(index)
    assert list(index.__dict__["_filter_rows"]) == [b]
    monkeypatch.setattr(F, "_CACHE_BYTES", 1 << 30)
    monkeypatch.setattr(F, "_CACHE", 3)
    for month in range(1, 7):
        F.SearchFilter.of(after=f"2016-{month:02d}").rows(index)
    assert len(index.__dict__["_filter_rows"]) == 3


def test_glob_on_names_that_are_not_ascii_or_not_utf8():
    from clip_mini.retrieval.filters import _PathTable

    names = ["été/ça.jpg", "été/b.png", "日本/写真.jpg", "x/naïve?.jpg", os.fsdecode(b"caf\xe9/latin1.jpg"), "a.jpg"]
    enc = [n.encode("utf-8", "surrogateescape") for n in names]
    off = np.zeros(len(enc) + 1, np.int64)
    np.cumsum([len(b) for b in enc], out=off[1:])
    blob = np.frombuffer(b"".join(enc), np.uint8)
    all_rows = np.arange(len(names))
    for table, rows in ((_PathTable("/r", off, blob), all_rows),
                        (_PathTable("/r", off[:5], blob[:off[4]]), all_rows[:4])):   # valid UTF-8: one scan
        def match(pattern):
            return [names[i] for i in rows[table.glob_mask(pattern, rows)]]

        assert match("*.jpg") == [n for n in names[:len(rows)] if n.endswith(".jpg")]
        # ? is one character, however many bytes it takes
        assert match("été/?a.jpg") == ["été/ça.jpg"] and match("???/*") == ["été/ça.jpg", "été/b.png"]
        assert match("??/*") == match("写?.jpg") == ["日本/写真.jpg"]
        assert match("naïve[?].jpg") == ["x/naïve?.jpg"]
        assert table.under_mask("été").tolist()[:3] == [True, True, False]
    assert _PathTable("/r", off, blob).under_mask(os.fsdecode(b"caf\xe9")).tolist() == [False] * 4 + [True, False]


def test_glob_shortcuts_agree_with_the_pattern_language():
    """``*.jpg``, ``name.jpg`` and ``folder/**`` skip the regular expression: the same rows as matching it (and as
    fnmatch would, where the two languages agree), on awkward paths."""
    import fnmatch
    import re

    from clip_mini.retrieval.filters import _PathTable, glob_regex

    names = ["a.jpg", "x/a.jpg", "x/ba.jpg", "x/a.jpg/b.png", "2024", "2024/x.jpg", "2024/t/y.jpg", "2024b/z.jpg",
             "x/2024/q.jpg", "jpg", ".jpg", "x/.jpg", "é/a.jpg", "a.jpgx", "x/y/2024/trip/k.png"]
    enc = [n.encode() for n in names]
    off = np.zeros(len(enc) + 1, np.int64)
    np.cumsum([len(b) for b in enc], out=off[1:])
    table = _PathTable("/r", off, np.frombuffer(b"".join(enc), np.uint8))
    rows = np.arange(len(names))
    for pattern in ["*.jpg", "*a.jpg", "*", "a.jpg", "jpg", ".jpg", "2024", "2024/**", "/2024/**", "2024/", "/2024/",
                    "2024/t/**", "x/**", "trip/", "*.png", "2024/*", "é/**"]:
        fast = table._literal_glob(pattern, rows)
        rx = re.compile(glob_regex(pattern))
        want = [rx.fullmatch(n) is not None for n in names]
        assert table.glob_mask(pattern, rows).tolist() == want, pattern
        if fast is not None:
            assert fast.tolist() == want, pattern
        sub = rows[::2]   # a subset of rows, as after another filter
        assert table.glob_mask(pattern, sub).tolist() == want[::2], pattern
    assert table._literal_glob("*.jpg", rows) is not None and table._literal_glob("2024/**", rows) is not None
    # where fnmatch and the pattern language agree: names with no "/" in them, patterns without "/"
    flat = [n for n in names if "/" not in n]
    for pattern in ["*.jpg", "?.jpg", "[a-z].jpg", "[!a].jpg", "*"]:
        rx = re.compile(glob_regex(pattern))
        assert [rx.fullmatch(n) is not None for n in flat] == [fnmatch.fnmatchcase(n, pattern) for n in flat]


def test_dates_parse_in_the_documented_formats():
    from clip_mini.retrieval.filters import DATE_FORMATS, parse_date

    assert parse_date("2024") == _wall(datetime(2024, 1, 1))
    assert parse_date("2024-06") == _wall(datetime(2024, 6, 1))
    assert parse_date(" 2024-06-30 ") == _wall(datetime(2024, 6, 30))
    assert parse_date("2024-06-30T18:30") == parse_date("2024-06-30 18:30") == _wall(datetime(2024, 6, 30, 18, 30))
    assert parse_date("2024-06-30T18:30:15") == _wall(datetime(2024, 6, 30, 18, 30, 15))
    assert parse_date(date(2024, 6, 30)) == _wall(datetime(2024, 6, 30))
    assert parse_date(None) is None and parse_date("") is None
    for bad in ("2024-02-30", "24-06-30", "2024/06/30", "June 2024", "2024-06-30T25:00", "2024-06-30T18"):
        with pytest.raises(FilterError) as e:
            parse_date(bad, "after")
        assert all(f in str(e.value) for f in DATE_FORMATS) and repr(bad) in str(e.value)
    with pytest.raises(FilterError, match="date string or a datetime.date"):
        parse_date(1719770400, "before")


# -- an index built before dates were recorded -----------------------------------------------------------------
def _without_dates(index_dir: Path, out: Path) -> Path:
    """A copy of the index whose current generation has no date columns (what an older clip-mini wrote)."""
    from clip_mini.retrieval.format import ITEM_COLUMNS, commit, current_generation, writer_lock
    from clip_mini.retrieval.reader import IndexReader

    shutil.copytree(index_dir, out)
    old = IndexReader.load(out)
    items = {c: list(old.items[c]) for c in ITEM_COLUMNS}
    meta = {k: old.manifest[k] for k in ("model_fingerprint", "source", "shard", "model_dir")}
    with writer_lock(out):
        gen = current_generation(out) + 1
        shutil.copy(out / old.manifest["files"]["embeddings"], out / f"embeddings-{gen}.npy")
        commit(out, gen, items, meta, progress=False)
    return out


def test_an_index_without_dates_asks_for_a_reindex_and_takes_the_other_filters(index_dir, model_dir, photos,
                                                                               tmp_path, capsys):
    from clip_mini.retrieval.index import EmbeddingIndex

    old_dir = _without_dates(index_dir, tmp_path / "old")
    index = EmbeddingIndex.load(old_dir)
    assert "taken" not in index.items
    with pytest.raises(DatesNotIndexedError, match="re-index to filter by date"):
        index.search_text(QUERY, after="2024")
    code = main(["search", "--index", str(old_dir), QUERY, "--before", "2024"])
    out, err = capsys.readouterr()
    assert code == 2 and "re-index to filter by date" in err and "Traceback" not in err
    assert _rel(index_dir, [p for p, _ in index.search_text(QUERY, k=20, glob="*.png", under="misc")]) == \
        _want(lambda r, w: r.startswith("misc/"))
    # re-indexing records the dates, reusing every embedding (nothing is embedded again)
    before = np.asarray(index.embeddings).copy()
    assert main(["index", "--model", str(model_dir), "--images", str(photos), "--out", str(old_dir), "--faiss",
                 "none", "--quiet"]) == 0
    capsys.readouterr()
    again = EmbeddingIndex.load(old_dir)
    np.testing.assert_array_equal(np.asarray(again.embeddings), before)
    assert list(again.items["taken"]) == list(EmbeddingIndex.load(index_dir).items["taken"])
    assert _rel(index_dir, [p for p, _ in again.search_text(QUERY, k=20, after="2024", before="2025")]) == \
        _want(lambda r, w: w.year == 2024)


def test_adding_and_merging_keep_the_dates(index_dir, model_dir, photos, tmp_path):
    from clip_mini.retrieval.index import EmbeddingIndex

    # an unchanged re-index is a no-op (the dates are part of what "unchanged" compares)
    gen = EmbeddingIndex.load(index_dir).manifest["generation"]
    assert main(["index", "--model", str(model_dir), "--images", str(photos), "--out", str(index_dir), "--faiss",
                 "none", "--quiet"]) == 0
    assert EmbeddingIndex.load(index_dir).manifest["generation"] == gen
    # sharded builds merged: the same dates as one pass
    for s in ("0/2", "1/2"):
        assert main(["index", "--model", str(model_dir), "--images", str(photos), "--out", str(tmp_path / "sh"),
                     "--shard", s, "--faiss", "none", "--quiet"]) == 0
    assert main(["index", "--out", str(tmp_path / "sh"), "--merge", "--faiss", "none", "--quiet"]) == 0
    one, merged = EmbeddingIndex.load(index_dir), EmbeddingIndex.load(tmp_path / "sh")
    for c in ("path", "taken", "taken_from"):
        assert list(merged.items[c]) == list(one.items[c])
    # a touched file (same bytes, new mtime): an EXIF date stays, an mtime date follows the file
    shutil.copytree(photos, tmp_path / "p2")
    shutil.copytree(index_dir, tmp_path / "i2")
    _set_mtime(tmp_path / "p2" / "2024/jan/img0.jpg", datetime(2031, 1, 1))
    _set_mtime(tmp_path / "p2" / "misc/scan0.png", datetime(2031, 1, 1))
    for rel in LAYOUT:   # copytree kept the mtimes (copy2); the folder moved, so paths changed: all re-hashed
        assert (tmp_path / "p2" / rel).is_file()
    idx = EmbeddingIndex.build(tmp_path / "i2", model_dir, tmp_path / "p2", progress=False)
    got = dict(zip([Path(p).relative_to(tmp_path / "p2").as_posix() for p in idx.items["path"]],
                   idx.items["taken"]))
    assert got["2024/jan/img0.jpg"] == _wall(datetime(2024, 1, 10, 9, 30))
    assert got["misc/scan0.png"] == _wall(datetime(2031, 1, 1))
    assert got["misc/scan1.png"] == _wall(datetime(2022, 2, 2, 8, 0))


# -- clip-mini serve -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(index_dir):
    pytest.importorskip("fastapi", reason="clip-mini serve needs the serve extra: pip install -e '.[serve]'")
    pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (test extra)")
    from fastapi.testclient import TestClient

    from clip_mini.serve.app import ServeConfig, create_app

    with TestClient(create_app(ServeConfig(index=str(index_dir), allowed_hosts=["testserver"],
                                           preload_attention=False))) as c:
        yield c


def test_server_filters_text_and_image_queries(client, index_dir):
    import base64

    from clip_mini.retrieval.index import EmbeddingIndex

    index = EmbeddingIndex.load(index_dir)
    for params, filters in [({"after": "2024-01-01", "before": "2025-01-01"}, {"after": "2024", "before": "2025"}),
                            ({"under": "2024/summer"}, {"under": "2024/summer"}),
                            ({"glob": "*.jpg", "after": "2023-07-02"}, {"glob": "*.jpg", "after": "2023-07-02"})]:
        r = client.get("/api/search", params={"q": QUERY, "k": 5, **params})
        assert r.status_code == 200, r.text
        answer = r.json()
        scores, ids = index.search(QUERY, k=5, **filters)
        assert [h["id"] for h in answer["results"]] == ids[0].tolist()
        np.testing.assert_allclose([h["score"] for h in answer["results"]], scores[0], atol=1e-5)
        assert answer["passing"] == len(index.search(QUERY, k=20, **filters)[1][0])
        assert set(answer["filters"]) == set(params)
    # paths in answers are relative to the image folder, as the filters are
    r = client.get("/api/search", params={"q": QUERY, "k": 10, "under": "misc"}).json()
    assert {h["path"] for h in r["results"]} == _want(lambda p, w: p.startswith("misc/"))
    # nothing passes: an empty answer, not an error
    r = client.get("/api/search", params={"q": QUERY, "glob": "*.gif"})
    assert r.status_code == 200 and r.json()["results"] == [] and r.json()["passing"] == 0
    # image queries: filters in the query string, or as JSON fields
    png = (index_dir.parent / "photos" / "misc" / "scan2.png").read_bytes()
    r = client.post("/api/search/image", params={"k": 3, "under": "misc"},
                    files={"file": ("q.png", png, "image/png")})
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["path"] == "misc/scan2.png" and len(r.json()["results"]) == 3
    assert all(h["path"].startswith("misc/") for h in r.json()["results"])
    body = {"image": base64.b64encode(png).decode(), "k": 4, "before": "2022-02-03", "under": "misc"}
    r = client.post("/api/search/image", params={"under": "2024", "glob": "*.png"}, json=body)   # the body wins
    assert r.status_code == 200, r.text
    assert {h["path"] for h in r.json()["results"]} == {"misc/scan0.png", "misc/scan1.png"}
    assert r.json()["filters"] == {"under": "misc", "glob": "*.png", "before": "2022-02-03T00:00:00"}


def test_server_filter_errors_are_400s_naming_no_server_path(client, index_dir):
    root = str(index_dir.parent / "photos")
    for params, message in [({"after": "2024-31-01"}, "YYYY-MM-DD"),
                            ({"under": "../../etc"}, "lies outside the index's folder"),
                            ({"under": root}, "relative to the index's image folder"),
                            ({"glob": "[x"}, "never closed"),
                            ({"before": "2020", "after": "2021"}, "no date lies between")]:
        r = client.get("/api/search", params={"q": QUERY, **params})
        assert r.status_code == 400 and message in r.json()["error"], (params, r.text)
        if root not in params.values():   # (an error may repeat what the client sent)
            assert root not in r.json()["error"] and str(index_dir) not in r.json()["error"]
    png = (index_dir.parent / "photos" / "misc" / "scan2.png").read_bytes()
    r = client.post("/api/search/image", params={"after": "soon"}, files={"file": ("q.png", png, "image/png")})
    assert r.status_code == 400 and "is not a date" in r.json()["error"]


def test_server_without_dates_says_reindex(index_dir, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from clip_mini.serve.app import ServeConfig, create_app

    old_dir = _without_dates(index_dir, tmp_path / "old")
    with TestClient(create_app(ServeConfig(index=str(old_dir), allowed_hosts=["testserver"],
                                           preload_attention=False))) as c:
        r = c.get("/api/search", params={"q": QUERY, "after": "2024"})
        assert r.status_code == 400 and "re-index to filter by date" in r.json()["error"]
        assert str(tmp_path) not in r.json()["error"]
        assert c.get("/api/search", params={"q": QUERY, "under": "misc"}).status_code == 200


def test_batcher_searches_each_filter_on_its_own(index_dir):
    """Queries with different filters in one batch: each answered with its own filter, as if alone."""
    from clip_mini.retrieval.filters import SearchFilter
    from clip_mini.retrieval.index import EmbeddingIndex
    from clip_mini.serve.batching import SearchBatcher
    from clip_mini.serve.generations import IndexWatcher

    gen = IndexWatcher(index_dir, EmbeddingIndex.load(index_dir).fingerprint).current
    gate, calls = threading.Event(), []

    def search(g, queries, k, where=None):
        calls.append((len(queries), where))
        if len(calls) == 1:
            gate.wait(60)   # hold the first batch so the others queue up behind it
        return g.search(queries, k, where)

    batcher = SearchBatcher(lambda: gen, search)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, gen.index.dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)   # the server's queries are unit rows
    filters = [None, None, SearchFilter.of(under="misc"), SearchFilter.of(under="misc"), SearchFilter.of(glob="*.jpg")]
    futures = [batcher.submit(q[0], 3)]
    while not calls:
        time.sleep(0.01)
    futures += [batcher.submit(q[i], 5, filters[i]) for i in range(1, 5)]
    while batcher._queue.qsize() < 4:
        time.sleep(0.01)
    gate.set()
    answers = [f.result(timeout=60) for f in futures]
    # one batch of four: three searches, one per distinct filter
    assert sorted((n, str(w)) for n, w in calls[1:]) == sorted([(1, "None"), (2, str(filters[2])),
                                                              (1, str(filters[4]))])
    for qi, k, where, (g, scores, ids) in zip(q, [3, 5, 5, 5, 5], filters, answers):
        want_s, want_i = gen.index.search(qi[None], k, filters=where)
        assert ids.tolist() == want_i[0].tolist()
        np.testing.assert_allclose(scores, want_s[0], atol=1e-6)


# -- the search page -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_page_filter_boxes_in_chromium(index_dir):
    """The page's folder-or-pattern box and date inputs reach the API as under / glob / after, are named in the
    status, and survive a reload of the shared link (headless chromium, as ``test_serve_browser``)."""
    from test_serve_browser import CHROMEDRIVER, CHROMIUM, _serve

    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (test extra)")
    import httpx
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(arg)
    try:
        browser = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    except Exception as e:   # a chromium that cannot start here is no test failure
        pytest.skip(f"headless chromium did not start: {type(e).__name__}: {str(e)[:300]}")
    server = _serve(index_dir, {})
    try:
        url = next(server)
        wait = WebDriverWait(browser, 120)
        browser.get(url + "/")

        def shown() -> list[str]:
            return [h.get_attribute("data-path") for h in browser.find_elements(By.CSS_SELECTOR, "#results a.hit")]

        browser.find_element(By.ID, "where").send_keys("2024/**")
        browser.execute_script("document.getElementById('after').value = '2024-07-04'")   # typing dates is locale-bound
        browser.find_element(By.ID, "q").send_keys(QUERY, Keys.ENTER)
        wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query")
                   == f"“{QUERY}” matching 2024/** taken after 2024-07-04")
        api = httpx.get(f"{url}/api/search", params={"q": QUERY, "k": 24, "glob": "2024/**", "after": "2024-07-04"},
                        timeout=60).json()
        assert shown() == [r["path"] for r in api["results"]]
        assert set(shown()) == {"2024/summer/pic1.png", "2024/summer/pic2.png", "2024/summer/pic3.png"}
        assert "glob=2024" in browser.current_url and "after=2024-07-04" in browser.current_url
        # a folder (no * ? [) is sent as `under`; a shared link restores the boxes and runs the search
        where = browser.find_element(By.ID, "where")
        where.clear()
        where.send_keys("misc")
        browser.execute_script("document.getElementById('after').value = ''")
        browser.find_element(By.ID, "q").send_keys(Keys.ENTER)
        wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}” in misc")
        assert sorted(shown()) == [f"misc/scan{j}.png" for j in range(4)] and "under=misc" in browser.current_url
        browser.get(browser.current_url)
        wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-query") == f"“{QUERY}” in misc")
        assert browser.find_element(By.ID, "where").get_attribute("value") == "misc"
        # a bad filter: the server's message in the status line
        browser.execute_script("document.getElementById('before').value = '2020-01-01';"
                               "document.getElementById('after').value = '2021-01-01'")
        browser.find_element(By.ID, "q").send_keys(Keys.ENTER)
        wait.until(lambda d: "no date lies between" in d.find_element(By.ID, "status").text)
    finally:
        browser.quit()
        server.close()
