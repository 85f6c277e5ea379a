"""Variant sets for the near-duplicate experiment (bench/near_duplicates.py) and its tests.

From one corpus image and the engine's answer on it:

- benign (should hit): JPEG re-encodes (q95/85/75), a 75 % resize, a metadata change (a
  comment or text chunk added, same pixels), a PNG re-save, lossless format changes (BMP,
  TIFF, lossless WEBP);
- changed (must miss): one word and one digit replaced in an existing text line (drawn over
  the engine-found box with its background colour and a matching font size), a 2 % crop.

And, made from scratch, pairs of documents of one template (the same form filled with two
different records). Everything is deterministic.
"""

from __future__ import annotations

import io
import random
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont, PngImagePlugin

from app.vocabulary import OcrLine, OcrResult

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
BENIGN = ("jpeg95", "jpeg85", "jpeg75", "resize75", "metadata", "png_resave", "bmp", "tiff",
          "webp_lossless")  # fmt: skip
LOSSLESS = ("metadata", "png_resave", "bmp", "tiff", "webp_lossless")  # same pixels
CHANGED = ("word", "digit", "crop2")


def _rgb(data: bytes) -> Image.Image:
    from PIL import ImageOps

    img = Image.open(io.BytesIO(data))
    img = ImageOps.exif_transpose(img)
    return img.convert("RGB")


