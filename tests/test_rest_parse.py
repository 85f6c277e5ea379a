"""The REST JSON body's fast path (``{"image": "<base64>"}`` without a JSON parse) answers
exactly what the full parse answers, for well-formed and malformed bodies alike."""

from __future__ import annotations

import base64

import orjson
import pytest
from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request

from app.protocols import rest
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest

pytestmark = pytest.mark.unit

IMAGE = bytes(range(256)) * 3
B64 = base64.b64encode(IMAGE).decode()


def _request(body: bytes) -> Request:
    return Request(
        EnvironBuilder(method="POST", data=body, content_type="application/json").get_environ()
    )


def _reference(body: bytes) -> tuple[bytes, float] | str:
    """What the full parse gives: (image, min_score) or the error code."""
    try:
        parsed = orjson.loads(body)
        if not isinstance(parsed, dict) or "image" not in parsed:
            return "missing_field"
        return decode_base64(parsed["image"]), parsed.get("min_score", 0.5)
    except orjson.JSONDecodeError:
        return "invalid_json"
    except BadRequest as exc:
        return exc.code


def _parsed(body: bytes) -> tuple[bytes, float] | str:
    try:
        req = rest.parse(_request(body), 0.5)
    except BadRequest as exc:
        return exc.code
    return req.data, req.min_score


@pytest.mark.parametrize(
    "body",
    [
        b'{"image": "%s"}' % B64.encode(),
        b'{"image":"%s"}' % B64.encode(),
        b'{"image": "%s"}\n' % B64.encode(),
        b'{"image": "%s"}  \r\n' % B64.encode(),
        b'{"image": "%s", "min_score": 0.7}' % B64.encode(),
        b'{"image": "data:image/png;base64,%s"}' % B64.encode(),
        b'{"image": "%s"}' % B64[:-1].encode(),  # bad padding
        b'{"image": "%s\\n%s"}' % (B64[:40].encode(), B64[40:].encode()),  # escaped newline
        b'{"image": "%s\\/"}' % B64[:-4].encode(),  # an escaped slash
        b'{"image": ""}',
        b'{"image": "%s"} trailing' % B64.encode(),
        b'{"image": "%s"}}' % B64.encode(),
        b'{"image": "%s""}' % B64.encode(),
        b'{"image": "%s" }' % B64.encode(),
        b'{"image": "\xff\xfe"}',
        b'{"image": "%s"' % B64.encode(),
        b'{"image": 5}',
        b'{"image": "',
        b'{"image":"}',
        b"[]",
        b"",
    ],
)
def test_fast_path_matches_the_full_parse(body: bytes) -> None:
    assert _parsed(body) == _reference(body)
