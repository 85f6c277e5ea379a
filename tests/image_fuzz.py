"""A mutation fuzzer for the image decoders (issue 11 §3), shared by ``make test`` (a fixed
number of cases, ``tests/test_fuzz_images.py``) and ``make fuzz`` (many more).

Seeds are real corpus images, and a corpus word crop re-encoded in every accepted format and
in the variants whose parsers differ (progressive JPEG, EXIF with sub-IFDs, ICC profiles,
interlaced and 16-bit PNG, every TIFF compression, multi-frame GIF/WEBP/TIFF/MPO, PGM, PBM).
A case is one seed with a few mutations: bytes overwritten (random or boundary values, more
often in the first 512 bytes where headers and metadata live), bits flipped, 16/32-bit
fields set to boundary values, slices inserted, deleted, duplicated or spliced from another
seed, and truncation. Cases are a pure function of (seed, index): a failure names both.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from typing import Any

from PIL import Image

from tests.conftest import CORPUS, WORD_CH, WORD_EN

INTERESTING_8 = [0x00, 0x01, 0x7F, 0x80, 0xFF]
INTERESTING_16 = [0, 1, 0x7FFF, 0x8000, 0xFFFF]
INTERESTING_32 = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x10000]


def _exif() -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: exif_transpose rotates
    exif[0x010F] = "maker"
    exif[0x0131] = "software"
    sub = exif.get_ifd(0x8769)  # the Exif sub-IFD
    sub[0x9003] = "2026:11:30 12:00:00"
    sub[0x927C] = b"\x00" * 16
    exif.get_ifd(0x8825)[1] = "N"  # the GPS sub-IFD
    return exif


def _seeds() -> list[tuple[str, bytes]]:
    word = Image.open(WORD_EN).convert("RGB")
    small = word.resize((word.width // 2, word.height // 2))
    icc = (CORPUS / "rapidocr_img_exif_orientation.jpg").read_bytes()
    seeds = [
        ("corpus.jpg", WORD_CH.read_bytes()),
        ("corpus.png", WORD_EN.read_bytes()),
        ("corpus-exif.jpg", icc),
        ("corpus-rec.jpg", (CORPUS / "mmocr_rec_1223731.jpg").read_bytes()),
    ]
    encodings: list[tuple[str, Image.Image, str, dict[str, Any]]] = [
        ("exif.jpg", word, "JPEG", {"exif": _exif(), "quality": 80}),
        ("progressive.jpg", word, "JPEG", {"progressive": True, "exif": _exif()}),
        ("cmyk.jpg", word.convert("CMYK"), "JPEG", {}),
        ("gray.jpg", word.convert("L"), "JPEG", {"restart_marker_blocks": 1}),
        ("exif.png", word, "PNG", {"exif": _exif()}),
        ("interlaced.png", small, "PNG", {"interlace": 1}),  # Pillow may ignore, fine
        ("palette.png", word.convert("P"), "PNG", {"transparency": 0}),
        ("gray16.png", word.convert("I;16"), "PNG", {}),
        ("la.png", word.convert("LA"), "PNG", {}),
        ("rgb.bmp", word, "BMP", {}),
        ("palette.bmp", word.convert("P"), "BMP", {}),
        ("raw.tif", small, "TIFF", {"exif": _exif()}),
        ("lzw.tif", word, "TIFF", {"compression": "tiff_lzw"}),
        ("deflate.tif", word, "TIFF", {"compression": "tiff_adobe_deflate"}),
        ("jpeg.tif", word, "TIFF", {"compression": "jpeg"}),
        ("packbits.tif", word.convert("L"), "TIFF", {"compression": "packbits"}),
        ("g4.tif", word.convert("1"), "TIFF", {"compression": "group4"}),
        ("gif", word, "GIF", {}),
        ("lossy.webp", word, "WEBP", {"quality": 60, "exif": _exif()}),
        ("lossless.webp", word, "WEBP", {"lossless": True}),
        ("rgb.ppm", small, "PPM", {}),
        ("gray.pgm", small.convert("L"), "PPM", {}),
        ("bits.pbm", small.convert("1"), "PPM", {}),
    ]
    for name, image, fmt, options in encodings:
        buf = io.BytesIO()
        image.save(buf, fmt, **options)
        seeds.append((name, buf.getvalue()))
    frames = [small, small.rotate(180)]
    for name, fmt, options in [
        ("frames.gif", "GIF", {"duration": 10}),
        ("frames.webp", "WEBP", {"duration": 10}),
        ("pages.tif", "TIFF", {}),
        ("pictures.mpo", "MPO", {}),
    ]:
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], **options)
        seeds.append((name, buf.getvalue()))
    return seeds


SEEDS = _seeds()


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One fuzz case from ``data``: 1-8 mutations."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if not out:
            break
        head = min(len(out), 512)
        pos = rng.randrange(head) if rng.random() < 0.6 else rng.randrange(len(out))
        kind = rng.randrange(9)
        if kind == 0:
            out[pos] = rng.randrange(256)
        elif kind == 1:
            out[pos] ^= 1 << rng.randrange(8)
        elif kind == 2:
            out[pos] = rng.choice(INTERESTING_8)
        elif kind == 3 and pos + 2 <= len(out):
            order = rng.choice(("big", "little"))
            out[pos : pos + 2] = rng.choice(INTERESTING_16).to_bytes(2, order)  # type: ignore[arg-type]
        elif kind == 4 and pos + 4 <= len(out):
            order = rng.choice(("big", "little"))
            out[pos : pos + 4] = rng.choice(INTERESTING_32).to_bytes(4, order)  # type: ignore[arg-type]
        elif kind == 5:
            out[pos:pos] = rng.randbytes(rng.randint(1, 32))
        elif kind == 6:
            del out[pos : pos + rng.randint(1, 64)]
        elif kind == 7:
            at = rng.randrange(len(out) + 1)
            out[at:at] = out[pos : pos + rng.randint(1, 256)]
        else:
            other = rng.choice(SEEDS)[1]
            start = rng.randrange(len(other))
            out[pos : pos + rng.randint(0, 64)] = other[start : start + rng.randint(1, 128)]
    if rng.random() < 0.15:
        del out[rng.randrange(len(out) + 1) :]
    return bytes(out)


def case(seed: int, index: int) -> tuple[str, bytes]:
    """Fuzz case ``index`` of run ``seed``: (seed file name, mutated bytes)."""
    name, data = SEEDS[index % len(SEEDS)]
    return name, mutate(random.Random(f"{seed}:{index}"), data)


def cases(seed: int, count: int) -> Iterator[tuple[int, str, bytes]]:
    """(index, seed file name, mutated bytes) for the first ``count`` cases of run ``seed``."""
    for index in range(count):
        yield index, *case(seed, index)


# Cases of run 2 on which Pillow raised something other than OSError/ValueError (found
# before decode_image mapped every decoder failure to InvalidImage), by the exception seen.
FOUND = {
    "AttributeError (EXIF IFDRational in JPEG)": 8434,
    "struct.error (EXIF in JPEG)": 11410,
    "TypeError (IFDRational in a TIFF tag)": 14306,
    "struct.error (EXIF in progressive JPEG)": 24712,
}
