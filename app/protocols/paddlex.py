"""PaddleX / PaddleOCR 3.x basic serving: ``POST /ocr`` and ``GET /health`` (docs/PROTOCOLS.md §4).

Option fields that change the engine's output become ``OcrParams`` (part of the key);
``textRecScoreThresh`` only filters at render time; ``visualize`` draws from the cached
result and the request's own image (images are never stored).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ValidationError

from app.imaging import ImageTooLarge, InvalidImage
from app.protocols.errors import BadRequest
from app.vocabulary import (
    DETECTION_PARAMS,
    ClientError,
    EngineBusy,
    EngineError,
    OcrCacheError,
    OcrLine,
    OcrParams,
    OcrResult,
    QuotaExceeded,
    Unauthorized,
)

INVALID_FILE = "Invalid input file"  # upstream's message for any file it cannot read

# The error table: exception -> (HTTP status and ``errorCode``, the message; None: the
# exception's own). A fixed message hides the reason, which is logged instead.
ERRORS: dict[type[OcrCacheError], tuple[int, str | None]] = {
    ImageTooLarge: (422, None),  # upstream also says why
    InvalidImage: (422, INVALID_FILE),  # upstream's words for any unreadable file
    ClientError: (422, None),  # BadRequest, UnsupportedParams
    Unauthorized: (Unauthorized.status, None),  # with WWW-Authenticate
    QuotaExceeded: (QuotaExceeded.status, None),  # with Retry-After
    EngineBusy: (503, None),  # with Retry-After
    EngineError: (500, None),
}
CAUGHT = tuple(ERRORS)


class _Request(BaseModel):
    """The request's fields and types as upstream's ``InferRequest`` declares them (lax
    pydantic validation, unknown fields ignored), so type errors read exactly as upstream's."""

    file: str
    fileType: Literal[0, 1] | None = None  # noqa: N815 (the protocol's names)
    useDocOrientationClassify: bool | None = None  # noqa: N815
    useDocUnwarping: bool | None = None  # noqa: N815
    useTextlineOrientation: bool | None = None  # noqa: N815
    textDetLimitSideLen: int | None = None  # noqa: N815
    textDetLimitType: str | None = None  # noqa: N815
    textDetThresh: float | None = None  # noqa: N815
    textDetBoxThresh: float | None = None  # noqa: N815
    textDetUnclipRatio: float | None = None  # noqa: N815
    textRecScoreThresh: float | None = None  # noqa: N815
    returnWordBox: bool | None = None  # noqa: N815
    visualize: bool | None = None
    logId: str | None = None  # noqa: N815


# Checks stricter than upstream's types, kept deliberately (docs/PROTOCOLS.md "Compatibility"):
# values outside these ranges are meaningless (detection input is capped at 4000 px a side; a
# threshold of 1.5 finds nothing) or crash the pipeline; upstream passes them on and answers
# 200 with odd results or a 500.
# OcrParams field -> (check, expected)
_CHECKS: dict[str, tuple[Any, str]] = {
    "det_limit_side_len": (lambda v: 16 <= v <= 4096, "16..4096"),
    "det_limit_type": (lambda v: v in ("min", "max"), "'min' or 'max'"),
    "det_thresh": (lambda v: 0.0 <= v <= 1.0, "0..1"),
    "det_box_thresh": (lambda v: 0.0 <= v <= 1.0, "0..1"),
    "det_unclip_ratio": (lambda v: 0.0 < v <= 10.0, "(0, 10]"),
    "textline_orientation": (lambda v: True, "a boolean"),
    "return_word_box": (lambda v: True, "a boolean"),
}


def _camel(keyword: str) -> str:
    """PaddleOCR's ``predict()`` keyword as PaddleX spells the request field."""
    first, *rest = keyword.split("_")
    return first + "".join(part.title() for part in rest)


# request field -> (OcrParams field, check, expected); the names from the one table.
_PARAM_FIELDS: dict[str, tuple[str, Any, str]] = {
    _camel(keyword): (name, *_CHECKS[name])
    for name, keyword in {**DETECTION_PARAMS, "return_word_box": "return_word_box"}.items()
}
_UNSUPPORTED_WHEN_TRUE = {
    "useDocOrientationClassify": "document orientation classification",
    "useDocUnwarping": "document unwarping",
}


@dataclass(frozen=True)
class InferRequest:
    file: str
    file_type: int | None
    params: OcrParams
    rec_score_thresh: float
    visualize: bool | None  # None: the service's default (PADDLEX_VISUALIZE)
    log_id: str


def new_log_id() -> str:
    return str(uuid.uuid4())


def invalid(errors: list[dict[str, str]]) -> BadRequest:
    """A 422 whose message is the error list JSON-encoded, as upstream's handler writes it."""
    return BadRequest(json.dumps(errors))


def _value_error(name: str, message: str) -> BadRequest:
    return invalid([{"type": "value_error", "loc": f"body.{name}", "msg": message}])


