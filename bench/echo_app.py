"""An HTTP echo app: the least any request can cost under a given server (WSGI, ASGI, RSGI).

Plain WSGI (no framework): it reads the whole body and answers a small constant JSON (no
parsing, no hashing, no Redis), as a cache hit answers a small result rather than the image.
`make bench` (bench/hitpath.py) and bench/edge.py run it under the same gunicorn settings as
the service and the naive baseline (bench/edge.py: behind the same nginx), so hits/s against
it say how close a cache hit comes to the cost of moving the request itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

ANSWER = b'{"echo":"ok"}'


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    size = int(environ.get("CONTENT_LENGTH") or 0)
    stream = environ["wsgi.input"]
    while size > 0:  # the whole body, however the server hands it over
        chunk = stream.read(size)
        if not chunk:
            break
        size -= len(chunk)
    start_response(
        "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(ANSWER)))]
    )
    return [ANSWER]


async def asgi_app(
    scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
) -> None:
    """The same echo for ASGI servers (uvicorn, granian's ASGI interface)."""
    if scope["type"] != "http":
        return
    more = True
    while more:  # the whole body
        message = await receive()
        more = message.get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


async def rsgi_app(scope: Any, protocol: Any) -> None:
    """The same echo for granian's own interface (RSGI)."""
    await protocol()  # the whole body
    protocol.response_bytes(200, [("content-type", "application/json")], ANSWER)
