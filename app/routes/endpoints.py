"""The protocol endpoints, served in front of Flask: ``POST /v1/ocr`` (REST), ``POST /ocr``
(PaddleX), ``POST /{PIPELINE_SERVICE_NAME}/{method}`` (Paddle Serving's pipeline) and
``POST /v2/models/{name}[/versions/{v}]/infer`` (the Open Inference Protocol).

They are the service's hottest requests, and an L2 hit costs less than Flask's own request
machinery (its context, URL map, hooks and response object: 0.1–0.2 ms of the hit's CPU when
profiled, in git's history of docs/PERFORMANCE.md). So these paths are matched here, on the
WSGI environ, and their handler (``app.routes.rest``, ``pipeline_http``, ``paddlex``: one per
protocol, the only one) is called with a werkzeug request; every other path (operations, the
admin API, the web page) goes on to Flask. What Flask did for these paths is done here the same
way: other methods get 405 (and OPTIONS its answer) in the protocol's form, werkzeug's own
errors (413 on a body or form field over its limit) likewise, and a bug the protocol's last-
resort answer, logged with the request id and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from werkzeug.exceptions import HTTPException, MethodNotAllowed, RequestEntityTooLarge
from werkzeug.wrappers import Request

from app import metrics, tracing
from app.protocols import kserve as kserve_protocol
from app.protocols import paddlex as paddlex_protocol
from app.protocols import rest
from app.routes import common, kserve, paddlex, pipeline_http
from app.routes import rest as rest_routes
from app.routes.common import JSON, Answer, Call
from app.service import OcrService
from app.vocabulary import Refused

log = logging.getLogger("app.web")  # the name its log lines have always carried

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
ALLOW = "OPTIONS, POST"


@dataclass(frozen=True)
class Endpoint:
    protocol: str  # the metrics label
    handle: Callable[[OcrService, Call], Answer]
    http_error: Callable[[str, int, str], bytes]  # werkzeug's errors (code, status, message)
    last_resort: Callable[[str, str], bytes]  # a bug's answer, from (request id, message)
    refused: Callable[[str, int, str], bytes]  # admission's 401/429 (code, status, message)
    route: str = ""  # the server span's name (its route)


def _rest_http_error(code: str, status: int, message: str) -> bytes:
    return rest.error_body(code, message)


def _paddlex_http_error(code: str, status: int, message: str) -> bytes:
    return paddlex_protocol.error(paddlex_protocol.new_log_id(), status, message)


def _pipeline_http_error(code: str, status: int, message: str) -> bytes:
    """A method other than POST on the pipeline's path: its five fields (``err_no`` 10000, as
    the edge's own answers there); a body over the limit as the gateway answers what it cannot
    route."""
    if status == 405:
        return pipeline_http.refusal(message)
    return rest.error_body(code, message)


REST = Endpoint(
    "rest",
    rest_routes.handle,
    _rest_http_error,
    lambda _, message: rest.error_body("internal_error", message),
    _rest_http_error,
    "POST /v1/ocr",
)
PADDLEX = Endpoint(
    "paddlex",
    paddlex.handle,
    _paddlex_http_error,
    lambda request_id, message: paddlex_protocol.error(request_id, 500, message),
    _paddlex_http_error,
    "POST /ocr",
)
PIPELINE = Endpoint(
    "pipeline_http",
    pipeline_http.handle,
    _pipeline_http_error,
    lambda _, message: pipeline_http.refusal(message),
    lambda code, status, message: pipeline_http.refusal(message),  # as the edge's 429
    "POST /{name}/{method}",
)
KSERVE = Endpoint(
    kserve.PROTOCOL,
    kserve.handle,
    lambda code, status, message: kserve_protocol.error_body(message),
    lambda _, message: kserve_protocol.error_body(message),
    lambda code, status, message: kserve_protocol.error_body(message),
    "POST /v2/models/{name}/infer",
)


class _Request(Request):
    """werkzeug's request, whose body of a known length (not multipart) is read in one call
    from the server's input: werkzeug's own stream reads it piecewise into a second buffer,
    which a 416 KB JSON body notices."""

    def get_data(  # type: ignore[override]
        self, cache: bool = True, as_text: bool = False, parse_form_data: bool = False
    ) -> bytes | str:
        length = self.content_length
        if (
            getattr(self, "_cached_data", None) is None
            and length is not None
            and length <= (self.max_content_length or 0)
            and self.mimetype != "multipart/form-data"
        ):
            self._cached_data = self.environ["wsgi.input"].read(length)
        return super().get_data(cache, as_text, parse_form_data)  # type: ignore[call-overload]


class Endpoints:
    """WSGI middleware: the protocol endpoints here, everything else to ``next_app``."""

    def __init__(self, service: OcrService, next_app: WSGIApp, flask_prefixes: set[str]):
        """``flask_prefixes``: the first path segments Flask's own routes use (``v1``,
        ``admin``, ``ui``): a two-segment path under one of them is Flask's, any other is
        the pipeline's (``/{name}/{method}``; a name not the service's gets its error)."""
        self._service = service
        self._admission = service.admission
        self._next = next_app
        self._settings = service.settings
        self._limit = service.settings.server.max_request_bytes
        self._exact = {"/v1/ocr": REST, "/ocr": PADDLEX}
        self._flask_prefixes = frozenset(
            flask_prefixes - {service.settings.protocols.pipeline_service_name}
        )

    def match(self, path: str) -> Endpoint | None:
        endpoint = self._exact.get(path)
        if endpoint is not None:
            return endpoint
        if path.startswith("/v2/"):
            return KSERVE if kserve.is_infer_path(path) else None
        parts = path.split("/")
        if len(parts) == 3 and parts[1] and parts[2] and parts[1] not in self._flask_prefixes:
            return PIPELINE
        return None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        endpoint = self.match(environ.get("PATH_INFO", ""))
        if endpoint is None:
            return self._next(environ, start_response)
        request = _Request(environ)
        request.max_content_length = self._limit
        call = Call.begin(request, self._settings)
        with tracing.TRACER.server(endpoint.route, call.headers, via_edge=call.via_edge) as span:
            answer = self._answer(endpoint, call)
            length = call.request.content_length
            if answer.status >= 400 and length is not None and length <= self._limit:
                _drain(request)
            common.traced(span, call, endpoint.protocol, answer.status, answer.headers)
            headers = common.finish_headers(call, answer.headers)
        headers.append(("Content-Length", str(len(answer.body))))
        start_response(f"{answer.status} {HTTPStatus(answer.status).phrase}", headers)
        return [answer.body]

    def _answer(self, endpoint: Endpoint, call: Call) -> Answer:
        method = call.request.method
        try:
            if method == "POST":
                self._limit_streamed_body(call.request)
                call.tenant = self._admission.admit(call.headers, call.address, call.trusted)
                return endpoint.handle(self._service, call)
            if method == "OPTIONS":
                return Answer(200, b"", [("Allow", ALLOW), ("Content-Type", "text/html")])
            raise MethodNotAllowed(valid_methods=["OPTIONS", "POST"])
        except Refused as exc:
            common.observe(call, endpoint.protocol, exc.status, "none")
            body = endpoint.refused(exc.code, exc.status, str(exc))
            return common.error(body, exc.status, exc)
        except HTTPException as exc:
            return self._http_error(endpoint, exc, call.request.content_length)
        except Exception:
            return self._last_resort(endpoint, call)

    def _limit_streamed_body(self, request: Request) -> None:
        """A chunked body (no Content-Length, so not refused up front) that reaches the
        limit is refused too (multipart parsing raises by itself)."""
        if request.content_length is None and request.mimetype != "multipart/form-data":
            if len(request.get_data(cache=True)) >= self._limit:
                raise RequestEntityTooLarge()

    def _http_error(self, endpoint: Endpoint, exc: HTTPException, length: int | None) -> Answer:
        status = exc.code or 500
        limit = self._limit
        if isinstance(exc, RequestEntityTooLarge):
            code, message = "too_large", f"request body over {limit} bytes"
            if length is not None and length <= limit:  # the body fits: its form does not
                message = (
                    "a multipart form over its limits: a field over "
                    f"{_Request.max_form_memory_size} bytes, or over "
                    f"{_Request.max_form_parts} parts"
                )
        else:
            code = exc.name.lower().replace(" ", "_")
            message = exc.name if endpoint is PADDLEX else exc.description or ""
        body = endpoint.http_error(code, status, message)
        headers = [(k, v) for k, v in exc.get_headers() if k.lower() != "content-type"]
        return Answer(status, body, [("Content-Type", JSON), *headers])

    def _last_resort(self, endpoint: Endpoint, call: Call) -> Answer:
        """A bug, never the client's fault: answered in the protocol's form, logged with
        the request id (also sent as ``X-Request-Id``) and counted."""
        log.exception("unexpected error request_id=%s path=%s", call.request_id, call.request.path)
        metrics.UNEXPECTED_ERRORS.labels(protocol=endpoint.protocol).inc()
        common.observe(call, endpoint.protocol, 500, "none")
        body = endpoint.last_resort(
            call.request_id, f"internal error (request id {call.request_id})"
        )
        return Answer(500, body, [("Content-Type", JSON)])


def _drain(request: Request) -> None:
    """Read what is left of a body within the limit before answering an error: a server
    that answers and closes with the body unread makes the proxy in front fail its write
    (nginx: 502). Through werkzeug's stream, which ends with the body (never a read that
    waits for the client's next request)."""
    if getattr(request, "_cached_data", None) is not None:
        return  # read whole already
    try:
        stream = request.stream
        while stream.read(1 << 16):
            pass
    except (OSError, ValueError, HTTPException):
        pass