def _save(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _with_metadata(data: bytes) -> bytes:
    """Same pixels, other bytes: a JPEG comment segment, or a PNG text chunk."""
    if data[:2] == b"\xff\xd8":
        comment = b"re-sent by a gateway"
        return data[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + data[2:]
    img = Image.open(io.BytesIO(data))
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "metadata added by a mobile app")
    if img.mode not in ("RGB", "RGBA", "L", "LA", "P", "I", "1"):
        img = img.convert("RGB")
    return _save(img, "PNG", pnginfo=info)


def benign(data: bytes, name: str) -> bytes:
    img = _rgb(data)
    if name.startswith("jpeg"):
        return _save(img, "JPEG", quality=int(name[4:]))
    if name == "resize75":
        size = (max(1, round(img.width * 0.75)), max(1, round(img.height * 0.75)))
        return _save(img.resize(size, Image.Resampling.LANCZOS), "PNG")
    if name == "metadata":
        return _with_metadata(data)
    if name == "png_resave":
        return _save(img, "PNG", compress_level=9)
    if name == "bmp":
        return _save(img, "BMP")
    if name == "tiff":
        return _save(img, "TIFF", compression="tiff_lzw")
    if name == "webp_lossless":
        return _save(img, "WEBP", lossless=True)
    raise ValueError(name)


def changed(data: bytes, name: str, result: OcrResult) -> bytes | None:
    """None when the image has no line this change applies to (e.g. no digit)."""
    img = _rgb(data)
    if name == "crop2":
        w, h = img.width, img.height
        return _save(img.crop((0, 0, w - max(1, round(w * 0.02)), h)), "PNG")
    if name == "digit":
        return _replace(img, result, _digit_spot)
    if name == "word":
        return _replace(img, result, _word_spot)
    raise ValueError(name)


Spot = tuple[OcrLine, int, int, str]  # line, first char, end char, replacement


def _digit_spot(lines: list[OcrLine]) -> Spot | None:
    for line in lines:
        for i, c in enumerate(line.text):
            if c.isascii() and c.isdigit() and i > 0:
                return line, i, i + 1, str((int(c) + 3) % 10)
    return None


def _word_spot(lines: list[OcrLine]) -> Spot | None:
    for line in lines:
        words = [
            (i, w) for i, w in _words(line.text) if len(w) >= 3 and w.isascii() and w.isalpha()
        ]
        if words:
            i, word = words[len(words) // 2]
            swap = "".join(chr((ord(c.lower()) - 97 + 7) % 26 + 97) for c in word)
            if word[0].isupper():
                swap = swap.capitalize()
            return line, i, i + len(word), swap
    return None


def _words(text: str) -> list[tuple[int, str]]:
    out, start = [], None
    for i, c in enumerate(text + " "):
        if c.isalnum() and start is None:
            start = i
        elif not c.isalnum() and start is not None:
            out.append((start, text[start:i]))
            start = None
    return out


def _replace(
    img: Image.Image, result: OcrResult, pick: Callable[[list[OcrLine]], Spot | None]
) -> bytes | None:
    """Paint over characters [a, b) of a confident, roughly horizontal line and write the
    replacement there, sized to the line."""
    lines = sorted(
        (
            line
            for line in result.lines
            if line.score > 0.9 and len(line.text) >= 4 and _horizontal(line)
        ),
        key=lambda line: -(line.box[1][0] - line.box[0][0]),
    )
    spot = pick(lines)
    if spot is None:
        return None
    line, a, b, text = spot
    xs = [p[0] for p in line.box]
    ys = [p[1] for p in line.box]
    x1, x2, y1, y2 = min(xs), max(xs), min(ys), max(ys)
    per = (x2 - x1) / len(line.text)
    left, right = x1 + per * a, x1 + per * b
    pixels = np.asarray(img)
    band = pixels[max(0, y1) : y2, max(0, x1) : x2].reshape(-1, 3)
    background = tuple(int(v) for v in np.percentile(band, 90, axis=0))
    ink = tuple(int(v) for v in np.percentile(band, 5, axis=0))
    draw = ImageDraw.Draw(img)
    draw.rectangle((left, y1 + 1, right, y2 - 1), fill=background)
    size = max(6, round((y2 - y1) * 0.7))
    font = ImageFont.truetype(str(FONT), size)
    tw = draw.textlength(text, font=font)
    if tw > right - left and tw > 0:  # keep it inside the painted cell
        font = ImageFont.truetype(str(FONT), max(6, int(size * (right - left) / tw)))
    draw.text(((left + right) / 2, (y1 + y2) / 2), text, fill=ink, font=font, anchor="mm")
    return _save(img, "PNG")


def _horizontal(line: OcrLine) -> bool:
    (x1, y1), (x2, y2) = line.box[0], line.box[1]
    return abs(y2 - y1) <= 2 and x2 - x1 > 2 * abs(line.box[3][1] - y1)


# Documents of one template ---------------------------------------------------------------

_NAMES = ["Alice Martin", "Bruno Keller", "Chen Wei", "Dana Novak", "Emil Larsen",
          "Fatima Aziz", "Goran Ilic", "Hana Sato", "Ivan Petrov", "Julia Costa"]  # fmt: skip
_ITEMS = ["Paper A4", "Toner", "Stapler", "Folders", "Pens", "Envelopes", "Labels", "Binder"]


def template_pair(seed: int) -> tuple[bytes, bytes]:
    """Two invoices of one template (layout, size, fonts, items) with different records."""
    rng = random.Random(seed)
    width, height = rng.choice([(800, 1000), (900, 1100), (700, 900)])
    items = rng.sample(_ITEMS, 4)
    names = rng.sample(_NAMES, 2)
    numbers = rng.randrange(1000, 9999), rng.randrange(1000, 9999)
    return tuple(  # type: ignore[return-value]
        _invoice(width, height, items, names[i], numbers[i], random.Random(seed * 7 + i))
        for i in (0, 1)
    )


def _invoice(
    width: int, height: int, items: list[str], name: str, number: int, rng: random.Random
) -> bytes:
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    big = ImageFont.truetype(str(FONT), 36)
    font = ImageFont.truetype(str(FONT), 22)
    draw.rectangle((30, 30, width - 30, 110), outline="black", width=3)
    draw.text((50, 48), "INVOICE", fill="black", font=big)
    draw.text((width - 300, 55), f"No. {number}", fill="black", font=font)
    draw.text((50, 140), "Billed to:", fill="black", font=font)
    draw.text((200, 140), name, fill="black", font=font)
    top = 220
    draw.line((40, top - 10, width - 40, top - 10), fill="black", width=2)
    total = 0
    for i, item in enumerate(items):
        qty, price = rng.randrange(1, 20), rng.randrange(100, 9999)
        total += qty * price
        y = top + i * 50
        draw.text((50, y), item, fill="black", font=font)
        draw.text((width // 2, y), str(qty), fill="black", font=font)
        draw.text((width - 220, y), f"{price / 100:.2f}", fill="black", font=font)
    y = top + len(items) * 50 + 20
    draw.line((40, y - 10, width - 40, y - 10), fill="black", width=2)
    draw.text((50, y), "Total", fill="black", font=font)
    draw.text((width - 220, y), f"{total / 100:.2f}", fill="black", font=font)
    return _save(img, "PNG")
