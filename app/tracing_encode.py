"""OTLP's protobuf for a batch of finished spans, about three times cheaper than the SDK's
own encoder, so that tracing every hit costs a front little (docs/PERFORMANCE.md#tracing).

Measured on a traced front worker (py-spy, every hit sampled): the SDK's encoder
(``opentelemetry.exporter.otlp.proto.common``) held the GIL longer than all the request
handling together. It builds a protobuf ``KeyValue`` and ``AnyValue`` for every attribute of
every span, and hashes each span's resource (a JSON dump of its attributes) to group them.
This encoder builds the same request with the same ``opentelemetry.proto`` classes, but an
attribute whose key and value a recent span had (the method, the status, the cache's
outcome...) is kept serialized, and a span's kept pieces are merged in one
``MergeFromString`` (protobuf's C parser); values that never repeat (timings, request ids)
are built as before. Spans are grouped by their resource and scope objects, each encoded
once. Spans with events or links, or a value that is not a scalar or does not encode, are
rare (a miss's, an error's): the SDK's encoder encodes those. The output parses to the same
request as the SDK's (tests/test_tracing_encode.py).

``install(module)`` makes an SDK OTLP span exporter (HTTP or gRPC) use it: each calls the
``encode_spans`` its module imported, and that name is rebound (``app.tracing_sdk``). If a
later SDK no longer has it there, its own encoder runs: correct, only dearer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

log = logging.getLogger(__name__)

_KIND = {
    SpanKind.INTERNAL: PbSpan.SPAN_KIND_INTERNAL,
    SpanKind.SERVER: PbSpan.SPAN_KIND_SERVER,
    SpanKind.CLIENT: PbSpan.SPAN_KIND_CLIENT,
    SpanKind.PRODUCER: PbSpan.SPAN_KIND_PRODUCER,
    SpanKind.CONSUMER: PbSpan.SPAN_KIND_CONSUMER,
}
_HAS_IS_REMOTE = 0x100  # SpanFlags: the parent's remoteness is told, and it is remote
_IS_REMOTE = 0x200
_SCALARS = (str, bool, int, float)
_REUSED_MAX = 2048  # recent attributes kept; emptied when full (unique values pass through)


class _Attributes:
    """Each attribute serialized as a span's ``attributes`` field (a ``KeyValue``), kept for
    the same (key, type, value): a span's repeated attributes are then one
    ``MergeFromString`` of their pieces joined (protobuf merges concatenated messages,
    appending repeated fields), parsed by protobuf's C code, not built message by message in
    Python. Values that do not repeat are not kept (``None``: added as messages): floats
    (timings), and a key once it has had ``VARYING_AFTER`` values kept (a request id)."""

    VARYING_AFTER = 64

    def __init__(self) -> None:
        self._recent: dict[tuple[str, type, Any], bytes] = {}
        self._values: dict[str, int] = {}  # how many values of each key are kept
        self._varying: set[str] = set()

    def piece(self, key: str, value: Any) -> bytes | None:
        index = (key, type(value), value)
        found = self._recent.get(index)
        if found is not None or type(value) is float or key in self._varying:
            return found
        found = PbSpan(attributes=[KeyValue(key=key, value=any_value(value))]).SerializeToString()
        if len(self._recent) >= _REUSED_MAX:
            self._recent.clear()
            self._values.clear()
        self._recent[index] = found
        kept = self._values[key] = self._values.get(key, 0) + 1
        if kept >= self.VARYING_AFTER and len(self._varying) < 256:
            self._varying.add(key)
        return found


def any_value(value: Any) -> AnyValue:
    """A scalar attribute's ``AnyValue`` (str, bool, int or float; bool before int)."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    return AnyValue(double_value=value)


