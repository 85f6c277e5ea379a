"""PaddleX's ``file`` in, pages out: the file field (a URL or base64; an image or a PDF) to
the images the cache sees, and the ``ocrResults``/``dataInfo`` of the answer, one item per page
(pictures drawn from the cached result and the request's own image; images are never stored)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from PIL import Image

from app.imaging import InvalidImage, decode_image
from app.pdf import render_pages, renderer
from app.protocols import fetch, paddlex_images
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest
from app.protocols.paddlex import InferRequest, pruned_result, shown_lines
from app.vocabulary import OcrResult, Outcome

if TYPE_CHECKING:
    from app.config import ProtocolSettings


def load(req: InferRequest, settings: ProtocolSettings, max_bytes: int) -> tuple[bytes, bool]:
    """The file a PaddleX request names (fetched, at most ``max_bytes``, or decoded), and
    whether it is a PDF."""
    file_type = req.file_type
    if fetch.is_url(req.file):
        if file_type is None:
            path = req.file.split("?", 1)[0].lower()
            file_type = 0 if path.endswith(".pdf") else 1
        data = fetch.fetch(
            req.file,
            settings.url_hosts(),
            max_bytes,
            settings.url_input_timeout_seconds,
        )
    else:
        if file_type is None:
            raise BadRequest("File type cannot be determined")
        try:
            data = decode_base64(req.file)
        except BadRequest as exc:
            raise InvalidImage(str(exc)) from None
    return data, file_type == 0


def render(data: bytes, settings: ProtocolSettings, max_pixels: int) -> list[bytes]:
    """A PDF's pages as the images the cache sees."""
    return render_pages(data, settings.pdf_max_pages, settings.pdf_render_scale, max_pixels)


def document_spec(settings: ProtocolSettings) -> str:
    """What a PDF's page images depend on besides its bytes (the document tier's key)."""
    return f"{renderer()}-x{settings.pdf_render_scale:g}-p{settings.pdf_max_pages}"


def result(
    req: InferRequest,
    pages: Sequence[bytes] | None,
    outcomes: Sequence[Outcome],
    is_pdf: bool,
    visualize: bool,
    max_pixels: int,
) -> dict[str, Any]:
    """The answer's ``result``: ``ocrResults`` (one per page) and ``dataInfo``; ``pages``
    (the page images) are needed only to ``visualize``."""
    images: Sequence[bytes | None] = pages if pages is not None else [None] * len(outcomes)
    items = [
        _page(data, outcome.result, req, visualize, max_pixels)
        for data, outcome in zip(images, outcomes, strict=True)
    ]
    sizes = [{"width": o.result.width, "height": o.result.height} for o in outcomes]
    data_info = (
        {"numPages": len(sizes), "pages": sizes, "type": "pdf"}
        if is_pdf
        else {**sizes[0], "type": "image"}
    )
    return {"ocrResults": items, "dataInfo": data_info}


def _page(
    data: bytes | None, result: OcrResult, req: InferRequest, visualize: bool, max_pixels: int
) -> dict[str, Any]:
    """One ``ocrResults`` item; the pictures are drawn from the (cached) result."""
    item: dict[str, Any] = {"prunedResult": pruned_result(result, req.params, req.rec_score_thresh)}
    if visualize:
        assert data is not None  # pages are rendered whenever pictures are drawn
        page = decode_image(data, max_pixels)
        shown = shown_lines(result, req.params, req.rec_score_thresh)
        item.update(paddlex_images.pictures(Image.fromarray(page.pixels), shown))
    return item
