"""What every Flask request goes through (operations, the admin API, the web page; the
protocol endpoints do the same in ``endpoints``): its ``Call`` (timer, request id, trust), the
trust gate on the counters, the last touch on its headers, and the app-wide error answers
(werkzeug's HTTP errors, the last resort) in the REST form (under ``/v2``, the Open Inference
Protocol's)."""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from app import metrics
from app.config import Settings
from app.protocols import kserve, paddlex, rest, trust
from app.routes import common
from app.routes import paddlex as paddlex_routes

log = logging.getLogger("app.web")  # the name its log lines have always carried

COUNTER_PATHS = frozenset({"/metrics", "/v1/stats"})  # hidden with the cache status


def register(app: Flask, settings: Settings) -> None:
    @app.before_request
    def _begin() -> Any:
        g.call = common.Call.begin(request, settings)
        # With the cache status hidden, the hit counters must be too: comparing them before
        # and after one's own request would tell whether an image was seen before.
        if request.path in COUNTER_PATHS and not trust.shows_cache_status(
            g.call.trusted, settings.controls
        ):
            message = "metrics are for trusted callers (CACHE_STATUS_VISIBLE=trusted)"
            return Response(rest.error_body("forbidden", message), status=403, mimetype=common.JSON)
        return None

    @app.after_request
    def _finish(response: Response) -> Response:
        call = g.get("call") or common.Call.begin(request, settings)
        headers = common.finish_headers(call, list(response.headers.items()))
        response.headers.clear()
        response.headers.extend(headers)
        return response

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        code = exc.name.lower().replace(" ", "_")
        body = rest.error_body(code, exc.description or "")
        if request.path in paddlex_routes.PATHS:  # upstream's envelope, as its clients read it
            body = paddlex.error(paddlex.new_log_id(), exc.code or 500, exc.name)
        elif request.path == "/v2" or request.path.startswith("/v2/"):  # Triton's form
            body = kserve.error_body(exc.name)
        # Keep the exception's own headers (a 405 must list the allowed methods in Allow).
        headers = [(k, v) for k, v in exc.get_headers() if k.lower() != "content-type"]
        return Response(body, status=exc.code or 500, mimetype=common.JSON, headers=headers)

    @app.errorhandler(Exception)
    def unexpected_error(exc: Exception) -> Response:
        """Last resort: a bug, never the client's fault. Logged with the request id (sent
        as ``X-Request-Id``) and counted."""
        call = g.get("call") or common.Call.begin(request, settings)
        log.exception("unexpected error request_id=%s path=%s", call.request_id, request.path)
        metrics.UNEXPECTED_ERRORS.labels(protocol="rest").inc()
        common.observe(call, "rest", 500, "none")
        body = rest.error_body("internal_error", f"internal error (request id {call.request_id})")
        return Response(body, status=500, mimetype=common.JSON)
