"""``POST /v1/ocr``: multipart field ``file`` or JSON ``{"image": "<base64>"}``; optional
``min_score`` (0..1, default ``OCR_REC_SCORE_THRESH``) filters lines at render time.

Optional ``task`` (default: the engine's, ``HUNYUAN_TASK`` for OCR_ENGINE=hunyuan) with its
arguments ``fields`` (extraction: a JSON list, or repeated / comma-separated form fields) and
``target_language`` (translation). Free-text prompts are refused: a fixed task set keeps one
cache entry per task and the model's answers at the quality its card measures.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import Any

import orjson
import pybase64
from werkzeug.wrappers import Request

from app.engines.tasks import EXTRACTION, task_params
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest, error_envelope
from app.vocabulary import (
    ClientError,
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrCacheError,
    OcrParams,
    Outcome,
    QuotaExceeded,
    Refused,
    Unauthorized,
)

# The error table: exception -> HTTP status; the body's ``error.code`` is the exception's own.
ERRORS: dict[type[OcrCacheError], int] = {
    Refused: 400,  # Unauthorized 401, QuotaExceeded 429: their own status
    Unauthorized: Unauthorized.status,  # with WWW-Authenticate
    QuotaExceeded: QuotaExceeded.status,  # with Retry-After
    ClientError: 400,  # BadRequest, InvalidImage, UnsupportedParams
    EngineBusy: 503,  # with Retry-After
    EngineTimeout: 504,
    EngineError: 503,
}
CAUGHT = tuple(ERRORS)

# Fields that would carry a prompt: refused rather than silently ignored.
FREE_TEXT_FIELDS = ("prompt", "messages", "instruction", "system", "question", "query")


@dataclass(frozen=True)
class RestRequest:
    data: bytes
    min_score: float
    task: str | None = None
    fields: list[Any] | None = None
    target_language: Any = None

    def params(self, defaults: OcrParams, default_task: str, default_language: str) -> OcrParams:
        """The canonical params; raises ``UnsupportedParams`` for a bad task or argument."""
        return task_params(
            defaults, self.task or default_task, self.fields, self.target_language, default_language
        )


def parse(request: Request, default_min_score: float) -> RestRequest:
    """The image, min_score and task spec from a multipart or JSON request."""
    if request.mimetype == "multipart/form-data":
        form = request.form
        _refuse_prompts(form)
        upload = request.files.get("file")
        if upload is None:
            raise BadRequest("multipart upload needs a 'file' field", "missing_field")
        data = upload.read()
        if not data:
            raise BadRequest("uploaded file is empty", "empty_image")
        fields = None
        if "fields" in form:
            fields = [f for raw in form.getlist("fields") for f in raw.split(",") if f.strip()]
        return RestRequest(
            data,
            parse_min_score(form.get("min_score"), default_min_score),
            _task(form.get("task")),
            fields,
            form.get("target_language"),
        )
    raw = request.get_data()
    image = image_only(raw)
    if image is not None:
        return RestRequest(image, default_min_score)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("body must be JSON or multipart/form-data", "invalid_json") from None
    if not isinstance(body, dict) or "image" not in body:
        raise BadRequest("JSON body needs an 'image' field (base64)", "missing_field")
    _refuse_prompts(body)
    fields = body.get("fields")
    if fields is not None and not isinstance(fields, list):
        raise BadRequest("fields must be a list of strings", "invalid_field")
    return RestRequest(
        decode_base64(body["image"]),
        parse_min_score(body.get("min_score"), default_min_score),
        _task(body.get("task")),
        fields,
        body.get("target_language"),
    )


def image_only(raw: bytes) -> bytes | None:
    """The image of the commonest body, ``{"image": "<base64>"}`` and nothing else, without
    parsing the JSON (for a 300 KB image that parse costs more than the rest of a hit).
    Exactly that one-key object with a string free of quotes and escapes qualifies, and only
    when it is valid base64; anything else (``None``) takes the full parse, which answers
    malformed input with the same errors as before."""
    for head in _IMAGE_HEADS:
        if raw.startswith(head):
            break
    else:
        return None
    end = len(raw.rstrip()) - 2
    start = len(head)
    if (
        raw[end : end + 2] != b'"}'
        or raw.find(b'"', start) != end
        or raw.find(b"\\", start, end) >= 0
    ):
        return None
    try:
        data = pybase64.b64decode(memoryview(raw)[start:end], validate=True)
    except (binascii.Error, ValueError):
        return None
    return data or None


_IMAGE_HEADS = (b'{"image": "', b'{"image":"')


def _refuse_prompts(body: Any) -> None:
    for name in FREE_TEXT_FIELDS:
        if name in body:
            raise BadRequest(
                f"'{name}': free-text prompts are not accepted; choose a task "
                "(spotting, parsing, extraction with fields, translation with target_language)",
                "prompt_not_accepted",
            )


def _task(raw: Any) -> str | None:
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise BadRequest("task must be a string", "invalid_field")
    return raw.strip().lower()


def parse_min_score(raw: Any, default: float) -> float:
    if raw is None:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise BadRequest("min_score must be a number in 0..1", "invalid_field") from None
    if isinstance(raw, bool) or not 0.0 <= value <= 1.0:
        raise BadRequest("min_score must be a number in 0..1", "invalid_field")
    return value


def render(
    outcome: Outcome, engine: dict[str, Any], min_score: float, task: str, show_cache: bool = True
) -> bytes:
    """Lines (line tasks) or ``text`` (text tasks; extraction also as a ``data`` object).
    ``show_cache``: False hides the cache status from an untrusted caller."""
    result = outcome.result
    body: dict[str, Any] = {
        "width": result.width,
        "height": result.height,
        "task": task,
        # What OcrLine.to_dict gives, without its copies: orjson writes tuples as arrays.
        "lines": [
            {"text": line.text, "score": line.score, "box": line.box, "angle": line.angle}
            if not line.words
            else {
                "text": line.text,
                "score": line.score,
                "box": line.box,
                "angle": line.angle,
                "words": line.words,
            }  # fmt: skip
            for line in result.lines
            if line.score >= min_score
        ],
    }
    if result.text is not None:
        body["text"] = result.text
        if task == EXTRACTION:
            body["data"] = orjson.loads(result.text)
    body["engine"] = engine
    if show_cache:
        body["cache"] = outcome.status.value
        if outcome.tier:
            body["cache_tier"] = outcome.tier
        if outcome.details:  # a "similar" hit: its source and figures (as the headers)
            body["cache_details"] = dict(outcome.details)
    return orjson.dumps(body)


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps(error_envelope(code, message))
