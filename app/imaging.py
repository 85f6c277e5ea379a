"""Decoding uploaded image bytes safely (Pillow), before anything reaches an engine."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from app.vocabulary import ClientError

# We enforce our own pixel limit before decoding; Pillow's own check stays as a backstop.
Image.MAX_IMAGE_PIXELS = 200_000_000

# The only formats Pillow may identify uploads as. Without a list, Image.open tries every
# plugin: EPS would run Ghostscript, and PSD, ICO, PDF and the rest are attack surface that OCR
# does not need. MPO (multi-picture JPEG from phones) opens through the JPEG plugin; PPM covers
# PGM and PBM.
FORMATS = ("JPEG", "PNG", "BMP", "TIFF", "WEBP", "GIF", "PPM")


# Decode-time bounds beside the pixel limit (issue 11 §3). A 1x60,000,000 PNG is under the
# pixel limit, yet resizing it needs gigabytes: every side and the aspect ratio are capped
# too. Long receipts (about 1:30) and line crops (about 1:60) stay well inside.
MAX_SIDE = 20_000
MAX_ASPECT = 200
# A progressive JPEG may repeat scans, each a pass over the whole image (a 609 KB file with
# 10,000 scans cost a reviewer 23 CPU-s). Encoders write a few dozen at most (libjpeg's
# progressive script: 10).
MAX_JPEG_SCANS = 100
_BAND_BYTES = 4 << 20


class InvalidImage(ClientError):
    """The bytes are not an image we can decode (client error, never cached)."""

    code = "invalid_image"


class ImageTooLarge(InvalidImage):
    """The image declares more pixels, a longer side or more decoding work than allowed."""


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # H x W x 3, uint8, RGB
    width: int
    height: int


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """Decode to RGB, honouring EXIF orientation as OpenCV's imdecode does.

    Size, sides, aspect ratio and JPEG scan count are checked on the header alone, so a
    decompression bomb is refused before a single pixel is decoded. Whatever a decoder
    raises on malformed bytes (Pillow also raises TypeError, struct.error, IndexError...)
    is an invalid image, never a server error.
    """
    if not data:
        raise InvalidImage("empty image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img: Image.Image = Image.open(io.BytesIO(data), formats=FORMATS)
            check_size(*img.size, max_pixels)
            if img.format in ("JPEG", "MPO"):
                check_jpeg_scans(data)
            img.load()
            ImageOps.exif_transpose(img, in_place=True)  # no copy when there is nothing to do
            if img.mode != "RGB":
                img = img.convert("RGB")  # rebinding frees the original: one copy at a time
            pixels = _pixels(img)
    except InvalidImage:
        raise
    except UnidentifiedImageError:
        accepted = ", ".join(FORMATS)
        raise InvalidImage(f"not a decodable image (accepted formats: {accepted})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image is over the pixel limit: {exc}") from None
    except MemoryError:
        raise ImageTooLarge("decoding the image needs more memory than allowed") from None
    except Exception as exc:  # any decoder failure on client bytes is the client's error
        raise InvalidImage(f"not a decodable image: {type(exc).__name__}: {exc}") from None
    return DecodedImage(pixels=pixels, width=img.width, height=img.height)


def _pixels(img: Image.Image) -> np.ndarray:
    """The pixels as an H x W x 3 array, copied in bands of rows: ``np.asarray(img)`` goes
    through ``tobytes()``, which holds two more full copies at its peak (+360 MB at 60 Mpx)."""
    width, height = img.size
    out = np.empty((height, width, 3), dtype=np.uint8)
    rows = max(1, _BAND_BYTES // (width * 3))
    for top in range(0, height, rows):
        band = img.crop((0, top, width, min(top + rows, height)))
        out[top : top + band.height] = np.frombuffer(band.tobytes(), np.uint8).reshape(
            band.height, width, 3
        )
    return out


def check_size(width: int, height: int, max_pixels: int) -> None:
    """Refuse sizes whose decoding or resizing would cost more than a page's worth."""
    if width < 1 or height < 1:
        raise InvalidImage("image has zero width or height")
    if width * height > max_pixels:
        raise ImageTooLarge(f"image is {width}x{height} pixels, over the limit of {max_pixels}")
    if max(width, height) > MAX_SIDE:
        raise ImageTooLarge(f"image is {width}x{height}: a side is over {MAX_SIDE} pixels")
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise ImageTooLarge(f"image is {width}x{height}: aspect ratio over {MAX_ASPECT}:1")


def check_jpeg_scans(data: bytes) -> None:
    """Refuse a JPEG with more than ``MAX_JPEG_SCANS`` scans, counted without decoding.

    ``FF DA`` (start of scan) cannot occur inside entropy-coded data (an ``FF`` there is
    always followed by ``00`` or a restart marker), so counting it bounds the number of
    scans; copies inside metadata (an EXIF thumbnail) only add a few.
    """
    scans = data.count(b"\xff\xda")
    if scans > MAX_JPEG_SCANS:
        raise ImageTooLarge(f"JPEG has {scans} scans, over the limit of {MAX_JPEG_SCANS}")
