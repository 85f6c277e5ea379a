"""A tiny OTLP/HTTP trace receiver for the tests and the tracing bench: ``POST /v1/traces``
bodies decoded with ``opentelemetry-proto`` (as a collector would), kept as flat spans."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)
    start_ns: int = 0
    end_ns: int = 0


class Receiver:
    """Started on a free loopback port; ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT``
    takes; ``spans`` every span received; ``requests`` how many exports arrived.
    ``decode=False`` (the tracing bench): bodies are read and answered, not decoded, as a
    collector on another machine costs the service nothing but the send; ``bytes`` counts
    them."""

    def __init__(self, decode: bool = True) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if not decode:
                    with receiver._lock:
                        receiver.requests += 1
                        receiver.bytes += len(body)
                elif self.headers.get("Content-Encoding") == "gzip":
                    receiver.take(ExportTraceServiceRequest.FromString(gzip.decompress(body)))
                else:
                    receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans.append(
                        Span(
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            {a.key: _value(a.value) for a in span.attributes},
                            resource,
                            [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                        )  # fmt: skip
                    )
        with self._lock:
            self.spans.extend(spans)
            self.requests += 1

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
