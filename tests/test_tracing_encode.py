"""``app.tracing_encode``: the cheaper OTLP encoder says what the SDK's says. Spans of every
shape the service makes (a hit's server span, a miss's with events, links, an error, a
remote parent with trace state, attributes of every scalar type, values that repeat and
values that do not, an int past 64 bits, a sequence) are encoded by both, and the requests
parse to the same spans (attributes compared as the map they are); the exporters' modules
encode with it once tracing is set up."""

from __future__ import annotations

import random

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from app import tracing_encode

pytestmark = pytest.mark.unit


def spans_of_every_shape(count: int = 300) -> list[ReadableSpan]:
    kept = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"ocr.role": "front"}))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("app")
    other_kept = InMemorySpanExporter()
    engines = TracerProvider(resource=Resource.create({"ocr.role": "engine"}))
    engines.add_span_processor(SimpleSpanProcessor(other_kept))
    other = engines.get_tracer("engine")
    remote = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
        is_remote=True, trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "x1"), ("other", "y")]),
    )  # fmt: skip
    rng = random.Random(7)
    for i in range(count):
        shape = i % 6
        parent = trace.set_span_in_context(trace.NonRecordingSpan(remote)) if shape == 1 else None
        attributes = {
            "http.request.method": "POST",
            "http.response.status_code": rng.choice([200, 200, 200, 429]),
            "ocr.cache": rng.choice(["hit", "miss"]),
            "ocr.request_id": f"{rng.getrandbits(64):016x}",  # never repeats: not kept
            "edge.read_seconds": rng.random() / 1000,
            "ocr.document": shape == 2,
            "ocr.tenant": "" if shape else "expenses",
        }
        source = other if shape == 5 else tracer
        kind = (SpanKind.SERVER, SpanKind.CONSUMER, SpanKind.INTERNAL)[shape % 3]
        span = source.start_span(f"span {shape}", parent, kind, attributes)
        if shape == 2:
            span.add_event("lines.reused", {"ocr.lines": 3})
        if shape == 3:
            span.add_link(remote, {"why": "joined"})
            span.set_attribute("ocr.big", 2**70)  # past int64: the SDK drops it
        if shape == 4:
            span.set_status(Status(StatusCode.ERROR, "EngineCrashed"))
            span.set_attribute("ocr.shards", (1, 2, 3))  # a sequence
        span.end()
    return [*kept.get_finished_spans(), *other_kept.get_finished_spans()]


def as_spans(request: ExportTraceServiceRequest) -> list[dict]:
    """Every span with its resource and scope, attributes as a map, in the input's order."""
    out = []
    for resource_spans in request.resource_spans:
        resource = MessageToDict(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            scope = MessageToDict(scope_spans.scope)
            for span in scope_spans.spans:
                fields = MessageToDict(span)
                fields["attributes"] = {a["key"]: a["value"] for a in fields.get("attributes", [])}
                out.append({"resource": resource, "scope": scope, **fields})
    return sorted(out, key=lambda s: (s["traceId"], s["spanId"]))


def test_it_encodes_what_the_sdk_encodes() -> None:
    spans = spans_of_every_shape()
    encoder = tracing_encode.Encoder()
    for batch in (spans[:100], spans[100:], spans):  # its kept pieces reused across batches
        ours = ExportTraceServiceRequest.FromString(encoder.encode(batch).SerializeToString())
        theirs = ExportTraceServiceRequest.FromString(sdk_encode(batch).SerializeToString())
        assert as_spans(ours) == as_spans(theirs)
        resources = {id(span.resource) for span in batch}  # the front's, the engine's
        assert len(ours.resource_spans) == len(resources)
    assert len(resources) == 2


def test_values_that_never_repeat_are_not_kept() -> None:
    encoder = tracing_encode.Encoder()
    encoder.encode(spans_of_every_shape(400))
    kept = encoder._attributes._recent  # noqa: SLF001 - what it holds is the point
    request_ids = [key for key, _, _ in kept if key == "ocr.request_id"]
    assert len(request_ids) == tracing_encode._Attributes.VARYING_AFTER  # then it stopped
    assert not [key for key, kind, _ in kept if kind is float]
    assert ("http.request.method", str, "POST") in kept


def test_the_exporters_encode_with_it_once_tracing_is_built() -> None:
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    from app import tracing_sdk

    tracer = tracing_sdk.build("front", "otlp", "http/protobuf", "test")
    try:
        assert trace_exporter.encode_spans is tracing_encode.encode_spans
    finally:
        tracer.shutdown()
    assert tracing_encode.install(trace_exporter)  # again: still ours


def test_a_module_without_the_sdk_encoder_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    import types

    module = types.ModuleType("newer_exporter")
    module.encode_spans = lambda spans: None  # type: ignore[attr-defined]
    assert not tracing_encode.install(module)
    assert "the SDK's encoder runs" in caplog.text


def test_what_does_not_encode_costs_one_attribute_not_the_batch() -> None:
    """A key whose values stopped being kept (a request id) meets a value that does not
    encode (past 64 bits, a lone surrogate): the SDK's encoder drops that attribute alone,
    and so it is here, not the whole batch."""
    kept = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("app")
    for i in range(tracing_encode._Attributes.VARYING_AFTER + 5):
        tracer.start_span("hit", attributes={"n": i, "s": f"id-{i}"}).end()
    tracer.start_span("big", attributes={"n": 2**64, "s": "ok"}).end()
    tracer.start_span("surrogate", attributes={"n": 1, "s": "\ud800"}).end()
    spans = list(kept.get_finished_spans())
    encoder = tracing_encode.Encoder()
    ours = ExportTraceServiceRequest.FromString(encoder.encode(spans).SerializeToString())
    theirs = ExportTraceServiceRequest.FromString(sdk_encode(spans).SerializeToString())
    assert as_spans(ours) == as_spans(theirs)
    big = next(s for s in as_spans(ours) if s["name"] == "big")
    assert big["attributes"] == {"s": {"stringValue": "ok"}}


def test_limits_and_scopes_as_the_sdk_says_them() -> None:
    """Limits that drop every event and link are counted; one resource with two scopes is
    one ResourceSpans with two ScopeSpans."""
    from opentelemetry.sdk.trace import SpanLimits

    kept = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_events=0, max_links=0))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    first, second = provider.get_tracer("app"), provider.get_tracer("engine")
    span = first.start_span("limited")
    span.add_event("dropped")
    span.end()
    second.start_span("other scope").end()
    first.start_span("plain").end()
    spans = list(kept.get_finished_spans())
    ours = ExportTraceServiceRequest.FromString(
        tracing_encode.Encoder().encode(spans).SerializeToString()
    )
    theirs = ExportTraceServiceRequest.FromString(sdk_encode(spans).SerializeToString())
    assert as_spans(ours) == as_spans(theirs)
    limited = next(s for s in as_spans(ours) if s["name"] == "limited")
    assert limited["droppedEventsCount"] == 1
    assert len(ours.resource_spans) == 1 and len(ours.resource_spans[0].scope_spans) == 2
