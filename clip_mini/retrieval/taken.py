"""When each indexed photo was taken, recorded at index time for ``clip-mini search --after / --before``.

A row's ``taken`` is its EXIF DateTimeOriginal (tag 36867 in the Exif IFD, 0x8769), else the EXIF DateTime of the
main IFD (tag 306), else the file's modification time; ``taken_from`` says which ("exif" or "mtime").

The value is int64 seconds since 1970-01-01 of the *local wall-clock time*, as if that time were UTC: EXIF dates
carry no time zone (the camera's clock as it was set), so the file's mtime is converted to the indexing machine's
local time the same way, and a date filter (``filters``) is read as wall-clock time too. ``--after 2024-01-01``
then means "taken on 1 January 2024 or later, by the clock where it was taken", whatever zone the index is
searched from.

Reading the date is cheap and never fails a build: the file is the one the build has just opened and hashed
(``bounded_read.sha256_regular_files(inspect=...)``, same descriptor, page cache warm), Pillow parses only the
header (no pixel is decoded: PNG's own ``getexif`` would decode the image to find an eXIf chunk after the pixel
data, so the base class's is called, which reads only what the header held), and any error, bad EXIF or
unparsable date gives ``None``: the mtime is used.
"""
from __future__ import annotations

import calendar
import re
import time
from datetime import datetime
from typing import BinaryIO, Optional

TAKEN_COLUMNS = ("taken", "taken_from")   # int64 seconds, "exif" | "mtime"
EXIF_IFD = 0x8769
DATETIME_ORIGINAL = 36867
DATETIME = 306
_EXIF_DATE = re.compile(r"\s*(\d{4})[:\-](\d{2})[:\-](\d{2})[ T](\d{2}):(\d{2})(?::(\d{2}))?")


def exif_seconds(f: BinaryIO) -> Optional[int]:
    """The EXIF capture time of the image in ``f`` (an open file, positioned anywhere) as wall-clock seconds, or
    None (no EXIF date, an unreadable or unparsable one, not an image). Reads the header only; never raises."""
    try:
        from PIL import Image

        from clip_mini.data.images import _FORMATS

        f.seek(0)
        with Image.open(f, formats=_FORMATS) as im:
            exif = Image.Image.getexif(im)   # the base method: a PNG's own would decode the pixels
            value = exif.get_ifd(EXIF_IFD).get(DATETIME_ORIGINAL)
            seconds = parse_exif_date(value)
            return seconds if seconds is not None else parse_exif_date(exif.get(DATETIME))
    except Exception:   # noqa: BLE001 - bad EXIF is the norm somewhere in every photo library: use the mtime
        return None


def parse_exif_date(value) -> Optional[int]:
    """``"YYYY:MM:DD HH:MM:SS"`` (bytes or str; seconds optional, "-" or "T" tolerated) -> wall-clock seconds, or
    None for anything else (blank, ``0000:00:00 00:00:00``, an impossible date)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        return None
    m = _EXIF_DATE.match(value)
    if not m:
        return None
    try:
        return calendar.timegm(datetime(*(int(g or 0) for g in m.groups())).timetuple())
    except (ValueError, OverflowError):
        return None


def local_seconds(mtime_ns: int) -> int:
    """A file time (ns since the epoch, UTC) as this machine's local wall-clock time in seconds (see the module
    docstring); the UTC seconds where the platform cannot convert it."""
    s = int(mtime_ns) // 1_000_000_000
    try:
        return calendar.timegm(time.localtime(s))
    except (OverflowError, OSError, ValueError):
        return s


def taken(exif: Optional[int], mtime_ns: int) -> tuple[int, str]:
    """A row's ``(taken, taken_from)``: the EXIF time when there is one, else the file's mtime."""
    return (exif, "exif") if exif is not None else (local_seconds(mtime_ns), "mtime")
