"""An OTLP/HTTP trace receiver with a web page: ``python -m app trace-receiver``.

Why our own: Jaeger, Grafana Tempo and the OpenTelemetry Collector ship as images on Docker
Hub and ghcr.io, which this project's machines cannot pull, and neither Debian nor PyPI
packages one with a UI. So the compose monitoring profile's ``traces`` service and the
tests (``tests/otlp_receiver.py``) run this: ``POST /v1/traces`` (protobuf or OTLP/JSON, gzip
or deflate) keeps the latest traces in memory, bounded, until restart; ``GET /`` lists them,
``/traces/<id>`` draws one as a waterfall, ``/api/traces[/<id>]`` is the same in JSON. For a
look on one machine; in production point ``OTEL_EXPORTER_OTLP_ENDPOINT`` at your Jaeger, Tempo
or Collector. No authentication (spans name request ids and tenants): publish it on loopback.
All it shows came from the network, escaped. Settings: ``HOST`` (the service's),
``TRACE_RECEIVER_PORT`` (4318), ``TRACE_RECEIVER_MAX_SPANS`` (20000, then the trace least
recently added to goes first).
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import signal
import sys
import threading
import zlib
from base64 import b64encode
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from app import env as e
from app.env import ConfigError

MAX_BODY = 16 << 20  # bytes of one export, as sent and inflated: 413 above
PORT, MAX_SPANS = 4318, 20_000
HTML, JSON = "text/html; charset=utf-8", "application/json"
log = logging.getLogger("app.trace_receiver")


class Refused(Exception):
    """An export not kept; ``args``: the HTTP status and why."""


@dataclass
class Span:
    """One span, flat: its resource's attributes beside its own; ids in hex."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)
    start_ns: int = 0
    end_ns: int = 0
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    error: str | None = None  # the status message when the span's status is ERROR


def _value(any_value: Any) -> Any:
    """An OTLP AnyValue as JSON-able data (bytes in hex, inf and nan as text)."""
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(any_value.kvlist_value.values)
    value = getattr(any_value, kind) if kind else None
    if isinstance(value, bytes):
        return value.hex()
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    return [
        Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
             _attributes(s.attributes), resource,
             [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
             s.start_time_unix_nano, s.end_time_unix_nano,
             [(ev.name, ev.time_unix_nano, _attributes(ev.attributes)) for ev in s.events],
             s.status.message if s.status.code == Status.STATUS_CODE_ERROR else None)
        for rs in request.resource_spans
        for resource in [_attributes(rs.resource.attributes)]
        for scope in rs.scope_spans
        for s in scope.spans
    ]  # fmt: skip


