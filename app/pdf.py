"""Rendering PDF pages to images offline (pypdfium2): PaddleX ``fileType 0`` requests, and
document jobs one page at a time."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from app import metrics
from app.imaging import InvalidImage, check_size

PDF_MAGIC = b"%PDF-"


def renderer() -> str:
    """The renderer's identity (pypdfium2 and its PDFium build): the same PDF renders to
    the same page images only under the same one."""
    from pypdfium2.version import PDFIUM_INFO, PYPDFIUM_INFO

    return f"pypdfium2-{PYPDFIUM_INFO}-pdfium-{PDFIUM_INFO.build}"


@contextmanager
def pages(
    data: bytes | BinaryIO, scale: float, max_pixels: int
) -> Iterator[tuple[int, Callable[[int], bytes]]]:
    """(the page count, ``render(index)``: one page's PNG bytes), the document open once:
    pages are rendered one at a time, as they are needed, and each page and its bitmap are
    closed once rendered, so a long job holds one page whatever its length
    (``bench/job_memory.py``).

    Each page's PNG is what gets hashed and cached, so the same PDF page is a hit whether it
    arrives alone, inside another document or in a job (for the same renderer and scale).
    """
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        raise InvalidImage(f"not a readable PDF: {exc}") from None

    def render(index: int) -> bytes:
        """One page's PNG."""
        try:
            page = pdf[index]
        except pdfium.PdfiumError as exc:
            raise InvalidImage(f"not a readable PDF page: {exc}") from None
        try:
            width, height = page.get_size()
            # Sides and aspect ratio too, before rendering (see ``imaging.check_size``).
            check_size(max(1, round(width * scale)), max(1, round(height * scale)), max_pixels)
            bitmap = page.render(scale=scale)
            try:
                image = bitmap.to_pil()
                buf = io.BytesIO()
                image.save(buf, format="PNG", compress_level=1)
            finally:
                bitmap.close()
        except pdfium.PdfiumError as exc:
            raise InvalidImage(f"not a readable PDF page: {exc}") from None
        finally:
            page.close()
        metrics.PDF_PAGES_RENDERED.inc()
        return buf.getvalue()

    try:
        yield len(pdf), render
    finally:
        pdf.close()


def page_count(data: bytes | BinaryIO) -> int:
    """How many pages the PDF has (``InvalidImage``: not a PDF pdfium can open, encrypted
    ones included, or one without pages); a file is read only as far as pdfium needs."""
    with pages(data, 1.0, 1) as (count, _):
        if count < 1:
            raise InvalidImage("PDF has no pages")
        return count


def render_pages(data: bytes, max_pages: int, scale: float, max_pixels: int) -> list[bytes]:
    """PNG bytes of the first ``max_pages`` pages (upstream also keeps only the first N)."""
    with pages(data, scale, max_pixels) as (count, render):
        if count < 1:
            raise InvalidImage("PDF has no pages")
        return [render(index) for index in range(min(count, max_pages))]
