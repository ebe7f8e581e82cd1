"""Caption readers: CSV/TSV, Flickr8k token files and COCO captions JSON, all into one pandas table.

Every reader returns the same table: ``path`` (absolute image path), ``image`` (name as written in the file,
relative to the image root), ``caption`` (stripped), ``image_id`` (dense 0..n_images-1 in first-appearance
order). Rows that cannot be used but need not stop the run (empty caption, empty image name) are returned as
``(item, reason)`` pairs; anything that makes the whole file suspect raises ``DataError`` naming the file and row.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from pathlib import Path
from typing import Optional

import pandas as pd

from clip_mini.fileio.bounded_read import UnreadableFileError, read_file
from clip_mini.errors import DataError

COLUMNS = ["path", "image", "caption", "image_id"]
_FLICKR_LINE = re.compile(r"^(?P<name>[^\t#]+)#\d+\t(?P<caption>.*)$")
_ROOT_PROBE = 20   # names checked when guessing whether images live in an images/ subfolder


Skipped = list[tuple[str, str]]


def read_captions(path: str | Path, image_root: Optional[str | Path] = None, fmt: str = "auto",
                  sep: Optional[str] = None, image_col: str = "image", caption_col: str = "caption",
                  ) -> tuple[pd.DataFrame, Skipped]:
    """Read a captions file into the standard table.

    Args:
        path: captions file (CSV/TSV with a header, Flickr8k ``name.jpg#n<TAB>caption`` lines, or COCO JSON).
        image_root: folder the image names are relative to. None: the captions file's folder, or its
            ``images/`` or ``Images/`` subfolder when the file's names are found there.
        fmt: "auto" (by extension and content), "csv", "tsv", "flickr8k" or "coco".
        sep: column separator for csv/tsv (default "," and tab).
        image_col, caption_col: column names for csv/tsv.

    Returns:
        The table (columns ``path, image, caption, image_id``) and the skipped ``(item, reason)`` rows.

    Raises:
        DataError: missing file or columns, bad encoding, unparsable rows, no usable rows, or an image name
            that escapes the image root.
    """
    path = Path(path)
    raw = read_input_file(path, "captions file")
    fmt = detect_format(path, raw) if fmt == "auto" else fmt
    if fmt == "coco":
        names, captions, rows = _read_coco(path, raw)
    else:
        text = _decode(path, raw)
        if fmt == "flickr8k":
            names, captions, rows = _read_flickr8k(path, text)
        elif fmt in ("csv", "tsv"):
            sep = sep if sep is not None else ("\t" if fmt == "tsv" else ",")
            names, captions, rows = _read_table(path, text, sep, image_col, caption_col)
        else:
            raise DataError(f"{path}: unknown captions format {fmt!r} (use auto, csv, tsv, flickr8k or coco)")
    keep, skipped = [], []
    for name, cap, row in zip(names, captions, rows):
        if "\0" in name:   # no file can have this name; the captions file is binary or damaged
            raise DataError(f"{path}: {row}: image name {name!r} contains a NUL byte")
        if not name:
            skipped.append((f"{path}:{row}", "empty image name"))
        elif not cap:
            skipped.append((f"{path}:{row}", f"empty caption for {name}"))
        else:
            keep.append((name, cap, row))
    if not keep:
        raise DataError(f"{path}: no usable rows ({len(skipped)} skipped: empty captions or image names)")
    df = pd.DataFrame(keep, columns=["image", "caption", "row"])
    root = Path(image_root) if image_root is not None else guess_image_root(path, df["image"].unique())
    df.insert(0, "path", _resolve_paths(path, root, df["image"], df["row"]))
    df["image_id"] = dense_ids(df["path"])
    return df[COLUMNS], skipped


def read_input_file(path: Path, what: str) -> bytes:
    """All bytes of a regular file, read without blocking without bound; else ``DataError`` naming ``what``.

    A named pipe, socket or device (``captions.csv -> /dev/zero``) is refused instead of blocking or never ending.
    """
    if path.is_dir():
        raise DataError(f"{what} is a directory, not a file: {path}")
    try:
        return read_file(path)[0]
    except FileNotFoundError:
        raise DataError(f"{what} not found: {path}") from None
    except UnreadableFileError as e:
        raise DataError(f"{what} {path}: {e.reason}") from None
    except OSError as e:
        raise DataError(f"{what} {path}: cannot read: {e.strerror or e}") from None


def detect_format(path: Path, raw: bytes) -> str:
    """Pick a reader: ``.json`` is COCO, a first line like ``name.jpg#0<TAB>`` is Flickr8k, ``.tsv`` is TSV."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return "coco"
    first = raw[:4096].decode("utf-8", errors="replace").lstrip("\ufeff").split("\n", 1)[0]
    if _FLICKR_LINE.match(first.rstrip("\r")):
        return "flickr8k"
    return "tsv" if suffix == ".tsv" else "csv"


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")   # -sig: drop a byte-order mark written by Excel
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                        "re-save the file as UTF-8") from None


