"""``POST /v1/ocr``: multipart field ``file`` or JSON ``{"image": "<base64>"}``; optional
``min_score`` (0..1, default ``OCR_REC_SCORE_THRESH``) filters lines at render time."""

from __future__ import annotations

from typing import Any

import orjson
from flask import Request

from app.cache.region import Outcome
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest


def decode_base64_field(text: Any) -> bytes:
    return decode_base64(text)


def parse(request: Request, default_min_score: float) -> tuple[bytes, float]:
    """(image bytes, min_score) from a multipart or JSON request."""
    if request.mimetype == "multipart/form-data":
        upload = request.files.get("file")
        if upload is None:
            raise BadRequest("multipart upload needs a 'file' field", "missing_field")
        data = upload.read()
        if not data:
            raise BadRequest("uploaded file is empty", "empty_image")
        return data, _min_score(request.form.get("min_score"), default_min_score)
    try:
        body = orjson.loads(request.get_data())
    except orjson.JSONDecodeError:
        raise BadRequest("body must be JSON or multipart/form-data", "invalid_json") from None
    if not isinstance(body, dict) or "image" not in body:
        raise BadRequest("JSON body needs an 'image' field (base64)", "missing_field")
    return decode_base64(body["image"]), _min_score(body.get("min_score"), default_min_score)


def _min_score(raw: Any, default: float) -> float:
    if raw is None:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise BadRequest("min_score must be a number in 0..1", "invalid_field") from None
    if isinstance(raw, bool) or not 0.0 <= value <= 1.0:
        raise BadRequest("min_score must be a number in 0..1", "invalid_field")
    return value


def render(outcome: Outcome, engine: dict[str, Any], min_score: float) -> bytes:
    result = outcome.result
    return orjson.dumps(
        {
            "width": result.width,
            "height": result.height,
            "lines": [line.to_dict() for line in result.filtered(min_score)],
            "engine": engine,
            "cache": outcome.status.value,
        }
    )


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message}})