def _from_json(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON: protobuf's JSON mapping, except that ids are hex, not base64."""
    data = json.loads(body)
    for rs in data.get("resourceSpans", ()):
        for span in (span for scope in rs.get("scopeSpans", ()) for span in scope.get("spans", ())):
            for item in (span, *span.get("links", ())):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if item.get(key):
                        item[key] = b64encode(bytes.fromhex(item[key])).decode()
    return json_format.ParseDict(data, ExportTraceServiceRequest())


def decode(body: bytes, encoding: str, as_json: bool) -> ExportTraceServiceRequest:
    """One export's body (``Content-Encoding`` gzip, deflate or none), else Refused."""
    encoding = encoding.strip().lower()
    if encoding in ("gzip", "deflate"):
        inflate = zlib.decompressobj(32 + zlib.MAX_WBITS)  # a gzip or a zlib header
        try:
            body = inflate.decompress(body, MAX_BODY + 1)  # a bomb stops at the bound
        except zlib.error as exc:
            raise Refused(400, f"{encoding}: {exc}") from None
        if len(body) > MAX_BODY:
            raise Refused(413, f"over {MAX_BODY} bytes inflated")
        if not inflate.eof:
            raise Refused(400, f"{encoding}: truncated")
    elif encoding not in ("", "identity"):
        raise Refused(415, f"Content-Encoding {encoding!r}: gzip, deflate or none")
    try:
        return _from_json(body) if as_json else ExportTraceServiceRequest.FromString(body)
    except Exception as exc:  # whatever those bytes were, nothing of them is kept
        raise Refused(400, f"not an OTLP trace export ({type(exc).__name__})") from None


class Store:
    """The latest traces, at most ``max_spans`` spans. ``decode=False`` (the tracing bench)
    counts exports without decoding them: a collector elsewhere costs the service the send."""

    def __init__(self, max_spans: int = MAX_SPANS, decode: bool = True) -> None:
        self.max_spans, self.decode = max_spans, decode
        self.requests = self.bytes = self.count = 0  # exports taken, their bytes, spans kept
        self._traces: OrderedDict[str, list[Span]] = OrderedDict()
        self._lock = threading.Lock()

    def receive(self, body: bytes, encoding: str = "", as_json: bool = False) -> None:
        spans = spans_of(decode(body, encoding, as_json)) if self.decode else []
        with self._lock:
            self.requests, self.bytes = self.requests + 1, self.bytes + len(body)
            for span in spans:
                self._traces.setdefault(span.trace_id, []).append(span)
                self._traces.move_to_end(span.trace_id)
            self.count += len(spans)
            while self.count > self.max_spans:
                oldest = next(iter(self._traces))
                if len(self._traces) == 1:  # one trace over the bound: its first spans go
                    del self._traces[oldest][: self.count - self.max_spans]
                    self.count = self.max_spans
                else:
                    self.count -= len(self._traces.pop(oldest))

    def traces(self) -> list[tuple[str, list[Span]]]:
        """Newest first."""
        with self._lock:
            return [(trace_id, list(spans)) for trace_id, spans in reversed(self._traces.items())]

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return list(self._traces.get(trace_id, ()))

    def spans(self) -> list[Span]:
        return [span for _, spans in self.traces() for span in spans]


def summary(trace_id: str, spans: list[Span]) -> dict[str, Any]:
    """A trace in the list: its root span, start, duration, span count, and the roles
    (``ocr.role``) and services (``service.name``) its spans came from."""
    ids, start = {s.span_id for s in spans}, min(s.start_ns for s in spans)
    roots = [s for s in spans if s.parent_id not in ids] or spans  # or a cycle of parents
    root = min(roots, key=lambda s: s.start_ns)
    try:
        when = datetime.fromtimestamp(start / 1e9, UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):  # a timestamp sent so
        when = str(start)
    seen = {key: sorted({str(s.resource[key]) for s in spans if key in s.resource})
            for key in ("ocr.role", "service.name")}  # fmt: skip
    return {"trace_id": trace_id, "root": root.name, "start": when, "start_ns": start,
            "duration_ms": (max(s.end_ns for s in spans) - start) / 1e6, "spans": len(spans),
            "roles": seen["ocr.role"], "services": seen["service.name"]}  # fmt: skip


def waterfall(spans: list[Span]) -> list[tuple[int, Span]]:
    """(depth, span) depth first from the roots (parent not in the trace), children by start;
    spans in a cycle of parents (sent so) last, at depth 0."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[Span]] = {}  # by parent id, "" for the roots
    for s in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    order: list[tuple[int, Span]] = []
    expanded: set[str] = set()
    stack = [(0, s) for s in reversed(children.pop("", []))]
    while stack:
        depth, span = stack.pop()
        order.append((depth, span))
        if span.span_id not in expanded:  # an id sent twice: its children once
            expanded.add(span.span_id)
            stack += [(depth + 1, c) for c in reversed(children.get(span.span_id, []))]
    shown = {id(s) for _, s in order}
    return order + [(0, s) for s in spans if id(s) not in shown]


def _text(value: Any) -> str:
    return html.escape(value if isinstance(value, str) else json.dumps(value))


def _pairs(values: Mapping[str, Any]) -> str:
    return " ".join(f"<code>{_text(k)}={_text(v)}</code>" for k, v in values.items())


PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>
body{{font:14px sans-serif;margin:1em}}table{{border-collapse:collapse;width:100%}}
td,th{{padding:3px 8px;text-align:left;vertical-align:top;border-bottom:1px solid #ddd}}
.bar{{background:#4a90d9;height:10px;min-width:1px}}.err .bar{{background:#d9534f}}
small{{color:#555}}code{{margin-right:.6em}}</style></head><body><p><a href="/">traces</a></p>
<h1>{title}</h1><table>{rows}</table></body></html>"""


def index_page(store: Store) -> str:
    rows = [f'<tr><td><a href="/traces/{_text(t["trace_id"])}">{_text(t["root"])}</a></td>'
            f"<td>{_text(t['start'])}</td><td>{t['duration_ms']:.3f} ms</td><td>{t['spans']}</td>"
            f"<td>{_text(', '.join(t['roles']))}</td><td>{_text(', '.join(t['services']))}</td>"
            "</tr>" for t in (summary(i, spans) for i, spans in store.traces())]  # fmt: skip
    head = "<tr><th>root span</th><th>start (UTC)</th><th>duration</th><th>spans</th>"
    rows.insert(0, f"{head}<th>roles</th><th>services</th></tr>")
    return PAGE.format(title=f"Traces ({store.count} spans kept)", rows="".join(rows))


def trace_page(trace_id: str, spans: list[Span]) -> str:
    start = min(s.start_ns for s in spans)
    scale = 100 / max(max(s.end_ns for s in spans) - start, 1)  # ns to % of the trace
    rows = [
        "<tr><th>span: role, process</th><th>offset</th><th>duration</th><th></th>"
        "<th>attributes, events, links</th></tr>"
    ]
    for depth, s in waterfall(spans):
        role, process = s.resource.get("ocr.role", ""), s.resource.get("service.instance.id", "")
        notes = [_pairs(s.attributes)] + [
            f"event @{(at - start) / 1e6:.3f} ms {_text(name)} {_pairs(attrs)}"
            for name, at, attrs in s.events] + [
            f'link <a href="/traces/{_text(t)}">{_text(t)}</a>/{_text(i)}' for t, i in s.links
        ] + ([f"error: {_text(s.error)}"] if s.error is not None else [])  # fmt: skip
        rows.append(
            f'<tr{" class=err" if s.error is not None else ""}><td style="padding-left:'
            f'{8 + 16 * depth}px">{_text(s.name)}<br><small>{_text(role)} {_text(process)}'
            f"</small></td><td>{(s.start_ns - start) / 1e6:.3f} ms</td><td>"
            f'{(s.end_ns - s.start_ns) / 1e6:.3f} ms</td><td style="width:25%"><div class=bar '
            f'style="margin-left:{max(s.start_ns - start, 0) * scale:.2f}%;width:'
            f'{max(s.end_ns - s.start_ns, 0) * scale:.2f}%"></div></td><td><small>'
            f"{'<br>'.join(filter(None, notes))}</small></td></tr>"
        )
    return PAGE.format(title=f"Trace {_text(trace_id)}", rows="".join(rows))


class Handler(BaseHTTPRequestHandler):
    timeout = 30  # seconds a client may take over its request

    def __init__(self, *args: Any, store: Store, **kwargs: Any) -> None:
        self.store = store
        super().__init__(*args, **kwargs)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = self.headers.get("Content-Length", "")
        as_json = self.headers.get_content_type() == JSON
        if self.path.split("?", 1)[0] != "/v1/traces":
            return self._send(404, b"POST /v1/traces\n")
        if not length.isdigit():
            return self._send(411, b"Content-Length required\n")
        if int(length) > MAX_BODY:  # left unread: the connection closes
            return self._send(413, f"over {MAX_BODY} bytes\n".encode())
        try:
            body = self.rfile.read(int(length))
            self.store.receive(body, self.headers.get("Content-Encoding", ""), as_json)
        except Refused as exc:
            return self._send(exc.args[0], f"{exc.args[1]}\n".encode())
        if as_json:
            return self._send(200, b"{}", JSON)
        self._send(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            return self._send(200, b"ok\n")
        if path == "/":
            return self._send(200, index_page(self.store).encode(), HTML)
        if path == "/api/traces":
            found = [summary(trace_id, spans) for trace_id, spans in self.store.traces()]
            return self._send(200, json.dumps(found).encode(), JSON)
        folder, _, trace_id = path.rpartition("/")
        spans = self.store.trace(trace_id) if folder in ("/traces", "/api/traces") else []
        if not spans:
            return self._send(404, b"no such trace (the latest only, kept in memory)\n")
        if folder == "/traces":
            return self._send(200, trace_page(trace_id, spans).encode(), HTML)
        start = min(s.start_ns for s in spans)
        found = [
            {
                **asdict(s),
                "depth": depth,
                "offset_ms": (s.start_ns - start) / 1e6,
                "duration_ms": (s.end_ns - s.start_ns) / 1e6,
            }
            for depth, s in waterfall(spans)
        ]
        self._send(200, json.dumps({**summary(trace_id, spans), "spans": found}).encode(), JSON)

    def _send(self, status: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)


def make_server(address: tuple[str, int], store: Store) -> ThreadingHTTPServer:
    """The receiver on ``address`` (port 0: a free one), not serving yet."""
    return ThreadingHTTPServer(address, partial(Handler, store=store))


def _setting(environ: Mapping[str, str], name: str, default: int, most: int) -> int:
    """An integer in 1..most; unset or empty: ``default``."""
    return int(e.integer(1, most)(name, environ.get(name) or str(default)))


def run(host: str, environ: Mapping[str, str] = os.environ) -> int:
    """``python -m app trace-receiver``: serves until SIGTERM or Ctrl-C."""
    port = 0
    try:
        port = _setting(environ, "TRACE_RECEIVER_PORT", PORT, 65535)
        kept = _setting(environ, "TRACE_RECEIVER_MAX_SPANS", MAX_SPANS, 10**7)
        server = make_server((host, port), Store(kept))
    except (ConfigError, OSError) as exc:  # OSError: the port taken, HOST not an address here
        why = exc if isinstance(exc, ConfigError) else f"{host}:{port}: {exc.strerror}"
        print(f"configuration error: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    log.info("trace receiver on http://%s:%d (OTLP/HTTP: POST /v1/traces)", host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
