"""Rendering PDF pages to images offline (pypdfium2), for PaddleX ``fileType 0`` requests."""

from __future__ import annotations

import io

from app import metrics
from app.imaging import InvalidImage, check_size


def renderer() -> str:
    """The renderer's identity (pypdfium2 and its PDFium build): the same PDF renders to
    the same page images only under the same one."""
    from pypdfium2.version import PDFIUM_INFO, PYPDFIUM_INFO

    return f"pypdfium2-{PYPDFIUM_INFO}-pdfium-{PDFIUM_INFO.build}"


def render_pages(data: bytes, max_pages: int, scale: float, max_pixels: int) -> list[bytes]:
    """PNG bytes of the first ``max_pages`` pages (upstream also keeps only the first N).

    Each page's PNG is what gets hashed and cached, so the same PDF page is a hit whether it
    arrives alone or inside another document (for the same renderer version and scale).
    """
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        raise InvalidImage(f"not a readable PDF: {exc}") from None
    try:
        pages = []
        for index in range(min(len(pdf), max_pages)):
            page = pdf[index]
            width, height = page.get_size()
            # Sides and aspect ratio too, before rendering (see ``imaging.check_size``).
            check_size(max(1, round(width * scale)), max(1, round(height * scale)), max_pixels)
            image = page.render(scale=scale).to_pil()
            buf = io.BytesIO()
            image.save(buf, format="PNG", compress_level=1)
            pages.append(buf.getvalue())
            metrics.PDF_PAGES_RENDERED.inc()
        if not pages:
            raise InvalidImage("PDF has no pages")
        return pages
    except pdfium.PdfiumError as exc:
        raise InvalidImage(f"not a readable PDF page: {exc}") from None
    finally:
        pdf.close()
