"""The pictures of a PaddleX ``/ocr`` answer, drawn from the cached result and the request's image.

``ocrImage`` looks like upstream's OCR visualisation: the page with each kept line's box
filled in a colour (blended half over the page) on the left, and a white panel of the same
size on the right with each recognised text written into its box and the box outlined,
twice the page's width. Colours come from ``random.Random(0)`` as upstream's do. Both
pictures are JPEG (quality 95, as OpenCV encodes by default), base64, shrunk as upstream does
to fit 2000x2000 (with OpenCV's bilinear resize, as upstream). Texts use DejaVu Sans when the
system has it (Latin, Greek, Cyrillic), else Pillow's built-in font; scripts a font lacks show
as boxes, as upstream's do with its own font.
"""

from __future__ import annotations

import base64
import functools
import io
import random
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from app.vocabulary import OcrLine

MAX_OUTPUT_SIDE = 2000  # upstream's default max_output_img_size (2000, 2000)
JPEG_QUALITY = 95
FONT_NAME = "DejaVuSans.ttf"

Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


def pictures(image: Image.Image, lines: Sequence[OcrLine]) -> dict[str, str]:
    """``ocrImage`` and ``inputImage`` for an RGB page and the lines kept for the answer."""
    return {"ocrImage": _jpeg_b64(ocr_image(image, lines)), "inputImage": _jpeg_b64(image)}


def ocr_image(image: Image.Image, lines: Sequence[OcrLine]) -> Image.Image:
    width, height = image.size
    filled = image.copy()
    fill = ImageDraw.Draw(filled)
    panel = Image.new("RGB", (width, height), "white")
    write = ImageDraw.Draw(panel)
    colours = random.Random(0)
    for line in lines:
        colour = (colours.randint(0, 255), colours.randint(0, 255), colours.randint(0, 255))
        polygon = [tuple(p) for p in line.box]
        fill.polygon(polygon, fill=colour)
        _write_text(write, line)
        write.polygon(polygon, outline=colour, width=1)
    shown = Image.new("RGB", (2 * width, height), "white")
    shown.paste(Image.blend(image, filled, 0.5), (0, 0))
    shown.paste(panel, (width, 0))
    return shown


def _write_text(draw: ImageDraw.ImageDraw, line: OcrLine) -> None:
    """The text at the box's top-left corner, sized to the box's height (axis-aligned)."""
    xs, ys = [p[0] for p in line.box], [p[1] for p in line.box]
    box_w, box_h = max(xs) - min(xs), max(ys) - min(ys)
    if not line.text or box_w < 1 or box_h < 1:
        return
    font = _font(max(6, min(int(box_h * 0.8), 200)))
    text_w = draw.textlength(line.text, font=font)
    if text_w > box_w:  # narrower than the box needs: shrink to fit its width
        font = _font(max(6, int(font.size * box_w / text_w)))  # type: ignore[union-attr]
    draw.text((min(xs), min(ys)), line.text, fill="black", font=font)


@functools.lru_cache(maxsize=64)
def _font(size: int) -> Font:
    try:
        return ImageFont.truetype(FONT_NAME, size)
    except OSError:
        return ImageFont.load_default(size)


def _jpeg_b64(image: Image.Image) -> str:
    width, height = image.size
    if width > MAX_OUTPUT_SIDE or height > MAX_OUTPUT_SIDE:
        import cv2  # installed with paddleocr; its plain bilinear resize is upstream's

        factor = MAX_OUTPUT_SIDE / width if width >= height else MAX_OUTPUT_SIDE / height
        size = (int(factor * width), int(factor * height))
        image = Image.fromarray(cv2.resize(np.asarray(image), size, interpolation=cv2.INTER_LINEAR))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return base64.b64encode(buf.getvalue()).decode()
