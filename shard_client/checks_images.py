"""Content checks for images (PNG, JPEG): complete, of at least one pixel, decodable, not flat.

Registered into `shard_client.checks.CONTENT_CHECKS` on import; `shard_client.checks`
imports this module, so importing that one is enough.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from shard_client.checks_registry import CheckResult, content_check

__all__: list[str] = []

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"
_JPEG_START = b"\xff\xd8\xff"
# Start-of-frame markers carry the dimensions; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _fail(reason: str, detail: str) -> CheckResult:
    return CheckResult(passed=False, reason=reason, detail=detail)


@content_check("image_undecodable", ext=".png", media="image/png", magic=(_PNG_SIGNATURE,))
def _check_png(path: Path) -> CheckResult | None:
    return _check_image(path, kind="PNG", start=_PNG_SIGNATURE, end=_PNG_IEND, size=_png_size)


@content_check("image_undecodable", ext=".jpg .jpeg", media="image/jpeg", magic=(_JPEG_START,))
def _check_jpeg(path: Path) -> CheckResult | None:
    return _check_image(path, kind="JPEG", start=_JPEG_START, end=b"\xff\xd9", size=_jpeg_size)


def _png_size(fh: BinaryIO) -> tuple[int, int] | None:
    # IHDR is the first chunk: length, type, then width and height as big-endian u32.
    fh.seek(8)
    chunk = fh.read(16)
    if len(chunk) < 16 or chunk[4:8] != b"IHDR":
        return None
    width, height = struct.unpack(">II", chunk[8:16])
    return width, height


def _jpeg_size(fh: BinaryIO) -> tuple[int, int] | None:
    # Walk the marker segments up to the first start-of-frame, which holds height and width.
    fh.seek(2)
    while True:
        marker = fh.read(2)
        if len(marker) < 2 or marker[0] != 0xFF:
            return None
        if marker[1] in (0xD8, 0x01) or 0xD0 <= marker[1] <= 0xD7:
            continue  # markers without a length
        length = fh.read(2)
        if len(length) < 2:
            return None
        body = fh.read(struct.unpack(">H", length)[0] - 2)
        if marker[1] in _JPEG_SOF:
            if len(body) < 5:
                return None
            height, width = struct.unpack(">HH", body[1:5])
            return width, height
        if marker[1] == 0xDA:
            return None  # scan data began without a frame header: Pillow will say more


def _check_image(
    path: Path,
    *,
    kind: str,
    start: bytes,
    end: bytes,
    size: Callable[[BinaryIO], tuple[int, int] | None],
) -> CheckResult | None:
    with path.open("rb") as fh:
        if fh.read(len(start)) != start:
            return _fail("image_undecodable", f"missing {kind} signature {start!r}")
        # Writers emit the end marker last, so a file cut short anywhere lacks it.
        fh.seek(max(path.stat().st_size - len(end), 0))
        if fh.read() != end:
            return _fail("truncated", f"{kind} does not end with {end!r}")
        dimensions = size(fh)
    # A JPEG may defer its height to a DNL marker, so only a zero width is certain there.
    if dimensions is not None and (dimensions[0] == 0 or (kind == "PNG" and dimensions[1] == 0)):
        return _fail("empty", f"{kind} of zero pixels ({dimensions[0]}x{dimensions[1]})")
    try:
        from PIL import Image
    except ImportError:
        return CheckResult(True, "ok", "Pillow not installed, pixels not decoded")
    try:
        with Image.open(path) as img:
            img.load()
            width, height = img.size
            extrema: Any = img.getextrema() if width and height else None
    except Exception as exc:
        # Pillow reports corrupt data as OSError, SyntaxError, ValueError and more.
        return _fail("image_undecodable", f"{type(exc).__name__}: {exc}")
    if extrema is None:
        return _fail("empty", f"{kind} of zero pixels ({width}x{height})")
    bands = extrema if isinstance(extrema[0], tuple) else (extrema,)
    if all(low == high for low, high in bands):
        return _fail("image_degenerate", f"every pixel is identical (extrema {extrema})")
    return None
