"""PaddleX / PaddleOCR 3.x basic serving over HTTP: ``POST /ocr`` (the call itself:
``app/protocols/paddlex_serve.py``, shared with the high-stability model ``ocr`` of the Open
Inference Protocol). ``GET /health`` answers as upstream's does (a Flask route)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from app.protocols import paddlex, paddlex_serve
from app.routes import common
from app.routes.common import JSON, Answer, Call
from app.service import OcrService

blueprint = Blueprint("paddlex", __name__)

PATHS = ("/ocr", "/health")  # its paths: werkzeug's own errors there answer in its envelope


def handle(service: OcrService, call: Call) -> Answer:
    served = paddlex_serve.serve(service, call.request.get_data(), lambda: common.controls(call))
    common.observe(call, "paddlex", served.status, served.cache_status)
    if served.error is not None:
        return common.error(served.body, served.status, served.error)
    headers = [("Content-Type", JSON), *common.cache_headers(served.cache_status, served.tiers)]
    return Answer(200, served.body, headers)


@blueprint.get("/health")
def paddlex_health() -> Response:
    body = {"logId": paddlex.new_log_id(), "errorCode": 0, "errorMsg": "Healthy"}
    return jsonify(body)
