"""PaddleX / PaddleOCR 3.x basic serving: ``POST /ocr`` and ``GET /health`` (PROTOCOLS.md §4).

Option fields that change the engine's output become ``OcrParams`` (part of the key);
``textRecScoreThresh`` only filters at render time; ``visualize`` draws from the cached
result and the request's own image (images are never stored).
"""

from __future__ import annotations

import base64
import io
import uuid
from dataclasses import dataclass, replace
from typing import Any

import orjson
from PIL import Image, ImageDraw

from app.engines.base import OcrParams, OcrResult
from app.imaging import FORMATS
from app.protocols.errors import BadRequest

MAX_OUTPUT_IMAGE_SIDE = 2000  # upstream's default max_output_img_size

# request field -> (OcrParams field, type, check, message)
_PARAM_FIELDS: dict[str, tuple[str, type, Any, str]] = {
    "textDetLimitSideLen": ("det_limit_side_len", int, lambda v: 16 <= v <= 4096, "16..4096"),
    "textDetLimitType": ("det_limit_type", str, lambda v: v in ("min", "max"), "'min' or 'max'"),
    "textDetThresh": ("det_thresh", float, lambda v: 0.0 <= v <= 1.0, "0..1"),
    "textDetBoxThresh": ("det_box_thresh", float, lambda v: 0.0 <= v <= 1.0, "0..1"),
    "textDetUnclipRatio": ("det_unclip_ratio", float, lambda v: 0.0 < v <= 10.0, "(0, 10]"),
    "useTextlineOrientation": ("textline_orientation", bool, lambda v: True, "a boolean"),
}
_UNSUPPORTED_WHEN_TRUE = {
    "useDocOrientationClassify": "document orientation classification",
    "useDocUnwarping": "document unwarping",
    "returnWordBox": "word boxes",
}


@dataclass(frozen=True)
class InferRequest:
    file: str
    file_type: int | None
    params: OcrParams
    rec_score_thresh: float
    visualize: bool
    log_id: str


def new_log_id() -> str:
    return str(uuid.uuid4())


def _typed(name: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise BadRequest(f"{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def parse(body: bytes, defaults: OcrParams, default_rec_thresh: float) -> InferRequest:
    # Unknown fields are ignored, as upstream's pydantic models do.
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadRequest("body must be a JSON object") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    if "file" not in data:
        raise BadRequest("file: field required")
    file = _typed("file", data["file"], str)
    file_type = data.get("fileType")
    if file_type is not None and (_typed("fileType", file_type, int) not in (0, 1)):
        raise BadRequest("fileType: expected 0 (PDF) or 1 (image)")
    for name, what in _UNSUPPORTED_WHEN_TRUE.items():
        if data.get(name) is not None and _typed(name, data[name], bool):
            raise BadRequest(f"{name}: {what} is not available in this deployment")
    changes = {}
    for name, (attr, kind, check, expected) in _PARAM_FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        value = _typed(name, value, kind)
        if not check(value):
            raise BadRequest(f"{name}: expected {expected}, got {value!r}")
        changes[attr] = value
    rec_thresh = data.get("textRecScoreThresh")
    if rec_thresh is None:
        rec_thresh = default_rec_thresh
    elif not 0.0 <= _typed("textRecScoreThresh", rec_thresh, float) <= 1.0:
        raise BadRequest(f"textRecScoreThresh: expected 0..1, got {rec_thresh!r}")
    visualize = data.get("visualize")
    log_id = data.get("logId")
    return InferRequest(
        file=file,
        file_type=file_type,
        params=replace(defaults, **changes),
        rec_score_thresh=float(rec_thresh),
        visualize=bool(visualize is not None and _typed("visualize", visualize, bool)),
        log_id=_typed("logId", log_id, str)[:128] if log_id is not None else new_log_id(),
    )


def pruned_result(result: OcrResult, params: OcrParams, rec_thresh: float) -> dict[str, Any]:
    """The fields PaddleOCR 3.x's pipeline puts in ``res`` (upstream's key order)."""
    kept = result.filtered(rec_thresh)
    return {
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
        "textline_orientation_angles": [line.angle for line in result.lines],
        "text_rec_score_thresh": rec_thresh,
        "return_word_box": False,
        "rec_texts": [line.text for line in kept],
        "rec_scores": [line.score for line in kept],
        "rec_polys": [[list(p) for p in line.box] for line in kept],
        "rec_boxes": [_bounds(line.box) for line in kept],
    }


def _bounds(box: tuple[tuple[int, int], ...]) -> list[int]:
    xs, ys = [p[0] for p in box], [p[1] for p in box]
    return [min(xs), min(ys), max(xs), max(ys)]


def visualize(image_bytes: bytes, result: OcrResult, rec_thresh: float) -> dict[str, str]:
    """``ocrImage`` (boxes drawn) and ``inputImage``, JPEG base64, at most 2000 px a side."""
    image = Image.open(io.BytesIO(image_bytes), formats=FORMATS).convert("RGB")
    drawn = image.copy()
    draw = ImageDraw.Draw(drawn)
    for line in result.filtered(rec_thresh):
        draw.polygon([tuple(p) for p in line.box], outline=(255, 0, 0), width=2)
    return {"ocrImage": _jpeg_b64(drawn), "inputImage": _jpeg_b64(image)}


def _jpeg_b64(image: Image.Image) -> str:
    image.thumbnail((MAX_OUTPUT_IMAGE_SIDE, MAX_OUTPUT_IMAGE_SIDE))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return base64.b64encode(buf.getvalue()).decode()


def success(log_id: str, result: dict[str, Any]) -> bytes:
    return orjson.dumps({"logId": log_id, "errorCode": 0, "errorMsg": "Success", "result": result})


def error(log_id: str, status: int, message: str) -> bytes:
    return orjson.dumps({"logId": log_id, "errorCode": status, "errorMsg": message})
