"""Fuzzing the image loader and the caption readers with mutated real files.

Seed files are made here (JPEG and PNG with Pillow; CSV, TSV, Flickr8k token and COCO JSON captions), then
mutated byte by byte (flips, overwrites with bytes that mean something to the format, inserts, deletes, truncation,
spliced copies), field by field (a CSV/TSV/Flickr8k field replaced by an awkward value) and, for COCO, node by node
(any JSON value in place of any field): 2,900 cases, about a minute on a busy 2-core machine. Each case goes through the
public entry points -- ``load_image`` and ``check_images``; ``read_captions`` and ``load_table`` -- and must either
succeed with a well-formed result or raise the project's own error naming the file. Anything else (an exception
from deep inside Pillow, pandas or json, or a call that does not return within ``CASE_LIMIT_S``) fails.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from clip_mini.config import DataConfig
from clip_mini.data.dataset import load_table
from clip_mini.data.images import ImageError, check_images, load_image
from clip_mini.data.readers import COLUMNS, DataError, read_captions
from timeouts import within

# Pillow warns about the corrupt EXIF it skips; expected here by construction.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")]

CASE_LIMIT_S = 10.0   # one case takes milliseconds; only a hang gets near this
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])   # capsys, cleared per case


def _returns(fn, *args):
    """``fn(*args)``, failing the test if it has not returned after ``CASE_LIMIT_S``."""
    return within(CASE_LIMIT_S, fn, *args)


# -- mutations -----------------------------------------------------------------------------------------------
def _mutation(tokens: list[bytes]):
    """One edit: (kind, position, bytes); the position wraps around the length of the data."""
    payload = st.one_of(st.sampled_from(tokens), st.binary(min_size=1, max_size=6))
    # Hypothesis favours small numbers (and 0.0): used as they are, most edits would hit the magic bytes.
    return st.tuples(st.sampled_from(["flip", "overwrite", "insert", "delete", "truncate", "splice"]),
                     st.integers(0, 1 << 20), payload)


def _apply(data: bytes, edits) -> bytes:
    for kind, where, payload in edits:
        n = len(data)
        at = where * 2654435761 % n if n else 0   # Knuth's multiplicative hash spreads small positions out
        if kind == "flip" and n:
            data = data[:at] + bytes([data[at] ^ (payload[0] or 0x80)]) + data[at + 1:]
        elif kind == "overwrite":
            data = data[:at] + payload + data[at + len(payload):]
        elif kind == "insert":
            data = data[:at] + payload + data[at:]
        elif kind == "delete":
            data = data[:at] + data[at + len(payload):]
        elif kind == "truncate":
            data = data[:at]
        elif kind == "splice":   # a copy of another stretch of the file (duplicated chunks, markers, rows)
            src = min(int(payload[0] / 255 * n), n)
            data = data[:at] + data[src:src + 1 + payload[-1] % 64] + data[at:]
    return data


# -- images --------------------------------------------------------------------------------------------------
def _seed_images() -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 20, dtype=np.uint8)
    rgb = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], rng.integers(0, 256, (20, 20), np.uint8)), -1)
    seeds = []

    def save(ext: str, image: Image.Image, **kwargs) -> None:
        buf = io.BytesIO()
        image.save(buf, format={".jpg": "JPEG", ".png": "PNG"}[ext], **kwargs)
        seeds.append((ext, buf.getvalue()))

    exif = Image.Exif()
    exif[0x0112] = 6   # orientation: rotate on load
    save(".jpg", Image.fromarray(rgb), quality=85, exif=exif.tobytes())
    save(".jpg", Image.fromarray(rgb[:, :, 0]), quality=70, progressive=True)
    save(".png", Image.fromarray(np.dstack([rgb, rgb[:, :, :1]])))                   # RGBA
    save(".png", Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=8), transparency=0)
    save(".png", Image.fromarray((rgb[:, :, 0].astype(np.uint16) * 257)))           # 16-bit grayscale
    return seeds


SEED_IMAGES = _seed_images()
IMAGE_TOKENS = [b"\x00", b"\xff", b"\xff\xd8", b"\xff\xd9", b"\xff\xc0", b"\xff\xc4", b"\xff\xda", b"\xff\xe1",
                b"\xff\xdb", b"Exif\x00\x00", b"MM\x00*", b"II*\x00", b"\x89PNG\r\n\x1a\n", b"IHDR", b"IDAT",
                b"IEND", b"PLTE", b"tRNS", b"iCCP", b"\x7f\xff\xff\xff", b"\xff\xff\xff\xff", b"\x00\x00\x00\x00",
                b"\x00\x01\x00\x00", b"\x00\x00\xff\xff"]


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_seed_images_load(fuzz_dir):
    # Unmutated seeds must decode, or the fuzz below would only ever exercise the error path.
    for i, (ext, data) in enumerate(SEED_IMAGES):
        path = fuzz_dir / f"seed{i}{ext}"
        path.write_bytes(data)
        assert load_image(str(path)).shape == (20, 20, 3)
        assert check_images([str(path)]) == {}


@settings(FUZZ, max_examples=1500)
@given(seed=st.integers(0, len(SEED_IMAGES) - 1), edits=st.lists(_mutation(IMAGE_TOKENS), min_size=1, max_size=4))
def test_mutated_images_load_or_raise_image_error(fuzz_dir, seed, edits):
    ext, data = SEED_IMAGES[seed]
    path = fuzz_dir / f"mutant{ext}"
    path.write_bytes(_apply(data, edits))
    try:
        image = _returns(load_image, str(path))
    except ImageError as e:
        assert e.path == str(path) and e.reason
    else:
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.size > 0
    bad = _returns(check_images, [str(path)])
    assert set(bad) <= {str(path)} and all(isinstance(r, str) and r for r in bad.values())


# -- captions files ------------------------------------------------------------------------------------------
SEED_CAPTIONS = {
    "csv": ("captions.csv", b'image,caption\nimg0.png,a red circle\nimg1.png,"a blue, square"\nimg0.png,red again\n'),
    "tsv": ("captions.tsv", b"image\tcaption\nimg0.png\ta red circle\nimg1.png\ta blue square\n"),
    "flickr8k": ("captions.txt", b"img0.png#0\ta red circle\nimg0.png#1\tthe red one\nimg1.png#0\ta blue square\n"),
    "coco": ("captions.json", json.dumps({
        "images": [{"id": 1, "file_name": "img0.png"}, {"id": 2, "file_name": "img1.png"}],
        "annotations": [{"image_id": 1, "caption": "a red circle"}, {"image_id": 2, "caption": "a blue square"},
                        {"image_id": 1, "caption": "the red one"}]}).encode()),
}
TEXT_TOKENS = [b",", b'"', b"\t", b"\n", b"\r\n", b"\r", b"#", b"#0\t", b"../", b"/", b"..", b"\xef\xbb\xbf",
               b"\x00", b"\xe9", b"\xc3\xa9", b"{", b"}", b"[", b"]", b":", b"null", b"1e999", b"-0", b'"id"',
               b'"image_id"', b'"caption"', b'"file_name"', b"image", b"caption", b"img1.png", b" ",
               b"n" * 300]   # a name longer than a file name may be
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.floats(allow_nan=True), st.text(max_size=8),
              st.sampled_from(["img0.png", "img1.png", "../x.png", "/etc/hostname", "", " ", "n" * 300])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
        ["id", "image_id", "file_name", "caption", "images", "annotations"]), inner, max_size=3)),
    max_leaves=6)


FIELD_VALUES = st.one_of(
    st.sampled_from(["img0.png", "img1.png", "", " ", "n" * 300 + ".png", "a\x00b.png", "../img0.png", "/etc/hostname",
                     "img0.png#", "#0", '"', '"quoted, with comma"', "\ufeffimg0.png", "images/../img0.png", "."]),
    st.text(max_size=12))


@pytest.fixture(scope="module")
def caption_root(fuzz_dir) -> Path:
    root = fuzz_dir / "captions"
    root.mkdir()
    for name, (ext, data) in zip(["img0.png", "img1.png"], SEED_IMAGES[2:4]):
        (root / name).write_bytes(data)
    return root


def _mutate_json_node(doc, path: list[int], value):
    """Replace the node reached by following ``path`` (indices into each container's children) with ``value``."""
    if not path or not isinstance(doc, (dict, list)) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = keys[path[0] % len(keys)]
    doc[key] = _mutate_json_node(doc[key], path[1:], value)
    return doc


def _check_captions(path: Path, root: Path, fmt: str, guess_root: bool) -> None:
    # The captions file sits in the image folder, so a guessed root is that folder too.
    try:
        df, skipped = _returns(read_captions, path, None if guess_root else root, fmt)
    except DataError as e:
        assert str(path) in str(e), f"DataError does not name the file: {e}"
        return
    assert list(df.columns) == COLUMNS and len(df) > 0
    assert df["caption"].map(lambda c: isinstance(c, str) and c == c.strip() and c != "").all()
    assert sorted(df["image_id"].unique()) == list(range(df["path"].nunique()))
    assert df["path"].map(lambda p: p.startswith(str(root.resolve()) + "/")).all()
    assert all(str(path) in item for item, _ in skipped)
    try:
        cfg = DataConfig(captions=str(path), image_root=None if guess_root else str(root), format=fmt, cache=False)
        table = _returns(load_table, cfg, None, False)
    except DataError as e:
        assert str(path) in str(e), f"DataError does not name the file: {e}"
    else:
        assert set(table["path"]) <= {str(root.resolve() / n) for n in ("img0.png", "img1.png")}


@settings(FUZZ, max_examples=700)
@given(kind=st.sampled_from(sorted(SEED_CAPTIONS)), auto=st.booleans(), guess_root=st.booleans(),
       edits=st.lists(_mutation(TEXT_TOKENS), min_size=1, max_size=4))
def test_mutated_caption_files_read_or_raise_data_error(fuzz_dir, caption_root, capsys, kind, auto, guess_root,
                                                        edits):
    name, data = SEED_CAPTIONS[kind]
    path = caption_root / name
    path.write_bytes(_apply(data, edits))
    _check_captions(path, caption_root, "auto" if auto else kind, guess_root)
    capsys.readouterr()   # load_table's summary lines


@settings(FUZZ, max_examples=400)
@given(node=st.lists(st.integers(0, 5), max_size=4), value=JSON_VALUES, guess_root=st.booleans())
def test_restructured_coco_json_reads_or_raises_data_error(fuzz_dir, caption_root, capsys, node, value, guess_root):
    path = caption_root / "structured.json"
    doc = _mutate_json_node(json.loads(SEED_CAPTIONS["coco"][1]), node, value)
    path.write_text(json.dumps(doc))
    _check_captions(path, caption_root, "coco", guess_root)
    capsys.readouterr()


@settings(FUZZ, max_examples=300)
@given(kind=st.sampled_from(["csv", "tsv", "flickr8k"]), line=st.integers(0, 3), field=st.integers(0, 1),
       value=FIELD_VALUES, guess_root=st.booleans())
def test_caption_files_with_a_replaced_field_read_or_raise_data_error(fuzz_dir, caption_root, capsys, kind, line,
                                                                     field, value, guess_root):
    name, data = SEED_CAPTIONS[kind]
    lines = [ln.split("\t") if kind != "csv" else ln.split(",", 1) for ln in data.decode().splitlines()]
    if kind == "flickr8k" and field == 0:   # the name part of "name#n<TAB>caption"
        lines[line % len(lines)][0] = value + "#0"
    else:
        row = lines[line % len(lines)]
        row[field % len(row)] = value
    path = caption_root / name
    path.write_text("\n".join(("," if kind == "csv" else "\t").join(row) for row in lines) + "\n")
    _check_captions(path, caption_root, kind, guess_root)
    capsys.readouterr()
