"""Tracing's configuration and parts, in one process (``app.tracing``): on only when the
``OTEL_*`` variables ask; off, the SDK is never imported and the front door not wrapped; on,
the client's ``traceparent`` is continued (from when nginx received the request), a
ticket carries the context to the engine's span as optional fields an older engine ignores,
and JSON log lines carry the ids. The served path with a real receiver:
tests/test_tracing_served.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app import logformat, tracing
from app.engines.engine_thread import EngineThread
from app.engines.paddle import Spanned
from app.queue.ticket import FORMAT, Ticket, decode
from app.vocabulary import OcrParams
from tests.conftest import ROOT

pytestmark = pytest.mark.unit

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ],
)
def test_tracing_is_on_only_when_an_endpoint_or_exporter_is_set(environ, on) -> None:
    assert tracing.wanted(environ) is on


def test_the_exporter_and_its_protocol_are_read_from_the_standard_variables() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert tracing.exporter(endpoint) == "otlp" and tracing.exporter({}) == "none"
    assert tracing.exporter({"OTEL_TRACES_EXPORTER": "Console,otlp"}) == "console"
    assert tracing.protocol({}) == "http/protobuf"
    assert tracing.protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    both = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}  # fmt: skip
    assert tracing.protocol(both) == "http/protobuf"
    assert tracing.check({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) == (
        "OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json'; expected one of http/protobuf, grpc"
    )
    assert "OTEL_TRACES_EXPORTER: 'zipkin'" in tracing.check({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert tracing.check({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) == ""  # tracing off
    assert tracing.check({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == ""


def test_a_bad_variable_stops_start_up_with_one_line() -> None:
    env = {"PATH": "/usr/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "app", "check-config"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "configuration error: OTEL_EXPORTER_OTLP_PROTOCOL: 'thrift'; expected one of "
        "http/protobuf, grpc"
    )


def test_off_the_sdk_is_never_imported_and_the_front_door_is_not_wrapped() -> None:
    """Off is a tracer whose spans do nothing, chosen once: no tracer provider, no exporter
    (redis-py imports the OpenTelemetry API for its own opt-in metrics: not ours)."""
    script = (
        "import sys\n"
        "from app import tracing\n"
        "from app.cache import traced\n"
        "class Cache:\n"
        "    def get_or_compute_many(self): pass\n"
        "    def get_or_compute_document(self): pass\n"
        "cache = Cache()\n"
        "assert tracing.setup('front', {'OTEL_SERVICE_NAME': 'x'}) is tracing.OFF\n"
        "traced.instrument(cache, tracing.TRACER)\n"
        "assert 'get_or_compute_many' not in vars(cache)\n"
        "with tracing.TRACER.server('x', {'traceparent': 'y'}) as span:\n"
        "    span.set('a', 1)\n"
        "    assert span is tracing.NO_SPAN and span.carrier() == {}\n"
        "assert tracing.TRACER.ids() == ('', '')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('app.tracing_sdk', "
        "'opentelemetry.exporter', 'opentelemetry.sdk.trace'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_a_server_span_continues_the_clients_trace_from_the_edges_receipt(traced) -> None:
    sent = time.time()
    headers = {"traceparent": TRACEPARENT, "tracestate": "k=v",
               tracing.EDGE_TIMING: f"{sent:.3f} 0.250"}  # fmt: skip
    with tracing.TRACER.server("POST /v1/ocr", headers, via_edge=True) as span:
        assert span.recording and tracing.TRACER.ids()[0] == TRACE_ID
        carrier = span.carrier()
    spans = _by_name(traced)
    assert list(spans) == ["POST /v1/ocr"]  # the edge's time is the server span's own
    front = spans["POST /v1/ocr"]
    assert f"{front.context.trace_id:032x}" == TRACE_ID
    assert f"{front.parent.span_id:016x}" == PARENT_ID
    assert front.attributes["edge.read_seconds"] == pytest.approx(0.25, abs=0.002)
    assert front.start_time == pytest.approx((sent - 0.25) * 1e9, abs=2e6)  # nginx's receipt
    assert carrier["traceparent"].split("-")[1] == TRACE_ID and carrier["tracestate"] == "k=v"


def test_an_edge_timing_header_from_anyone_but_the_edge_is_ignored(traced) -> None:
    """Without nginx in front (``EDGE=none``) a client could send the header itself."""
    forged = {"traceparent": TRACEPARENT, tracing.EDGE_TIMING: f"{time.time() - 3600:.3f} 9"}
    with tracing.TRACER.server("POST /v1/ocr", forged, via_edge=False):
        pass
    assert list(_by_name(traced)) == ["POST /v1/ocr"]


def test_without_a_traceparent_the_front_starts_a_trace(traced) -> None:
    with tracing.TRACER.server("POST /v1/ocr", {}):
        trace_id, _ = tracing.TRACER.ids()
    assert trace_id and trace_id != TRACE_ID
    assert list(_by_name(traced)) == ["POST /v1/ocr"]


def ticket(**changes: Any) -> Ticket:
    return Ticket("ocr:v1:fp:t:{m}", "s" * 64, OcrParams(), "", 60, 1e10, b"i",
                  **changes)  # fmt: skip


def raw(fields: list[str | bytes]) -> dict[bytes, bytes]:
    as_bytes = [f.encode() if isinstance(f, str) else f for f in fields]
    return dict(zip(as_bytes[::2], as_bytes[1::2], strict=True))


def test_a_ticket_carries_the_context_in_optional_fields_of_its_format() -> None:
    """Same format: an engine of the release before ignores the fields (it reads the fields it
    knows by name), and this engine reads a ticket without them (format 1 as it was)."""
    plain = ticket().fields()
    assert "traceparent" not in plain and plain[:2] == ["fmt", FORMAT]
    carried = ticket(trace=TRACEPARENT, tracestate="k=v").fields()
    assert carried[: len(plain)] == plain and carried[len(plain) :] == [
        "traceparent", TRACEPARENT, "tracestate", "k=v"
    ]  # fmt: skip
    back = decode("1-0", raw(carried)).ticket
    assert back.carrier() == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert decode("1-0", raw(plain)).ticket.carrier() == {}
    # What an engine of the release before makes of it: the fields it knows, the rest ignored.
    older = {k: v for k, v in raw(carried).items() if k not in (b"traceparent", b"tracestate")}
    assert decode("1-0", older).ok


def test_the_engines_span_joins_the_trace_the_ticket_carries(traced) -> None:
    with tracing.TRACER.span("queue.wait") as wait:
        carried = ticket(trace=wait.carrier()["traceparent"])
    engine_side = tracing.TRACER.remote(
        "engine.ticket", decode("1-0", raw(carried.fields())).ticket.carrier()
    )
    with engine_side.active(), tracing.TRACER.span("cache.write"):
        pass
    engine_side.end()
    spans = _by_name(traced)
    assert spans["engine.ticket"].parent.span_id == spans["queue.wait"].context.span_id
    assert spans["cache.write"].parent.span_id == spans["engine.ticket"].context.span_id
    assert len({span.context.trace_id for span in spans.values()}) == 1


def test_a_joiner_links_to_the_computing_trace(traced) -> None:
    with tracing.TRACER.span("computing") as computing:
        carrier = computing.carrier()
    with tracing.TRACER.span("joiner"):
        tracing.TRACER.current().link(carrier)
    joiner = _by_name(traced)["joiner"]
    assert [link.context.span_id for link in joiner.links] == [
        _by_name(traced)["computing"].context.span_id
    ]


def test_json_log_lines_carry_the_trace_and_span_ids(traced, capsys) -> None:
    record = logging.LogRecord("app.x", logging.INFO, __file__, 1, "hello %s", ("a\nb",), None)
    formatter = logformat.JsonFormatter()
    assert "trace_id" not in json.loads(formatter.format(record))
    with tracing.TRACER.server("POST /v1/ocr", {"traceparent": TRACEPARENT}):
        line = json.loads(formatter.format(record))
        span_id = tracing.TRACER.ids()[1]
    assert line["trace_id"] == TRACE_ID and line["span_id"] == span_id
    assert line["message"] == "hello a\nb" and line["level"] == "INFO" and line["logger"] == "app.x"


def test_an_engine_threads_call_runs_in_its_callers_context(traced) -> None:
    """The engine's thread runs each call in its caller's context: the caller's span is
    the parent of the spans the call opens; an interjected call runs in its own."""
    runner = EngineThread("traced-engine")

    def pausing() -> str:
        with tracing.TRACER.span("paged"):
            runner.yield_point()
        return tracing.TRACER.ids()[0]

    with tracing.TRACER.span("interjecting"):
        interjected = runner.interject(lambda: tracing.TRACER.span("other").end())
    with tracing.TRACER.span("engine.recognize") as call:
        trace_id = runner.submit(pausing).result(10)
        assert trace_id == call.carrier()["traceparent"].split("-")[1]
    interjected.result(10)
    spans = _by_name(traced)
    assert spans["paged"].parent.span_id == spans["engine.recognize"].context.span_id
    assert spans["other"].parent.span_id == spans["interjecting"].context.span_id


def test_a_pipeline_models_calls_are_child_spans_of_a_traced_call_only(traced) -> None:
    def model(inputs: list[int], scale: int = 1):
        for item in inputs:
            yield item * scale

    detection = Spanned(model, "ocr.detection")
    assert list(detection([1, 2], scale=3)) == [3, 6]  # no current span: no span (warm-up)
    assert _by_name(traced) == {}
    with tracing.TRACER.span("engine.recognize"):
        answers = detection([1, 2, 3])
        assert next(answers) == 1
        assert "ocr.detection" not in _by_name(traced)  # lasts while its answers are read
        assert list(answers) == [2, 3]
    spans = _by_name(traced)
    assert spans["ocr.detection"].parent.span_id == spans["engine.recognize"].context.span_id
    assert spans["ocr.detection"].attributes["ocr.inputs"] == 3
