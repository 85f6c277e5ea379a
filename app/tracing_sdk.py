"""Tracing on: ``app.tracing``'s interface over the OpenTelemetry SDK, imported only when
``OTEL_*`` asks for traces (the SDK and its exporter cost a front worker half a second to
import and a thread each).

The resource names the role (``ocr.role``: ``front`` or ``engine``) and the process
(``service.instance.id``), so a trace viewer shows which hop ran where; ``service.name`` is
``ocr-cache`` unless ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES`` name one. The
sampler (``OTEL_TRACES_SAMPLER``, default parent-based always-on), the batch processor
(``OTEL_BSP_*``) and the exporter's endpoint, headers and timeout are the SDK's own reading
of the environment. Context crosses processes as W3C trace context only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from app import tracing, tracing_encode
from app.tracing import Carrier, Value

_W3C = TraceContextTextMapPropagator()


class _Live(tracing.Span):
    """An SDK span; entered, it is the thread's current span until it exits, then ends."""

    __slots__ = ("_span", "_token")
    recording = True

    def __init__(self, span: Any) -> None:
        self._span = span
        self._token: Any = None

    def __enter__(self) -> _Live:
        self._token = context.attach(trace.set_span_in_context(self._span))
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, kind.__name__))
        if self._token is not None:
            context.detach(self._token)
        self._span.end()

    def set(self, key: str, value: Value) -> None:
        self._span.set_attribute(key, value)

    def set_many(self, attributes: Mapping[str, Value]) -> None:
        self._span.set_attributes(attributes)

    def event(self, name: str, attributes: Mapping[str, Value] | None = None) -> None:
        self._span.add_event(name, dict(attributes or {}))

    def link(self, carrier: Carrier) -> None:
        found = trace.get_current_span(_W3C.extract(carrier)).get_span_context()
        if found.is_valid:
            self._span.add_link(found)

    def end(self) -> None:
        self._span.end()

    def active(self) -> tracing.Span:
        return _Active(self._span)

    def carrier(self) -> dict[str, str]:
        # What the W3C propagator's inject writes, without building a context for it (every
        # traced answer's ``traceresponse`` asks).
        found = self._span.get_span_context()
        if not found.is_valid:
            return {}
        out = {
            "traceparent": f"00-{found.trace_id:032x}-{found.span_id:016x}-"
            f"{int(found.trace_flags):02x}"
        }
        if found.trace_state:
            out["tracestate"] = found.trace_state.to_header()
        return out


class _Active(_Live):
    """A span made current for a while; it ends elsewhere."""

    __slots__ = ()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self._token is not None:
            context.detach(self._token)


class On(tracing.Tracer):
    on = True

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("app")

    def server(
        self,
        name: str,
        headers: Carrier,
        attributes: Mapping[str, Value] | None = None,
        via_edge: bool = False,
    ) -> tracing.Span:
        parent = _W3C.extract(headers)
        edge = _edge_timing(headers.get(tracing.EDGE_TIMING, "")) if via_edge else None
        if edge is None:
            return _Live(self._tracer.start_span(name, parent, SpanKind.SERVER, attributes))
        received, sent = edge  # nginx has no tracer: its time is the server span's start
        timing = {
            **(attributes or {}),
            "edge.read_seconds": (sent - received) / 1e9,
            "edge.queued_seconds": max(0, time.time_ns() - sent) / 1e9,
        }
        return _Live(
            self._tracer.start_span(name, parent, SpanKind.SERVER, timing, start_time=received)
        )

    def span(
        self, name: str, attributes: Mapping[str, Value] | None = None, start_ns: int = 0
    ) -> tracing.Span:
        return _Live(
            self._tracer.start_span(name, attributes=attributes, start_time=start_ns or None)
        )

    def remote(
        self, name: str, carrier: Carrier, attributes: Mapping[str, Value] | None = None
    ) -> tracing.Span:
        parent = _W3C.extract(carrier) if carrier else context.Context()
        return _Live(
            self._tracer.start_span(name, parent, SpanKind.CONSUMER, attributes=attributes)
        )

    def current(self) -> tracing.Span:
        span = trace.get_current_span()
        return _Live(span) if span.get_span_context().is_valid else tracing.NO_SPAN

    def ids(self) -> tuple[str, str]:
        found = trace.get_current_span().get_span_context()
        if not found.is_valid:
            return "", ""
        return f"{found.trace_id:032x}", f"{found.span_id:016x}"

    def shutdown(self) -> None:
        self._provider.shutdown()


def _edge_timing(header: str) -> tuple[int, int] | None:
    """nginx's ``X-Edge-Timing: <$msec> <$request_time>`` (when it sent the request on, and
    how long it had had it, in seconds) as (received, sent) in ns; None without it."""
    try:
        sent, held = (float(part) for part in header.split())
    except ValueError:
        return None
    return int((sent - held) * 1e9), int(sent * 1e9)


def build(role: str, exporter_name: str, transport: str, instance_id: str) -> On:
    """The tracer of a process of ``role``, exporting with ``exporter_name``."""
    resource = Resource.create(
        {"ocr.role": role, "service.instance.id": instance_id, "process.pid": os.getpid()}
    )
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": tracing.SERVICE_NAME}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_exporter(exporter_name, transport)))
    return On(provider)


def _exporter(name: str, transport: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if transport == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as grpc_exporter

        tracing_encode.install(grpc_exporter)
        return grpc_exporter.OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http import trace_exporter as http_exporter

    tracing_encode.install(http_exporter)  # the SDK's encoder cost more than the hits
    return http_exporter.OTLPSpanExporter()
