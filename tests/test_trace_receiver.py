"""The trace receiver users open in a browser (``app/trace_receiver.py``: compose's ``traces``
service, ``python -m app trace-receiver``), fed by the OpenTelemetry SDK's own OTLP/HTTP
exporter: the traces in ``/api/traces`` and on the HTML pages, a span name or attribute sent
as markup shown as text, gzip and deflate, OTLP/JSON, a body over 16 MiB (413, also once
inflated), a body that is no export (400, nothing kept), and the bound on kept spans."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, Status, StatusCode

from app.ports import free_port
from app.trace_receiver import MAX_BODY, Span, waterfall
from tests.conftest import ROOT
from tests.otlp_receiver import Receiver

pytestmark = pytest.mark.unit

HOSTILE = "<script>alert(1)</script>"
IMG = '<img src=x onerror="alert(2)">'
JSON = "application/json"


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    receiving = Receiver()
    yield receiving
    receiving.close()


def provider(endpoint: str, role: str, compression: Compression | None = None) -> TracerProvider:
    """A tracer provider of one process (``role``) exporting each span as it ends."""
    resource = Resource.create(
        {"service.name": "ocr-cache", "ocr.role": role, "service.instance.id": f"h-{role}-1"}
    )
    tracing = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", compression=compression)
    tracing.add_span_processor(SimpleSpanProcessor(exporter))
    return tracing


def one_request(endpoint: str, compression: Compression | None = None) -> str:
    """A front's server span, a child span named as markup, an engine's span under it (error
    status, an event, a link to another trace): the trace id, in hex."""
    front, engine = (provider(endpoint, role, compression) for role in ("front", "engine"))
    try:
        other = front.get_tracer("t").start_span("elsewhere")
        other.end()
        with front.get_tracer("t").start_as_current_span("POST /v1/ocr") as root:
            with front.get_tracer("t").start_as_current_span(HOSTILE) as child:
                child.set_attribute("ocr.tenant", IMG)
                child.set_attribute(HOSTILE, 3)
                context = trace.set_span_in_context(child)
                links = [Link(other.get_span_context())]
                with engine.get_tracer("t").start_as_current_span(
                    "engine.ticket", context=context, links=links
                ) as ticket:
                    ticket.add_event("line reuse", {"ocr.lines": 2})
                    ticket.set_status(Status(StatusCode.ERROR, "boom <b>"))
        return format(root.get_span_context().trace_id, "032x")
    finally:
        front.shutdown()
        engine.shutdown()


def test_exported_spans_are_listed_and_drawn_as_a_waterfall(receiver: Receiver) -> None:
    trace_id = one_request(receiver.endpoint)
    listed = requests.get(f"{receiver.endpoint}/api/traces", timeout=10).json()
    ours = next(t for t in listed if t["trace_id"] == trace_id)
    assert (ours["root"], ours["spans"]) == ("POST /v1/ocr", 3)
    assert ours["roles"] == ["engine", "front"] and ours["services"] == ["ocr-cache"]
    assert ours["duration_ms"] > 0 and ours["start"].startswith("20")
    assert len(listed) == 2 and listed[0]["trace_id"] == trace_id  # newest first

    one = requests.get(f"{receiver.endpoint}/api/traces/{trace_id}", timeout=10).json()
    spans = one["spans"]
    assert [(s["name"], s["depth"]) for s in spans] == [
        ("POST /v1/ocr", 0), (HOSTILE, 1), ("engine.ticket", 2)]  # fmt: skip
    root, child, ticket = spans
    assert child["parent_id"] == root["span_id"] and ticket["parent_id"] == child["span_id"]
    assert root["offset_ms"] == 0 and 0 <= child["offset_ms"] <= ticket["offset_ms"]
    assert child["attributes"] == {"ocr.tenant": IMG, HOSTILE: 3}
    assert ticket["resource"]["ocr.role"] == "engine"
    assert ticket["resource"]["service.instance.id"] == "h-engine-1"
    assert [(name, attrs) for name, _, attrs in ticket["events"]] == [
        ("line reuse", {"ocr.lines": 2})]  # fmt: skip
    ((linked_trace, _),) = ticket["links"]
    assert linked_trace in {t["trace_id"] for t in listed} - {trace_id}
    assert ticket["error"] == "boom <b>" and root["error"] is None
    assert receiver.requests == 4  # SimpleSpanProcessor: one export per span

    page = requests.get(f"{receiver.endpoint}/traces/{trace_id}", timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["Content-Security-Policy"]
    text = page.text
    assert "<script" not in text and "<img" not in text and "<b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in text
    assert "line reuse" in text and "error: boom &lt;b&gt;" in text and "h-engine-1" in text
    assert f'href="/traces/{linked_trace}"' in text

    index = requests.get(f"{receiver.endpoint}/", timeout=10).text
    assert f'href="/traces/{trace_id}"' in index and "POST /v1/ocr" in index
    assert "engine, front" in index


def test_a_root_span_named_as_markup_is_listed_as_text(receiver: Receiver) -> None:
    tracing = provider(receiver.endpoint, "front")
    tracing.get_tracer("t").start_span(HOSTILE).end()
    tracing.shutdown()
    index = requests.get(f"{receiver.endpoint}/", timeout=10).text
    assert "<script" not in index and "&lt;script&gt;alert(1)&lt;/script&gt;" in index


@pytest.mark.parametrize("compression", [Compression.Gzip, Compression.Deflate])
def test_compressed_exports(receiver: Receiver, compression: Compression) -> None:
    trace_id = one_request(receiver.endpoint, compression)
    assert {s.name for s in receiver.trace(trace_id)} == {"POST /v1/ocr", HOSTILE, "engine.ticket"}


def post(endpoint: str, body: bytes, **headers: str) -> requests.Response:
    headers = {"Content-Type": "application/x-protobuf", **headers}
    return requests.post(f"{endpoint}/v1/traces", data=body, headers=headers, timeout=10)


def test_otlp_json(receiver: Receiver) -> None:
    trace_id, span_id = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    span = {"traceId": trace_id, "spanId": span_id, "name": "GET /", "kind": 2,
            "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": "1544712661000000000",
            "attributes": [{"key": "n", "value": {"intValue": "3"}}]}  # fmt: skip
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "json-client"}}]}
    body = {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span]}]}]}
    answer = post(receiver.endpoint, json.dumps(body).encode(), **{"Content-Type": JSON})
    assert answer.status_code == 200 and answer.json() == {}
    (kept,) = receiver.trace(trace_id)
    assert (kept.span_id, kept.attributes, kept.resource) == (
        span_id, {"n": 3}, {"service.name": "json-client"})  # fmt: skip
    assert kept.end_ns - kept.start_ns == 1_000_000_000


def test_a_body_over_the_bound_is_refused_unread(receiver: Receiver) -> None:
    host, port = receiver.endpoint.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/v1/traces")
    connection.putheader("Content-Type", "application/x-protobuf")
    connection.putheader("Content-Length", str(MAX_BODY + 1))
    connection.endheaders()  # no body: the receiver answers from the header alone
    assert connection.getresponse().status == 413
    connection.close()
    bomb = gzip.compress(bytes(MAX_BODY + 1))  # about 16 KiB that inflate past the bound
    assert post(receiver.endpoint, bomb, **{"Content-Encoding": "gzip"}).status_code == 413
    assert receiver.requests == 0 and receiver.spans == []


@pytest.mark.parametrize(
    "body,headers",
    [
        (b"\xff" * 64, {}),
        (b"{not json", {"Content-Type": JSON}),
        (b'["a list"]', {"Content-Type": JSON}),
        (b"not gzip at all", {"Content-Encoding": "gzip"}),
        (gzip.compress(b"\x0a\x02\x0a")[:-8], {"Content-Encoding": "gzip"}),  # truncated
    ],
    ids=["protobuf", "json", "json-list", "gzip", "gzip-truncated"],
)
def test_a_body_that_is_no_export_is_refused_and_nothing_kept(
    receiver: Receiver, body: bytes, headers: dict[str, str]
) -> None:
    answer = post(receiver.endpoint, body, **headers)
    assert answer.status_code == 400, answer.text
    assert receiver.requests == 0 and receiver.spans == []
    assert requests.get(f"{receiver.endpoint}/api/traces", timeout=10).json() == []


def test_unknown_encoding_path_and_trace(receiver: Receiver) -> None:
    assert post(receiver.endpoint, b"", **{"Content-Encoding": "br"}).status_code == 415
    assert requests.post(f"{receiver.endpoint}/v1/logs", data=b"", timeout=10).status_code == 404
    for path in ("/traces/0123", "/api/traces/../x", "/nothing"):
        assert requests.get(f"{receiver.endpoint}{path}", timeout=10).status_code == 404
    assert requests.get(f"{receiver.endpoint}/healthz", timeout=10).text == "ok\n"


def test_the_oldest_traces_go_past_the_bound() -> None:
    bounded = Receiver(max_spans=5)
    try:
        ids = []
        for _ in range(3):  # 2 spans each: the third trace's root makes 6
            tracing = provider(bounded.endpoint, "front")
            with tracing.get_tracer("t").start_as_current_span("root") as root:
                tracing.get_tracer("t").start_span("child").end()
            tracing.shutdown()
            ids.append(format(root.get_span_context().trace_id, "032x"))
        listed = requests.get(f"{bounded.endpoint}/api/traces", timeout=10).json()
        assert [t["trace_id"] for t in listed] == [ids[2], ids[1]]
        assert len(bounded.spans) == 4 and bounded.store.count == 4 and bounded.requests == 6
    finally:
        bounded.close()
    single = Receiver(max_spans=3)  # one trace over the bound: its first spans go
    try:
        tracing = provider(single.endpoint, "front")
        with tracing.get_tracer("t").start_as_current_span("root"):
            for n in range(4):
                tracing.get_tracer("t").start_span(f"child {n}").end()
        tracing.shutdown()
        assert [s.name for s in single.spans] == ["child 2", "child 3", "root"]
    finally:
        single.close()


def test_a_waterfall_of_hostile_parents_ends_and_shows_every_span() -> None:
    def span(span_id: str, parent_id: str, start: int) -> Span:
        return Span("s" + span_id, "t", span_id, parent_id, {}, {}, start_ns=start, end_ns=9)

    spans = [span("a", "", 1), span("b", "a", 2), span("b", "a", 3), span("c", "b", 4),
             span("d", "d", 5), span("e", "f", 6), span("f", "e", 7)]  # fmt: skip
    order = waterfall(spans)
    assert sorted(id(s) for _, s in order) == sorted(map(id, spans))
    assert [(s.name, depth) for depth, s in order][:4] == [
        ("sa", 0), ("sb", 1), ("sc", 2), ("sb", 1)]  # fmt: skip


@pytest.mark.integration  # a process: `python -m app trace-receiver`
def test_the_command_serves_until_sigterm() -> None:
    port = free_port()
    env: dict[str, Any] = {**os.environ, "HOST": "127.0.0.1", "TRACE_RECEIVER_PORT": str(port)}
    for var in [v for v in env if v.startswith("OTEL_")]:
        del env[var]
    bad = subprocess.run([sys.executable, "-m", "app", "trace-receiver"], cwd=ROOT, text=True,
                         env={**env, "TRACE_RECEIVER_MAX_SPANS": "0"}, capture_output=True,
                         timeout=60)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "configuration error: TRACE_RECEIVER_MAX_SPANS: expected an integer in 1..10000000, got 0"
    ]
    process = subprocess.Popen([sys.executable, "-m", "app", "trace-receiver"], cwd=ROOT, env=env)
    try:
        endpoint, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            try:
                requests.get(f"{endpoint}/healthz", timeout=2).raise_for_status()
                break
            except requests.ConnectionError as exc:
                assert time.monotonic() < deadline, f"the receiver never answered: {exc}"
                assert process.poll() is None, f"the receiver exited ({process.returncode})"
                time.sleep(0.1)
        trace_id = one_request(endpoint)
        listed = requests.get(f"{endpoint}/api/traces", timeout=10).json()
        assert trace_id in {t["trace_id"] for t in listed}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
