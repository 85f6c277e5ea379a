"""Client errors raised by protocol parsers (never cached, never a 5xx)."""

from __future__ import annotations

from app.vocabulary import ClientError


class BadRequest(ClientError):
    """The request is malformed; ``code`` is a short machine-readable reason."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


def error_envelope(code: str, message: str) -> dict[str, dict[str, str]]:
    """The error body of the REST API, the admin API and the HTTP front's own answers."""
    return {"error": {"code": code, "message": message}}
