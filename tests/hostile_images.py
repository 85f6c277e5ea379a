"""Generators of images that are cheap to send and expensive to decode (issue 11 §3)."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def png_declaring(width: int, height: int, rows: int = 1) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (8-bit gray) with only ``rows``
    rows of data: a few hundred bytes at most, whatever it declares."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * min(rows, height) * (1 + min(width, 1 << 16)), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def jpeg_with_scans(scans: int, size: tuple[int, int] = (640, 480)) -> bytes:
    """A progressive JPEG whose smallest scan is repeated until it has ``scans`` scans: a
    few bytes each, yet each is a pass of the decoder over the whole image."""
    image = Image.radial_gradient("L").resize(size).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    assert data.endswith(b"\xff\xd9")
    starts = [i for i in range(len(data) - 1) if data[i : i + 2] == b"\xff\xda"]
    assert len(starts) <= scans
    ends = [*starts[1:], len(data) - 2]
    smallest = min((data[a:b] for a, b in zip(starts, ends, strict=True)), key=len)
    return data[:-2] + smallest * (scans - len(starts)) + b"\xff\xd9"
