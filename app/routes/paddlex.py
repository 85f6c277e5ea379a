"""PaddleX / PaddleOCR 3.x basic serving (app/protocols/paddlex.py): ``POST /ocr`` parse ->
the file's pages (``paddlex_files``) -> cache -> render; errors answered from
``paddlex.ERRORS``. ``GET /health`` answers as upstream's does (a Flask route)."""

from __future__ import annotations

import logging

from flask import Blueprint, Response, jsonify

from app.protocols import paddlex, paddlex_files
from app.protocols.errors import lookup
from app.routes import common
from app.routes.common import JSON, Answer, Call
from app.service import OcrService
from app.vocabulary import tiers_of

log = logging.getLogger("app.web")  # the name its log lines have always carried

blueprint = Blueprint("paddlex", __name__)

PATHS = ("/ocr", "/health")  # its paths: werkzeug's own errors there answer in its envelope


def handle(service: OcrService, call: Call) -> Answer:
    settings = service.settings
    max_pixels = settings.server.max_image_pixels
    log_id = paddlex.new_log_id()
    try:
        req = paddlex.parse(
            call.request.get_data(),
            service.default_params,
            settings.protocols.paddlex_rec_score_thresh,
        )
        log_id = req.log_id
        data, is_pdf = paddlex_files.load(
            req, settings.protocols, settings.server.max_request_bytes
        )
        visualize = settings.protocols.paddlex_visualize if req.visualize is None else req.visualize
        controls = common.controls(call)
        pages: list[bytes] | None = [data]
        if is_pdf:
            pages, outcomes = service.cache.get_or_compute_document(
                data, paddlex_files.document_spec(settings.protocols),
                lambda: paddlex_files.render(data, settings.protocols, max_pixels),
                req.params, controls, need_pages=visualize,
            )  # fmt: skip
        else:
            outcomes = service.cache.get_or_compute_many([data], req.params, controls)
        result = paddlex_files.result(req, pages, outcomes, is_pdf, visualize, max_pixels)
    except paddlex.CAUGHT as exc:
        status, message = lookup(paddlex.ERRORS, exc) or (500, None)
        if message is not None:
            log.info("paddlex logId=%s: invalid input file: %s", log_id, exc)
        common.observe(call, "paddlex", status, "none")
        return common.error(paddlex.error(log_id, status, message or str(exc)), status, exc)
    status_text = ",".join(sorted({o.status.value for o in outcomes}))
    common.observe(call, "paddlex", 200, status_text)
    headers = [("Content-Type", JSON), *common.cache_headers(status_text, tiers_of(outcomes))]
    return Answer(200, paddlex.success(log_id, result), headers)


@blueprint.get("/health")
def paddlex_health() -> Response:
    body = {"logId": paddlex.new_log_id(), "errorCode": 0, "errorMsg": "Healthy"}
    return jsonify(body)
