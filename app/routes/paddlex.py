"""PaddleX / PaddleOCR 3.x basic serving (app/protocols/paddlex.py): ``POST /ocr`` parse ->
the file's pages (``paddlex_files``) -> cache -> render; errors answered from
``paddlex.ERRORS``. ``GET /health`` answers as upstream's does."""

from __future__ import annotations

import logging

from flask import Blueprint, Response, jsonify, request

from app.protocols import paddlex, paddlex_files
from app.protocols.errors import lookup
from app.routes import common
from app.service import current
from app.vocabulary import tiers_of

log = logging.getLogger("app.web")  # the name its log lines have always carried

blueprint = Blueprint("paddlex", __name__)

PATHS = ("/ocr", "/health")  # its routes: werkzeug's own errors there answer in its envelope


@blueprint.post("/ocr")
def paddlex_ocr() -> Response:
    service = current()
    settings = service.settings
    log_id = paddlex.new_log_id()
    try:
        req = paddlex.parse(
            request.get_data(), service.default_params, settings.paddlex_rec_score_thresh
        )
        log_id = req.log_id
        pages, is_pdf = paddlex_files.images(req, settings)
        outcomes = service.cache.get_or_compute_many(pages, req.params, common.controls(settings))
        visualize = settings.paddlex_visualize if req.visualize is None else req.visualize
        result = paddlex_files.result(
            req, pages, outcomes, is_pdf, visualize, settings.max_image_pixels
        )
    except paddlex.CAUGHT as exc:
        status, message = lookup(paddlex.ERRORS, exc) or (500, None)
        if message is not None:
            log.info("paddlex logId=%s: invalid input file: %s", log_id, exc)
        common.observe("paddlex", status, "none")
        return common.error(paddlex.error(log_id, status, message or str(exc)), status, exc)
    status_text = ",".join(sorted({o.status.value for o in outcomes}))
    common.observe("paddlex", 200, status_text)
    body = paddlex.success(log_id, result)
    headers = common.cache_headers(status_text, tiers_of(outcomes))
    return Response(body, mimetype=common.JSON, headers=headers)


@blueprint.get("/health")
def paddlex_health() -> Response:
    body = {"logId": paddlex.new_log_id(), "errorCode": 0, "errorMsg": "Healthy"}
    return jsonify(body)
