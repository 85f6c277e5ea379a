"""Paddle Serving pipeline over HTTP (docs/PROTOCOLS.md §2): ``POST /{name}/{method}``.

Only ``name`` is checked; ``method`` is logged. The body is JSON whatever the Content-Type
(official clients send none). Answers always carry the five fields, as the Go gateway emits
them, and application errors are HTTP 200 with a non-zero ``err_no``; a body that is not a
JSON object is answered by the gateway itself (HTTP 400, ``gateway_error``).
"""

from __future__ import annotations

from typing import Any

import orjson

from app.protocols.pipeline import (
    TYPE_ERROR,
    PipelineAnswer,
    PipelineError,
    PipelineRequest,
    Tensor,
    build_request,
)
from app.vocabulary import ClientError


class GatewayError(ClientError):
    """The body is not a JSON object: the gateway answers before the pipeline sees it."""

    code = "gateway_error"


def parse(body: bytes) -> PipelineRequest:
    if not body.strip():  # the gateway decodes an empty body as an empty request
        data: Any = {}
    else:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(f"request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError("request body is not a JSON object")
    return build_request(
        data.get("key", []),
        data.get("value", []),
        _tensors(data.get("tensors", [])),
        data.get("logid", 0),
        data.get("clientip", ""),
    )


def _tensors(raw: Any) -> list[Tensor]:
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise PipelineError(TYPE_ERROR, "tensors must be a list of objects")
    return [Tensor(t.get("name", ""), t.get("elem_type", 0), t.get("str_data", [])) for t in raw]


_GO_ESCAPES = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)


def gateway_error(message: str) -> bytes:
    """HTTP 400 body of the gateway's default error handler (grpc-gateway v1: gRPC code 3,
    InvalidArgument), which answers undecodable bodies itself."""
    return orjson.dumps({"error": message, "code": 3, "message": message, "details": []})


def render(answer: PipelineAnswer) -> bytes:
    """JSON as the Go gateway (jsonpb, EmitDefaults, OrigName) writes it."""
    text = orjson.dumps(
        {
            "err_no": answer.err_no,
            "err_msg": answer.err_msg,
            "key": answer.keys,
            "value": answer.values,
            "tensors": [],
        }
    ).decode("utf-8")
    # encoding/json escapes these inside strings (they occur nowhere else in the text).
    for raw, escaped in _GO_ESCAPES:
        text = text.replace(raw, escaped)
    return text.encode("utf-8")
