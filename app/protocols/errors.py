"""Client errors raised by protocol parsers (never cached, never a 5xx), the error envelope,
and the one lookup every protocol's error table (exception class -> answer) goes through."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from app.vocabulary import ClientError

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


class BadRequest(ClientError):
    """The request is malformed; ``code`` is a short machine-readable reason."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


def error_envelope(code: str, message: str) -> dict[str, dict[str, str]]:
    """The error body of the REST API, the admin API and the nginx edge's own answers."""
    return {"error": {"code": code, "message": message}}


def lookup(table: Mapping[type[E], T], exc: BaseException) -> T | None:
    """A protocol's answer to ``exc`` from its error table (exception class -> answer): the
    entry of the nearest class in ``exc``'s MRO, so a subclass may have its own row (PaddleX's
    ``ImageTooLarge`` before ``InvalidImage``) and otherwise answers as its parent."""
    for cls in type(exc).__mro__:
        answer = table.get(cls)
        if answer is not None:
            return answer
    return None
