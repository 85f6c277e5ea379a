"""Decoding uploaded image bytes safely (Pillow), before anything reaches an engine."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# We enforce our own pixel limit before decoding; Pillow's own check stays as a backstop.
Image.MAX_IMAGE_PIXELS = 200_000_000

# The only formats Pillow may identify uploads as. Without a list, Image.open tries every
# plugin: EPS would run Ghostscript, and PSD, ICO, PDF and the rest are attack surface that OCR
# does not need. MPO (multi-picture JPEG from phones) opens through the JPEG plugin; PPM covers
# PGM and PBM.
FORMATS = ("JPEG", "PNG", "BMP", "TIFF", "WEBP", "GIF", "PPM")


class InvalidImage(ValueError):
    """The bytes are not an image we can decode (client error, never cached)."""


class ImageTooLarge(InvalidImage):
    """The image declares more pixels than the configured limit."""


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # H x W x 3, uint8, RGB
    width: int
    height: int


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """Decode to RGB, honouring EXIF orientation as OpenCV's imdecode does.

    The pixel limit is checked on the header alone, so a decompression bomb is refused
    before a single pixel is decoded.
    """
    if not data:
        raise InvalidImage("empty image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width < 1 or height < 1:
                raise InvalidImage("image has zero width or height")
            if width * height > max_pixels:
                raise ImageTooLarge(
                    f"image is {width}x{height} pixels, over the limit of {max_pixels}"
                )
            img.load()
            img = ImageOps.exif_transpose(img)
            rgb = img.convert("RGB")
    except InvalidImage:
        raise
    except UnidentifiedImageError:
        accepted = ", ".join(FORMATS)
        raise InvalidImage(f"not a decodable image (accepted formats: {accepted})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image is over the pixel limit: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidImage(f"not a decodable image: {exc}") from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    return DecodedImage(pixels=pixels, width=rgb.width, height=rgb.height)
