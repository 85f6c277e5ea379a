"""What every request goes through whatever its route: the timer, the request id and trust;
the cut of streamed bodies; the trust gate on the counters; hiding the cache status; and the
app-wide error answers (413, werkzeug's HTTP errors, the last resort), each in the form of the
protocol the path belongs to."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from app import metrics
from app.config import Settings
from app.protocols import paddlex, pipeline, pipeline_http, rest, trust
from app.routes import common
from app.routes import paddlex as paddlex_routes

log = logging.getLogger("app.web")  # the name its log lines have always carried

COUNTER_PATHS = frozenset({"/metrics", "/v1/stats"})  # hidden with the cache status

# Blueprint -> (its metrics protocol, its last-resort body from (request id, message)); any
# other route (ops, admin, ui) answers in the REST form.
LAST_RESORT: dict[str, tuple[str, Callable[[str, str], bytes]]] = {
    "rest": ("rest", lambda _, message: rest.error_body("internal_error", message)),
    "pipeline_http": (
        "pipeline_http",
        lambda _, message: pipeline_http.render(
            pipeline.PipelineAnswer(err_no=pipeline.UNKNOWN_ERROR, err_msg=message)
        ),
    ),
    "paddlex": ("paddlex", lambda request_id, message: paddlex.error(request_id, 500, message)),
}


def register(app: Flask, settings: Settings) -> None:
    @app.before_request
    def _start_timer() -> None:
        g.started = time.perf_counter()
        g.request_id = secrets.token_hex(8)
        address = trust.http_client_address(request.environ)
        g.trusted = trust.is_trusted(address, request.headers, settings)

    @app.before_request
    def _counters_need_trust() -> Any:
        """With the cache status hidden, the hit counters must be too: comparing them before
        and after one's own request would tell whether an image was seen before."""
        if request.path in COUNTER_PATHS and not trust.shows_cache_status(g.trusted, settings):
            message = "metrics are for trusted callers (CACHE_STATUS_VISIBLE=trusted)"
            return Response(rest.error_body("forbidden", message), status=403, mimetype=common.JSON)
        return None

    @app.after_request
    def _hide_cache_status(response: Response) -> Response:
        if not trust.shows_cache_status(g.get("trusted", False), settings):
            response.headers.pop("X-Cache", None)
            response.headers.pop(common.TIER_HEADER, None)
            for name in common.DETAIL_HEADERS:
                response.headers.pop(name, None)
        return response

    @app.before_request
    def _limit_streamed_body() -> None:
        # A chunked body (no Content-Length) is cut at MAX_CONTENT_LENGTH by werkzeug without
        # an error; reaching the limit means it went on (multipart parsing raises by itself).
        if (
            request.method == "POST"
            and request.content_length is None
            and request.mimetype != "multipart/form-data"
        ):
            if len(request.get_data(cache=True)) >= settings.max_request_bytes:
                raise RequestEntityTooLarge()

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(exc: RequestEntityTooLarge) -> Any:
        message = f"request body over {settings.max_request_bytes} bytes"
        if request.path == "/ocr":  # PaddleX clients read the envelope
            body = paddlex.error(paddlex.new_log_id(), 413, message)
            return Response(body, status=413, mimetype=common.JSON)
        return Response(rest.error_body("too_large", message), status=413, mimetype=common.JSON)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        code = exc.name.lower().replace(" ", "_")
        body = rest.error_body(code, exc.description or "")
        if request.path in paddlex_routes.PATHS:  # upstream's envelope, as its clients read it
            body = paddlex.error(paddlex.new_log_id(), exc.code or 500, exc.name)
        # Keep the exception's own headers (a 405 must list the allowed methods in Allow).
        headers = [(k, v) for k, v in exc.get_headers() if k.lower() != "content-type"]
        return Response(body, status=exc.code or 500, mimetype=common.JSON, headers=headers)

    @app.errorhandler(Exception)
    def unexpected_error(exc: Exception) -> Response:
        """Last resort: a bug, never the client's fault. Answered in the route's own form,
        logged with a request id (also sent as ``X-Request-Id``) and counted."""
        request_id = g.get("request_id") or secrets.token_hex(8)
        protocol, render = LAST_RESORT.get(request.blueprint or "", LAST_RESORT["rest"])
        log.exception("unexpected error request_id=%s path=%s", request_id, request.path)
        metrics.UNEXPECTED_ERRORS.labels(protocol=protocol).inc()
        if g.get("started") is not None:
            common.observe(protocol, 500, "none")
        body = render(request_id, f"internal error (request id {request_id})")
        return Response(
            body, status=500, mimetype=common.JSON, headers={"X-Request-Id": request_id}
        )
