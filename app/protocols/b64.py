"""Base64 decoding shared by the JSON protocols."""

from __future__ import annotations

import binascii

import pybase64

from app.protocols.errors import BadRequest


def decode_base64(text: object, *, strict: bool = True) -> bytes:
    """Decode standard base64 (a ``data:...;base64,`` prefix is accepted).

    ``strict=False`` mirrors Python's lenient decoder that Paddle Serving's OCR ops use
    (characters outside the alphabet, e.g. line breaks from ``encodebytes``, are skipped).
    """
    if not isinstance(text, str):
        raise BadRequest("image must be a base64 string", "invalid_base64")
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest("data URI must be base64-encoded", "invalid_base64")
    try:
        data = _decode(text, strict)
    except (binascii.Error, ValueError):
        raise BadRequest("image is not valid base64", "invalid_base64") from None
    if not data:
        raise BadRequest("image is empty", "empty_image")
    return data


def _decode(text: str, strict: bool) -> bytes:
    if not strict:
        return pybase64.b64decode(text, validate=False)
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        # Line-wrapped base64 (e.g. from encodebytes) is still well-formed: retry without
        # whitespace. Only this slow path pays for the copy.
        return pybase64.b64decode("".join(text.split()), validate=True)
