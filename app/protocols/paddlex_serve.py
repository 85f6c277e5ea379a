"""A PaddleX basic-serving body to its answer, whichever transport carries it: ``POST /ocr``
(``app/routes/paddlex.py``) and the high-stability model ``ocr`` of the Open Inference
Protocol (``app/protocols/kserve_models.py``). Parse (``paddlex.parse``) -> the file's pages
(``paddlex_files``) -> cache -> render; errors answered from ``paddlex.ERRORS``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.protocols import paddlex, paddlex_files
from app.protocols.errors import lookup
from app.vocabulary import CacheControls, tiers_of

if TYPE_CHECKING:
    from app.service import OcrService

log = logging.getLogger("app.web")  # the name its log lines have always carried


@dataclass(frozen=True)
class Served:
    """What ``POST /ocr`` answers for a body, before its transport: the status (also the
    envelope's ``errorCode``), the envelope, the cache status and tiers, and the error raised
    (None: success). PaddleX's high-stability model ``ocr`` (``kserve_models``) carries
    the same envelope in its output tensor."""

    status: int
    body: bytes
    cache_status: str = "none"
    tiers: str = ""
    error: Exception | None = None


def serve(service: OcrService, body: bytes, controls: Callable[[], CacheControls]) -> Served:
    """The answer to one ``/ocr`` request body; ``controls``: its cache controls, read once
    the body parsed (a bad header is the client's error like a bad field)."""
    settings = service.settings
    max_pixels = settings.server.max_image_pixels
    log_id = paddlex.new_log_id()
    try:
        req = paddlex.parse(
            body, service.default_params, settings.protocols.paddlex_rec_score_thresh
        )
        log_id = req.log_id
        data, is_pdf = paddlex_files.load(
            req, settings.protocols, settings.server.max_request_bytes
        )
        visualize = settings.protocols.paddlex_visualize if req.visualize is None else req.visualize
        asked = controls()
        pages: list[bytes] | None = [data]
        if is_pdf:
            pages, outcomes = service.cache.get_or_compute_document(
                data, paddlex_files.document_spec(settings.protocols),
                lambda: paddlex_files.render(data, settings.protocols, max_pixels),
                req.params, asked, need_pages=visualize,
            )  # fmt: skip
        else:
            outcomes = service.cache.get_or_compute_many([data], req.params, asked)
        result = paddlex_files.result(req, pages, outcomes, is_pdf, visualize, max_pixels)
    except paddlex.CAUGHT as exc:
        status, message = lookup(paddlex.ERRORS, exc) or (500, None)
        if message is not None:
            log.info("paddlex logId=%s: invalid input file: %s", log_id, exc)
        return Served(status, paddlex.error(log_id, status, message or str(exc)), error=exc)
    status_text = ",".join(sorted({o.status.value for o in outcomes}))
    return Served(200, paddlex.success(log_id, result), status_text, tiers_of(outcomes))