def _loc(loc: tuple[str | int, ...]) -> str:
    """``("body", "file")`` -> ``body.file``; list indices as ``[i]`` (upstream's form)."""
    path = ""
    for i, part in enumerate(loc):
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if i else part)
    return path


def _load(body: bytes) -> Any:
    if not body:
        raise invalid([{"type": "missing", "loc": "body", "msg": "Field required"}])
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:  # what orjson refuses and Python's json takes (NaN, 1e400): range checks decide
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
        raise invalid(
            [{"type": "json_invalid", "loc": f"body[{pos}]", "msg": "JSON decode error"}]
        ) from None
    except RecursionError:
        error = {"type": "json_invalid", "loc": "body", "msg": "JSON decode error"}
        raise invalid([error]) from None


def parse(body: bytes, defaults: OcrParams, default_rec_thresh: float) -> InferRequest:
    data = _load(body)
    try:
        fields = _Request.model_validate(data, from_attributes=True)  # as FastAPI does
    except ValidationError as exc:
        errors = [
            {"type": e["type"], "loc": _loc(("body", *e["loc"])), "msg": e["msg"]}
            for e in exc.errors()
        ]
        raise invalid(errors) from None
    for name, what in _UNSUPPORTED_WHEN_TRUE.items():
        if getattr(fields, name):
            raise _value_error(name, f"{what} is not available in this deployment")
    changes = {}
    for name, (attr, check, expected) in _PARAM_FIELDS.items():
        value = getattr(fields, name)
        if value is None:
            continue
        if not check(value):
            raise _value_error(name, f"expected {expected}, got {value!r}")
        changes[attr] = value
    rec_thresh = fields.textRecScoreThresh
    if rec_thresh is None:
        rec_thresh = default_rec_thresh
    elif not 0.0 <= rec_thresh <= 1.0:
        raise _value_error("textRecScoreThresh", f"expected 0..1, got {rec_thresh!r}")
    return InferRequest(
        file=fields.file,
        file_type=fields.fileType,
        params=replace(defaults, **changes),
        rec_score_thresh=float(rec_thresh),
        visualize=fields.visualize,
        log_id=fields.logId[:128] if fields.logId is not None else new_log_id(),
    )


def pruned_result(result: OcrResult, params: OcrParams, rec_thresh: float) -> dict[str, Any]:
    """The fields PaddleOCR 3.x's pipeline puts in ``res`` (upstream's key order)."""
    kept = result.filtered(rec_thresh)
    pruned: dict[str, Any] = {
        "model_settings": {
            "use_doc_preprocessor": False,
            "use_textline_orientation": params.textline_orientation,
        },
        "dt_polys": [[list(p) for p in line.box] for line in result.lines],
        "text_det_params": {
            "limit_side_len": params.det_limit_side_len,
            "limit_type": params.det_limit_type,
            "thresh": params.det_thresh,
            "max_side_limit": 4000,
            "box_thresh": params.det_box_thresh,
            "unclip_ratio": params.det_unclip_ratio,
        },
        "text_type": "general",
    }
    if result.lines:  # upstream leaves the angles out when nothing was detected
        pruned["textline_orientation_angles"] = [line.angle for line in result.lines]
    pruned.update(
        {
            "text_rec_score_thresh": rec_thresh,
            "return_word_box": params.return_word_box,
            "rec_texts": [line.text for line in kept],
            "rec_scores": [line.score for line in kept],
            "rec_polys": [[list(p) for p in line.box] for line in kept],
            "rec_boxes": [_bounds(line.box) for line in kept],
        }
    )
    if params.return_word_box:
        pruned["text_word_boxes"] = [[list(box) for _, box in line.words] for line in kept]
        pruned["text_word"] = [[text for text, _ in line.words] for line in kept]
    return pruned


def _bounds(box: tuple[tuple[int, int], ...]) -> list[int]:
    xs, ys = [p[0] for p in box], [p[1] for p in box]
    return [min(xs), min(ys), max(xs), max(ys)]


def shown_lines(result: OcrResult, params: OcrParams, rec_thresh: float) -> list[OcrLine]:
    """What upstream's picture shows: the kept lines, or their words when word boxes are on."""
    kept = result.filtered(rec_thresh)
    if not params.return_word_box:
        return list(kept)
    return [
        OcrLine(text, line.score, ((x1, y1), (x2, y1), (x2, y2), (x1, y2)))
        for line in kept
        for text, (x1, y1, x2, y2) in line.words
        if x2 > x1 and y2 > y1
    ]


def success(log_id: str, result: dict[str, Any]) -> bytes:
    # upstream's key order
    return orjson.dumps({"logId": log_id, "result": result, "errorCode": 0, "errorMsg": "Success"})


def error(log_id: str, status: int, message: str) -> bytes:
    return orjson.dumps({"logId": log_id, "errorCode": status, "errorMsg": message})