class Encoder:
    """One per process (``ENCODER``): its attributes' and resources' messages are reused
    across batches (the batch processor exports from one thread)."""

    def __init__(self) -> None:
        self._attributes = _Attributes()
        # Per (resource, scope) object ids; each head holds its objects, so no id is reused.
        self._heads: dict[tuple[int, int], tuple[Any, str, Any, str, Any]] = {}

    def encode(self, spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        request = ExportTraceServiceRequest()
        # As the SDK groups them: a ResourceSpans per resource, a ScopeSpans per scope in it.
        resources: dict[int, Any] = {}
        groups: dict[tuple[int, int], ScopeSpans] = {}
        for span in spans:
            index = (id(span.resource), id(span.instrumentation_scope))
            scope_spans = groups.get(index)
            if scope_spans is None:
                resource, resource_url, scope, scope_url, _ = self._head(index, span)
                resource_spans = resources.get(index[0])
                if resource_spans is None:
                    resource_spans = resources[index[0]] = request.resource_spans.add(
                        resource=resource, schema_url=resource_url
                    )
                scope_spans = resource_spans.scope_spans.add(scope=scope, schema_url=scope_url)
                groups[index] = scope_spans
            if span.events or span.links or not self._add(scope_spans, span):
                scope_spans.spans.extend(sdk_encode([span]).resource_spans[0].scope_spans[0].spans)
        return request

    def _head(self, index: tuple[int, int], span: ReadableSpan) -> tuple[Any, str, Any, str, Any]:
        """The resource's and the scope's messages and schema URLs of ``span``'s group (the
        SDK's own encoding, once per resource and scope object: a process has one of each)."""
        head = self._heads.get(index)
        if head is None:
            resource_spans = sdk_encode([span]).resource_spans[0]
            scope_spans = resource_spans.scope_spans[0]
            objects = (span.resource, span.instrumentation_scope)
            head = (resource_spans.resource, resource_spans.schema_url, scope_spans.scope,
                    scope_spans.schema_url, objects)  # fmt: skip
            if len(self._heads) >= 16:
                self._heads.clear()
            self._heads[index] = head
        return head

    def _add(self, scope_spans: ScopeSpans, span: ReadableSpan) -> bool:
        """``span`` (no events or links) added; False, nothing added, for what the SDK's
        encoder says better: an attribute that is not a scalar or does not encode (it drops
        that one alone), a limit that dropped every event or link (it says how many)."""
        if span.dropped_events or span.dropped_links or span.status is None:
            return False
        attributes = span.attributes or {}
        pieces: list[bytes] = []
        varying: list[KeyValue] = []
        piece = self._attributes.piece
        try:
            status = status_piece(span.status.status_code.value, span.status.description)
            for key, value in attributes.items():
                if type(value) not in _SCALARS:
                    return False
                found = piece(key, value)
                if found is None:
                    varying.append(KeyValue(key=key, value=any_value(value)))
                else:
                    pieces.append(found)
        except ValueError:  # past 64 bits, a lone surrogate: the SDK's encoder drops that one
            return False
        context = span.get_span_context()
        if context is None:  # not an SDK span that ended: the SDK's encoder says what it can
            return False
        parent = span.parent
        encoded = scope_spans.spans.add(
            trace_id=context.trace_id.to_bytes(16, "big"),
            span_id=context.span_id.to_bytes(8, "big"),
            name=span.name,
            kind=_KIND[span.kind],
            start_time_unix_nano=span.start_time,
            end_time_unix_nano=span.end_time,
            flags=_HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0),
        )
        if parent is not None:
            encoded.parent_span_id = parent.span_id.to_bytes(8, "big")
        if context.trace_state:
            encoded.trace_state = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
        pieces.append(status)
        encoded.MergeFromString(b"".join(pieces))
        encoded.attributes.extend(varying)  # after the others: attributes are a map
        if span.dropped_attributes:
            encoded.dropped_attributes_count = span.dropped_attributes
        return True


@functools.lru_cache(maxsize=64)
def status_piece(code: int, description: str | None) -> bytes:
    """A span's ``status`` field, serialized (a few codes and descriptions recur)."""
    status = Status(code=code, message=description)  # type: ignore[arg-type]
    return PbSpan(status=status).SerializeToString()


ENCODER = Encoder()


def encode_spans(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """The SDK's ``encode_spans``, cheaper: the same request."""
    return ENCODER.encode(spans)


def install(module: ModuleType) -> bool:
    """``module`` (an OTLP span exporter's) now encodes with ``encode_spans``; False, with
    a warning, if it has no ``encode_spans`` of the SDK's to replace."""
    if getattr(module, "encode_spans", None) not in (sdk_encode, encode_spans):
        log.warning("%s has no encode_spans to replace: the SDK's encoder runs", module.__name__)
        return False
    module.encode_spans = encode_spans  # type: ignore[attr-defined]
    return True
