"""What every request shares, whichever way it comes in (a protocol endpoint, or a Flask
route): its ``Call`` (timer, request id, trust), its cache controls and metrics, the cache
headers, and the last touch on every answer's headers (``finish_headers``)."""

from __future__ import annotations

import functools
import re
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from werkzeug.wrappers import Request

from app import metrics, tracing
from app.cache import similarity
from app.config import Settings
from app.protocols import controls as cache_controls
from app.protocols import trust
from app.vocabulary import CacheControls, EngineError, Refused, Unauthorized

JSON = "application/json"
TIER_HEADER = "X-Cache-Tier"
DETAIL_HEADERS = (similarity.SOURCE_HEADER, similarity.FIGURES_HEADER)  # "similar" hits
HIDDEN = ("X-Cache", TIER_HEADER, *DETAIL_HEADERS)  # from untrusted callers, with this setting
REQUEST_ID = "X-Request-Id"
# The cache status for the edge's access log (nginx drops it before the client sees it).
EDGE_CACHE = "X-Edge-Cache"
# A request id the edge or a client sent is kept when it is a plain token (as nginx's map).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class Call:
    """One request on its way through: the werkzeug request, when it started, its id (the
    edge's ``X-Request-Id``, or a new one) and whether its caller is trusted
    (app/protocols/trust.py)."""

    request: Request
    settings: Settings
    started: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    trusted: bool = True
    tenant: str | None = None  # the tenant its API key named (``app/admission.py``)
    address: str = ""  # the client's (app/protocols/trust.py)

    @classmethod
    def begin(cls, request: Request, settings: Settings) -> Call:
        environ = request.environ
        given = environ.get("HTTP_X_REQUEST_ID", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else secrets.token_hex(8)
        address = trust.http_client_address(environ)
        trusted = trust.is_trusted(address, _EnvironHeaders(environ), settings.controls)
        return cls(request, settings, time.perf_counter(), request_id, trusted, address=address)

    @property
    def via_edge(self) -> bool:
        """Over the front server's unix socket: only the edge connects there."""
        return not self.request.environ.get("REMOTE_ADDR")

    @property
    def headers(self) -> _EnvironHeaders:
        return _EnvironHeaders(self.request.environ)


class _EnvironHeaders(Mapping[str, str]):
    """Request headers read straight from the WSGI environ (``Cache-Control`` is
    ``HTTP_CACHE_CONTROL``): cheaper than building werkzeug's view for a few lookups."""

    __slots__ = ("_environ",)

    def __init__(self, environ: dict[str, Any]) -> None:
        self._environ = environ

    @staticmethod
    def _key(name: str) -> str:
        key = name.upper().replace("-", "_")
        return key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"

    def get(self, name: str, default: Any = None) -> Any:
        value = self._environ.get(self._key(name))
        return default if value is None else value

    def __getitem__(self, name: str) -> str:
        value = self._environ.get(self._key(name))
        if value is None:
            raise KeyError(name)
        return str(value)

    def __iter__(self) -> Iterator[str]:
        return (key[5:].replace("_", "-") for key in self._environ if key.startswith("HTTP_"))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Answer:
    """What an endpoint answers: status, body and headers (before ``finish_headers``)."""

    status: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)


def controls(call: Call) -> CacheControls:
    """The request's cache controls (headers; trust decided in ``Call.begin``)."""
    return cache_controls.parse(
        call.headers, call.settings.controls, trusted=call.trusted, tenant=call.tenant
    )


def observe(call: Call, protocol: str, status: int, cache_status: str) -> None:
    _requests(protocol, status).inc()
    _seconds(protocol, cache_status).observe(time.perf_counter() - call.started)


# A labels() lookup per request is measurable on the hit path; the label sets are few.
@functools.cache
def _requests(protocol: str, status: int) -> Any:
    return metrics.REQUESTS.labels(protocol=protocol, status=str(status))


@functools.cache
def _seconds(protocol: str, cache_status: str) -> Any:
    return metrics.REQUEST_SECONDS.labels(protocol=protocol, cache=cache_status)


def cache_headers(
    status: str, tier: str, details: tuple[tuple[str, str], ...] = ()
) -> list[tuple[str, str]]:
    """``X-Cache`` and, for hits, ``X-Cache-Tier`` (l1, l2, ...) and a similar hit's
    ``DETAIL_HEADERS``; all hidden together from untrusted callers when
    ``CACHE_STATUS_VISIBLE=trusted`` (``finish_headers``)."""
    headers = [("X-Cache", status), *details]
    if tier:
        headers.append((TIER_HEADER, tier))
    return headers


def error(body: bytes, status: int, exc: Exception) -> Answer:
    """An error answer; an engine that is failing or overloaded (``EngineError``,
    ``EngineBusy``) or a quota (``QuotaExceeded``) says when to come back, a missing or
    unknown key how to authenticate."""
    retry = exc.retry_after if isinstance(exc, EngineError | Refused) else 0
    headers = [("Retry-After", str(retry))] if retry else []
    if isinstance(exc, Unauthorized):
        headers.append(("WWW-Authenticate", 'Bearer realm="ocr"'))
    return Answer(status, body, [("Content-Type", JSON), *headers])


def finish_headers(call: Call, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every answer: its request id; the cache status copied for the edge's access log; and
    the cache status hidden from an untrusted caller (it tells whether an image was seen)."""
    if call.via_edge:
        status = tier = ""
        for name, value in headers:
            if name == "X-Cache":
                status = value
            elif name == TIER_HEADER:
                tier = value
        if status:
            headers.append((EDGE_CACHE, f"{status} {tier}".rstrip()))
    if not trust.shows_cache_status(call.trusted, call.settings.controls):
        headers = [(name, value) for name, value in headers if name not in HIDDEN]
    headers.append((REQUEST_ID, call.request_id))
    return headers


def traced(
    span: tracing.Span, call: Call, protocol: str, status: int, headers: list[tuple[str, str]]
) -> None:
    """The server span's attributes (protocol, route, status, tenant when one, request id,
    the cache outcome and tier), and ``traceresponse`` naming the trace (the edge's access
    log reads it). Off: nothing is worked out."""
    if not span.recording:
        return
    attributes: dict[str, tracing.Value] = {
        "http.request.method": call.request.method,
        "http.response.status_code": status,
        "ocr.protocol": protocol,
        "ocr.request_id": call.request_id,
    }
    if call.tenant:
        attributes["ocr.tenant"] = call.tenant
    for name, value in headers:
        if name == "X-Cache":
            attributes["ocr.cache"] = value.lower()
        elif name == TIER_HEADER:
            attributes["ocr.cache_tier"] = value
    span.set_many(attributes)
    parent = span.carrier().get(tracing.TRACEPARENT)
    if parent:
        headers.append((tracing.TRACERESPONSE, parent))
