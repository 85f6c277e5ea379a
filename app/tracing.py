"""OpenTelemetry traces across the edge, the front, the queue and the engine, configured only
by the standard ``OTEL_*`` variables (docs/OBSERVABILITY.md).

Off is a tracer, not a flag (as caching off is a store): ``TRACER`` is ``OFF`` until
``setup`` finds tracing asked for, and every method of ``OFF`` answers one shared span that
does nothing, so a hit with tracing off meets no SDK and no ``if``. Tracing is on when an
OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or an
exporter (``OTEL_TRACES_EXPORTER``) is set and ``OTEL_SDK_DISABLED`` is not ``true``; unset,
it is off, where the SDK's own default would export to localhost.

``setup`` runs once per process after it forked (a front worker's loader, ``app.front_server``, an
engine process at start): the SDK's batch processor owns a thread, which a fork does not
copy. The SDK itself reads the rest (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_HEADERS``, ...). A span's
context crosses processes as W3C ``traceparent``/``tracestate`` strings (``carrier``):
HTTP headers, gRPC metadata, a queued ticket's optional fields. Nothing here imports the SDK
until ``setup`` turns tracing on.
"""

from __future__ import annotations

import atexit
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# nginx's "$msec $request_time" as it passes a request on: the edge's span (nginx has no tracer).
EDGE_TIMING = "X-Edge-Timing"
# The W3C response header naming the request's trace (the edge's access log reads it).
TRACERESPONSE = "traceresponse"
Carrier = Mapping[str, str]  # W3C trace context: ``traceparent`` (and ``tracestate``)
Value = str | int | float | bool
PROTOCOLS = ("http/protobuf", "grpc")
EXPORTERS = ("otlp", "console", "none")
SERVICE_NAME = "ocr-cache"  # when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether these ``OTEL_*`` variables ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    given = environ.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip().lower()
    if given == "none":
        return False
    return bool(given) or any(
        environ.get(var, "").strip()
        for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def exporter(environ: Mapping[str, str]) -> str:
    """``OTEL_TRACES_EXPORTER`` (its first name), ``otlp`` once an endpoint is set, else
    ``none``; ValueError for a name this service does not export with."""
    given = environ.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip().lower()
    if not given:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "") or environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""
        )
        return "otlp" if endpoint.strip() else "none"
    if given not in EXPORTERS:
        raise ValueError(f"OTEL_TRACES_EXPORTER: {given!r}; expected one of {', '.join(EXPORTERS)}")
    return given


def protocol(environ: Mapping[str, str]) -> str:
    """The OTLP transport: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``http/protobuf`` (the specification's default)."""
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        given = environ.get(var, "").strip().lower()
        if given:
            if given not in PROTOCOLS:
                raise ValueError(f"{var}: {given!r}; expected one of {', '.join(PROTOCOLS)}")
            return given
    return "http/protobuf"


def check(environ: Mapping[str, str]) -> str:
    """Why these variables cannot work ("" when they can): checked before a process starts."""
    try:
        if wanted(environ) and exporter(environ) == "otlp":
            protocol(environ)
    except ValueError as exc:
        return str(exc)
    return ""


class Span:
    """A span that does nothing: what every method of ``OFF`` answers (one shared instance).
    Entered, a live span is the thread's current span until it exits, then ends."""

    __slots__ = ()
    recording = False  # whether attributes are kept (off: skip working them out)

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        return None

    def set(self, key: str, value: Value) -> None:
        """An attribute."""

    def set_many(self, attributes: Mapping[str, Value]) -> None:
        """Several attributes at once (one lock taken, not one each)."""

    def event(self, name: str, attributes: Mapping[str, Value] | None = None) -> None:
        """A span event (line reuse, an interjection, ...)."""

    def link(self, carrier: Carrier) -> None:
        """A link to another trace's span (a single-flight joiner to the computing request)."""

    def end(self) -> None:
        """Ends a span that was never entered."""

    def active(self) -> Span:
        """A context manager that makes this span current without ending it."""
        return self

    def carrier(self) -> dict[str, str]:
        """This span's W3C context ({} when off)."""
        return {}


class Tracer:
    """Tracing off: every span is ``NO_SPAN``."""

    on = False

    def server(
        self,
        name: str,
        headers: Carrier,
        attributes: Mapping[str, Value] | None = None,
        via_edge: bool = False,
    ) -> Span:
        """A request's server span, continuing the caller's ``traceparent`` in ``headers``
        (a trace of its own without one); current while entered. ``via_edge`` (the request
        came over the socket only nginx reaches): its ``EDGE_TIMING`` header (when nginx
        received the request and sent it on) makes the server span the child of an ``edge``
        span of that time; from anyone else the header is ignored (a client could forge it)."""
        return NO_SPAN

    def span(
        self, name: str, attributes: Mapping[str, Value] | None = None, start_ns: int = 0
    ) -> Span:
        """A child of the current span; current while entered. ``start_ns``: when it began
        (wall clock, ns), for a span opened once its work turned out to need one."""
        return NO_SPAN

    def remote(
        self, name: str, carrier: Carrier, attributes: Mapping[str, Value] | None = None
    ) -> Span:
        """A span whose parent is ``carrier``'s (another process's: a queued ticket's), or a
        root without one; current while entered."""
        return NO_SPAN

    def current(self) -> Span:
        return NO_SPAN

    def ids(self) -> tuple[str, str]:
        """The current span's (trace id, span id) in hex, ("", "") without one."""
        return "", ""

    def shutdown(self) -> None:
        """Export what is batched (at exit)."""


NO_SPAN = Span()
OFF = Tracer()
TRACER: Tracer = OFF  # this process's: ``setup`` replaces it


def setup(role: str, environ: Mapping[str, str] | None = None) -> Tracer:
    """This process's tracer (``role``: ``front`` or ``engine``), from ``OTEL_*``: ``OFF``
    unless they ask for traces. Once per process, after any fork."""
    global TRACER
    environ = os.environ if environ is None else environ
    if TRACER is not OFF or not wanted(environ):
        return TRACER
    from app.tracing_sdk import build

    TRACER = build(role, exporter(environ), protocol(environ), instance_id(role))
    atexit.register(TRACER.shutdown)
    return TRACER


def instance_id(role: str) -> str:
    """``service.instance.id``: unique per process (host, pid, and a random part: pids are
    reused, containers share them)."""
    return f"{socket.gethostname()}-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def shutdown() -> None:
    """Flush and stop this process's tracer (a front worker's exit)."""
    TRACER.shutdown()
