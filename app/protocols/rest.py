"""``POST /v1/ocr``: multipart field ``file`` or JSON ``{"image": "<base64>"}``."""

from __future__ import annotations

from typing import Any

import orjson
from flask import Request

from app.cache.region import Outcome
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest


def parse_image(request: Request) -> bytes:
    if request.mimetype == "multipart/form-data":
        upload = request.files.get("file")
        if upload is None:
            raise BadRequest("multipart upload needs a 'file' field", "missing_field")
        data = upload.read()
        if not data:
            raise BadRequest("uploaded file is empty", "empty_image")
        return data
    try:
        body = orjson.loads(request.get_data())
    except orjson.JSONDecodeError:
        raise BadRequest("body must be JSON or multipart/form-data", "invalid_json") from None
    if not isinstance(body, dict) or "image" not in body:
        raise BadRequest("JSON body needs an 'image' field (base64)", "missing_field")
    return decode_base64(body["image"])


def render(outcome: Outcome, engine: dict[str, Any]) -> bytes:
    return orjson.dumps(
        {**outcome.result.to_dict(), "engine": engine, "cache": outcome.status.value}
    )


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}
