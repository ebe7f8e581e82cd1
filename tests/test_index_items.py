"""The columnar items table (format version 4): round trip of every column kind, paths that are not UTF-8, rows
read lazily from the memory map, a root joined to relative paths, and damaged files refused naming the file."""
import os

import numpy as np
import pytest

from clip_mini.retrieval import format as F
from clip_mini.retrieval.items import ItemsFormatError, StrColumn, read_items, write_items

NAMES = F.ITEM_COLUMNS + F.WDS_COLUMNS


def _items(n: int) -> dict:
    odd = os.fsdecode(b"caf\xe9-latin1.jpg")   # a file name that is not UTF-8 (surrogate-escaped)
    return {"path": [f"a/{i:05d}.jpg" if i % 7 else odd for i in range(n)],
            "size": [i * 1000 for i in range(n)], "mtime_ns": [2 ** 62 + i for i in range(n)],
            "sha256": [f"{i:064x}" for i in range(n)],
            "caption": ["", "a dog, \"quoted\"\nand a newline", "çé"] * (n // 3) + [""] * (n % 3),
            "shard": ["/data/s-000.tar"] * n, "key": [str(i) for i in range(n)], "offset": list(range(n)),
            "length": [512] * n}


def test_round_trip_every_column(tmp_path, monkeypatch):
    import clip_mini.retrieval.items as I

    monkeypatch.setattr(I, "_CHUNK", 64)   # several encoding / decoding chunks
    items = _items(1000)
    write_items(tmp_path / "items-1.cols", items, NAMES)
    cols = read_items(tmp_path / "items-1.cols")
    assert set(cols) == set(NAMES)
    for c in NAMES:
        assert len(cols[c]) == 1000
        assert list(cols[c]) == items[c]              # iteration, chunk by chunk
        assert cols[c] == items[c] and items[c] == cols[c]   # compared with the lists of the CSV format
        assert [cols[c][i] for i in (0, 7, 999, -1)] == [items[c][i] for i in (0, 7, 999, -1)]
        assert cols[c][5:9] == items[c][5:9]
    assert isinstance(cols["size"][3], int) and cols["mtime_ns"][1] == 2 ** 62 + 1
    with pytest.raises(IndexError):
        cols["path"][1000]
    empty = {c: [] for c in NAMES}
    write_items(tmp_path / "empty.cols", empty, NAMES)
    assert all(len(v) == 0 for v in read_items(tmp_path / "empty.cols").values())


def test_root_is_joined_to_relative_paths(tmp_path):
    items = {c: v[:4] for c, v in _items(4).items()}
    items["path"] = ["x/1.jpg", "../outside.jpg", "2.jpg", "/abs/3.jpg"]
    write_items(tmp_path / "i.cols", items, F.ITEM_COLUMNS)
    cols = read_items(tmp_path / "i.cols", root=str(tmp_path / "photos"))
    assert list(cols["path"]) == [str(tmp_path / "photos" / "x" / "1.jpg"), str(tmp_path / "outside.jpg"),
                                  str(tmp_path / "photos" / "2.jpg"), "/abs/3.jpg"]
    assert isinstance(cols["path"], StrColumn) and cols["sha256"][0] == items["sha256"][0]


def test_opening_reads_no_rows(tmp_path):
    """Opening maps the file: a damaged row is found when that row is read, not before (no whole-table pass)."""
    items = _items(300)
    path = tmp_path / "i.cols"
    write_items(path, items, F.ITEM_COLUMNS)
    import json

    raw = bytearray(path.read_bytes())
    header = json.loads(raw[24:24 + int.from_bytes(raw[16:24], "little")])
    spec = next(c for c in header["columns"] if c["name"] == "caption")
    # row 10's end offset made smaller than its start: only reading rows 10 (or iterating past it) notices
    at = spec["offset"] + 8 * 11
    raw[at:at + 8] = (0).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    cols = read_items(path)
    assert cols["caption"][3] == items["caption"][3]
    with pytest.raises(ItemsFormatError, match=r"i\.cols is corrupt: column caption"):
        list(cols["caption"])


@pytest.mark.parametrize("damage", ["truncate_half", "truncate_header", "magic", "header_json", "rows"])
def test_damaged_file_is_refused_naming_it(tmp_path, damage):
    path = tmp_path / "items-3.cols"
    write_items(path, _items(200), F.ITEM_COLUMNS)
    raw = bytearray(path.read_bytes())
    if damage == "truncate_half":
        raw = raw[:len(raw) // 2]
    elif damage == "truncate_header":
        raw = raw[:40]
    elif damage == "magic":
        raw[:4] = b"path"
    elif damage == "header_json":
        raw[30] = ord("{")
    elif damage == "rows":
        raw[24:24 + 10] = b'{"rows": 9'   # 9xx rows claimed: sections too small
    path.write_bytes(bytes(raw))
    with pytest.raises(ItemsFormatError, match=r"items-3\.cols is corrupt"):
        read_items(path)
    with pytest.raises(F.EmbeddingIndexError, match=r"items-3\.cols is corrupt"):
        F.read_items(path)


def test_index_reads_columnar_items_lazily(tmp_path):
    """An index committed now stores items-<gen>.cols (format version 4) and opens it without reading rows."""
    from clip_mini.retrieval.reader import IndexReader

    n = 50
    items = {c: v[:n] for c, v in _items(n).items() if c in F.ITEM_COLUMNS}
    items["path"] = [str(tmp_path / "photos" / f"{i:03d}.jpg") for i in range(n)]
    emb = np.eye(n, 8, dtype=np.float16)
    emb[8:] = 1 / np.sqrt(8)
    with F.writer_lock(tmp_path / "idx"):
        np.save(tmp_path / "idx" / "embeddings-1.npy", emb)
        m = F.commit(tmp_path / "idx", 1, items, {"model_fingerprint": "x", "source": "t", "shard": None},
                     progress=False)
    assert m["format_version"] == F.COLUMNAR_FORMAT_VERSION and m["files"]["items"] == "items-1.cols"
    assert m["root"]["path"] == str(tmp_path / "photos")
    index = IndexReader.load(tmp_path / "idx")
    assert isinstance(index.items["path"], StrColumn)
    assert index.items["path"] == items["path"] and index.items["size"] == items["size"]
    assert list(index.paths[[3, 1]]) == [items["path"][3], items["path"][1]]
    # the folder and the index moved together: paths follow
    os.rename(tmp_path / "idx", tmp_path / "photos-idx")
    os.makedirs(tmp_path / "photos", exist_ok=True)
    moved = tmp_path / "moved"
    moved.mkdir()
    os.rename(tmp_path / "photos", moved / "photos")
    os.rename(tmp_path / "photos-idx", moved / "idx")
    assert IndexReader.load(moved / "idx").items["path"][2] == str(moved / "photos" / "002.jpg")