def _read_table(path: Path, text: str, sep: str, image_col: str, caption_col: str):
    # The csv module rather than pandas: pandas silently turns the first column into the index when a row
    # has one field too many (an unquoted comma in a caption), shifting every column.
    if len(sep) != 1:
        raise DataError(f"{path}: separator must be one character, got {sep!r}")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep, skipinitialspace=True, strict=True)
    try:
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: file is empty (expected a header with {image_col!r} and {caption_col!r})")
        header = [h.strip() for h in header]
        missing = [c for c in (image_col, caption_col) if c not in header]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; found {header} (set data.image_col / "
                            f"data.caption_col, or data.sep if the separator is not {sep!r})")
        i_img, i_cap = header.index(image_col), header.index(caption_col)
        names, captions, rows = [], [], []
        for n, fields in enumerate(reader, start=1):
            if not fields:
                continue   # blank line
            if len(fields) > len(header):
                raise DataError(f"{path}: row {n} (line {reader.line_num}): {len(fields)} fields but the header "
                                f"has {len(header)}; quote captions that contain {sep!r}")
            names.append(fields[i_img].strip() if i_img < len(fields) else "")
            captions.append(fields[i_cap].strip() if i_cap < len(fields) else "")
            rows.append(f"row {n}")
    except csv.Error as e:
        raise DataError(f"{path}: line {reader.line_num}: cannot parse with separator {sep!r}: {e}") from None
    if not names:
        raise DataError(f"{path}: header only, no rows")
    return names, captions, rows


def _read_flickr8k(path: Path, text: str):
    names, captions, rows = [], [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        m = _FLICKR_LINE.match(line)
        if m is None:
            raise DataError(f"{path}: line {lineno}: expected 'name.jpg#n<TAB>caption', got {line[:60]!r}")
        names.append(m["name"].strip())
        captions.append(m["caption"].strip())
        rows.append(f"line {lineno}")
    if not names:
        raise DataError(f"{path}: no rows")
    return names, captions, rows


def _read_coco(path: Path, raw: bytes):
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    for key in ("images", "annotations"):
        if not isinstance(data, dict) or not isinstance(data.get(key), list):
            raise DataError(f"{path}: COCO captions JSON needs a list field {key!r}")
    files = {}
    for i, im in enumerate(data["images"]):
        if not isinstance(im, dict) or "id" not in im or "file_name" not in im:
            raise DataError(f"{path}: images[{i}] needs fields 'id' and 'file_name'")
        files[_coco_id(path, f"images[{i}].id", im["id"])] = _coco_str(path, f"images[{i}].file_name",
                                                                      im["file_name"])
    names, captions, rows = [], [], []
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict) or "image_id" not in ann or "caption" not in ann:
            raise DataError(f"{path}: annotations[{i}] needs fields 'image_id' and 'caption'")
        image_id = _coco_id(path, f"annotations[{i}].image_id", ann["image_id"])
        if image_id not in files:
            raise DataError(f"{path}: annotations[{i}] refers to image_id {image_id!r}, which is not in 'images'")
        names.append(files[image_id].strip())
        captions.append(_coco_str(path, f"annotations[{i}].caption", ann["caption"] or "").strip())
        rows.append(f"annotations[{i}]")
    if not names:
        raise DataError(f"{path}: no annotations")
    return names, captions, rows


def _coco_id(path: Path, field: str, value) -> int | str:
    # bool is an int to Python; an id of true would silently match image 1.
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise DataError(f"{path}: {field} must be an integer or a string, got {json.dumps(value)[:40]}")
    return value


def _coco_str(path: Path, field: str, value) -> str:
    if not isinstance(value, str):
        raise DataError(f"{path}: {field} must be a string, got {json.dumps(value)[:40]}")
    return value


def guess_image_root(captions_path: Path, names) -> Path:
    """The captions file's folder, or its ``images/``/``Images/`` subfolder if more of the names live there."""
    folder = captions_path.resolve().parent
    probe = list(names[:_ROOT_PROBE])
    best, best_hits = folder, sum(_is_file(folder / n) for n in probe)
    for sub in ("images", "Images"):
        if (folder / sub).is_dir():
            hits = sum(_is_file(folder / sub / n) for n in probe)
            if hits > best_hits:
                best, best_hits = folder / sub, hits
    return best


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:   # a name over 255 bytes: pathlib raises ENAMETOOLONG instead of answering False
        return False


def _resolve_paths(captions_path: Path, root: Path, names: pd.Series, rows: pd.Series) -> list[str]:
    # Lexical check (normpath, not resolve): a symlinked image folder is fine, a "../" or absolute name that
    # leaves the root is refused, so a captions file cannot make us read arbitrary files.
    root_abs = os.path.normpath(os.path.abspath(root))
    resolved = {}
    for name in names.unique():
        p = os.path.normpath(os.path.join(root_abs, name))
        if p == root_abs or not p.startswith(root_abs.rstrip(os.sep) + os.sep):
            row = rows[int((names == name).to_numpy().argmax())]
            where = "the image root itself" if p == root_abs else "outside the image root"
            raise DataError(f"{captions_path}: {row}: image path {name!r} is {where} "
                            f"{root_abs} (names must be files inside it, without '..')")
        resolved[name] = p
    return names.map(resolved).tolist()


def dense_ids(keys: pd.Series) -> list[int]:
    """Dense ids 0..k-1 in first-appearance order of ``keys``."""
    codes, _ = pd.factorize(keys, sort=False)
    return codes.tolist()
