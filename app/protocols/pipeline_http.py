"""Paddle Serving pipeline HTTP (PROTOCOLS.md §2): ``POST /{name}/{method}``.

Only ``name`` is checked; ``method`` is logged. The body is JSON whatever the Content-Type
(official clients send none). Answers always carry the five fields, as the Go gateway emits
them, and application errors are HTTP 200 with a non-zero ``err_no``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest

OK = 0
SERVICE_NAME_ERROR = 3002
INPUT_PARAMS_ERROR = 5000
TIMEOUT = 6000
TYPE_ERROR = 7000
PACKING_ERROR = 8000
UNKNOWN_ERROR = 10000

PROFILE_KEY = "pipeline.profile"
TENSOR_STRING = 12
TENSOR_BYTES = 13  # np.load(allow_pickle=True) upstream: refused, never unpickled


class PipelineError(Exception):
    def __init__(self, err_no: int, message: str) -> None:
        super().__init__(message)
        self.err_no = err_no


@dataclass
class PipelineRequest:
    images: list[tuple[str, str]] = field(default_factory=list)  # (key, base64 text)
    logid: int = 0
    clientip: str = ""
    profile: bool = False


def op_error(logid: int, message: str, function: str = "preprocess") -> str:
    """An exception message in the form upstream's ops produce."""
    return f"Log_id: {logid}  Raise_msg: {message}  ClassName: DetOp  FunctionName: {function}"


def parse(body: bytes) -> PipelineRequest:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise PipelineError(PACKING_ERROR, "Failed to unpack request: body is not JSON") from None
    if not isinstance(data, dict):
        raise PipelineError(PACKING_ERROR, "Failed to unpack request: body is not a JSON object")
    req = PipelineRequest()
    logid = data.get("logid", 0)
    try:
        req.logid = int(logid)
    except (TypeError, ValueError):
        raise PipelineError(TYPE_ERROR, "logid must be an integer") from None
    req.clientip = str(data.get("clientip", ""))[:64]

    keys, values = data.get("key", []), data.get("value", [])
    if not isinstance(keys, list) or not isinstance(values, list):
        raise PipelineError(TYPE_ERROR, "key and value must be lists of strings")
    if len(values) < len(keys):
        raise PipelineError(
            PACKING_ERROR,
            f"Failed to unpack request: {len(keys)} keys but {len(values)} values",
        )
    pairs: list[tuple[Any, Any]] = list(zip(keys, values[: len(keys)], strict=True))
    pairs.extend(_tensor_pairs(data.get("tensors", [])))
    for key, value in pairs:
        if not isinstance(key, str) or not isinstance(value, str):
            raise PipelineError(TYPE_ERROR, "key and value must be lists of strings")
        if key == PROFILE_KEY:
            req.profile = value == "1"
        else:
            req.images.append((key, value))
    if not req.images:
        raise PipelineError(
            INPUT_PARAMS_ERROR, op_error(req.logid, "no image in request (key 'image')")
        )
    return req


def _tensor_pairs(tensors: Any) -> list[tuple[Any, Any]]:
    if not isinstance(tensors, list):
        raise PipelineError(TYPE_ERROR, "tensors must be a list")
    pairs = []
    for tensor in tensors:
        if not isinstance(tensor, dict):
            raise PipelineError(TYPE_ERROR, "each tensor must be an object")
        elem_type = tensor.get("elem_type", 0)
        if elem_type == TENSOR_BYTES:
            raise PipelineError(
                TYPE_ERROR, "elem_type 13 (pickled bytes) is not accepted; send elem_type 12"
            )
        if elem_type != TENSOR_STRING:
            raise PipelineError(TYPE_ERROR, f"elem_type {elem_type!r} is not an image string")
        pieces = tensor.get("str_data", [])
        if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
            raise PipelineError(TYPE_ERROR, "str_data must be a list of strings")
        pairs.append((tensor.get("name", ""), "".join(pieces)))
    return pairs


def decode_images(req: PipelineRequest) -> list[bytes]:
    try:
        return [decode_base64(text, strict=False) for _, text in req.images]
    except BadRequest as exc:
        raise PipelineError(UNKNOWN_ERROR, op_error(req.logid, str(exc))) from None


def response_keys(req: PipelineRequest) -> list[str]:
    """One image answers under ``result`` (pdserving); several answer under their own keys."""
    if len(req.images) == 1:
        return ["result"]
    return [key for key, _ in req.images]


def render(
    err_no: int = OK,
    err_msg: str = "",
    keys: list[str] | None = None,
    values: list[str] | None = None,
) -> bytes:
    """JSON as the Go gateway (jsonpb, EmitDefaults, OrigName) writes it."""
    text = orjson.dumps(
        {
            "err_no": err_no,
            "err_msg": err_msg,
            "key": keys or [],
            "value": values or [],
            "tensors": [],
        }
    ).decode("utf-8")
    # encoding/json escapes these inside strings (they occur nowhere else in the text).
    for raw, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(raw, escaped)
    return text.encode("utf-8")
