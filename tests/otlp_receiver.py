"""The tests' and the tracing bench's OTLP/HTTP receiver: the one users run
(``app/trace_receiver.py``, ``python -m app trace-receiver``, compose's ``traces`` service),
started in this process on a free loopback port."""

from __future__ import annotations

import threading

from app.trace_receiver import MAX_SPANS, Span, Store, make_server

__all__ = ["Receiver", "Span"]


class Receiver:
    """``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes (and the web page's
    address); ``spans`` every span kept (at most ``max_spans``), ``requests`` how many exports
    arrived, ``bytes`` their size. ``decode=False`` (the tracing bench): bodies are read and
    answered, not decoded, as a collector on another machine costs the service nothing but
    the send."""

    def __init__(self, decode: bool = True, max_spans: int = MAX_SPANS) -> None:
        self.store = Store(max_spans, decode=decode)
        self._server = make_server(("127.0.0.1", 0), self.store)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def spans(self) -> list[Span]:
        return self.store.spans()

    @property
    def requests(self) -> int:
        return self.store.requests

    @property
    def bytes(self) -> int:
        return self.store.bytes

    def trace(self, trace_id: str) -> list[Span]:
        return self.store.trace(trace_id)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
