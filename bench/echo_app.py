"""An HTTP echo app: the least any request can cost under the service's gunicorn settings.

Plain WSGI (no framework): it reads the whole body and sends it back. ``make bench`` runs it
under the same gunicorn settings as the service and the naive baseline, so hits/s against
it say how close a cache hit comes to the cost of HTTP itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    size = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(size) if size else b""
    start_response(
        "200 OK", [("Content-Type", "application/octet-stream"), ("Content-Length", str(len(body)))]
    )
    return [body]
