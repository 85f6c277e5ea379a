"""The slow-client shield in front of gunicorn: an asyncio HTTP/1.1 server (h11) that reads
each request completely, under deadlines, before handing it to gunicorn over a unix socket.

gunicorn's ``gthread`` workers give a connection a thread as soon as it is accepted, and the
thread blocks while the client trickles its headers or body: WEB_CONCURRENCY x WEB_THREADS
slow clients stop all HTTP service (gunicorn's own advice is a buffering proxy in front). Here
a slow client costs a coroutine and its buffered bytes, never a worker thread; it is cut off
at ``HTTP_HEADER_TIMEOUT_SECONDS`` (the request head) or ``HTTP_BODY_TIMEOUT_SECONDS`` (the
body). gunicorn only ever sees complete requests from a local, fast writer, and its answer is
buffered here too, so a client that reads slowly does not hold a worker thread either.

``python -m app serve`` runs this as a child process (``python -m app.front``) listening on
HOST:HTTP_PORT, with gunicorn bound to a private unix socket. The client's address is passed
on in ``X-Forwarded-For`` (replacing any the client sent); the app trusts that header only on
requests that came over the unix socket (see ``app.trust``).

With ``--hit-spec`` (``HTTP_FRONT_HITS``) the front answers plain L2 hits itself, as a worker
would (``app.front_hits``), and several fronts may share the port (``--reuse-port``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import h11
import orjson

from app import logsafe, memory
from app.protocols.errors import error_envelope

if TYPE_CHECKING:
    from app.front_hits import FrontHits

log = logging.getLogger("app.front")

T = TypeVar("T")

# Headers that describe one hop, not the message: never forwarded.
_HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te",
        b"trailer", b"upgrade", b"expect", b"content-length", b"x-forwarded-for",
    }
)  # fmt: skip
# Not relayed from gunicorn's answers: the hop's own headers, and ``Server``, which only
# forwarded answers would carry (it would tell a front-answered hit from a miss).
_NOT_RELAYED = _HOP_BY_HOP | {b"server"}
_READ_CHUNK = 256 * 1024


_IDEMPOTENT = frozenset({b"GET", b"HEAD"})


def _forwardable(name: bytes) -> bool:
    """Client headers passed to gunicorn: not hop-by-hop, no proxy headers (the front is the
    only proxy; it sets X-Forwarded-For itself), and none spelled with ``_``: gunicorn trusts
    the unix socket as a proxy, and ``SCRIPT_NAME: /v1`` would otherwise re-route a request."""
    return (
        name not in _HOP_BY_HOP
        and b"_" not in name
        and name != b"forwarded"
        and not name.startswith(b"x-forwarded-")
    )


@dataclass(frozen=True)
class FrontConfig:
    upstream: str  # gunicorn's unix socket
    max_body_bytes: int
    header_timeout: float
    body_timeout: float
    upstream_timeout: float
    send_timeout: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    # Request bodies held at once, over all connections (0: 8 x max_body_bytes): each
    # connection is bounded by max_body_bytes, this bounds their sum. Past it: 503.
    max_buffered_bytes: int = 0
    reuse_port: bool = False  # several front processes share the port (SO_REUSEPORT)


# Reuse a connection to gunicorn only if idle for less than this (its keepalive is 5 s).
_UPSTREAM_IDLE_SECONDS = 2.0


@dataclass
class _Upstream:
    """A keep-alive connection to gunicorn's unix socket."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    conn: h11.Connection
    idle_since: float = 0.0

    def close(self) -> None:
        self.writer.close()


class _StaleConnection(Exception):
    """A reused connection turned out closed before gunicorn could have run the request: the
    write failed, or (for GET/HEAD, which may run twice) no answer byte came back. A POST
    whose connection closed after it was sent may have run (a worker killed mid-request):
    it is answered 502, never sent twice."""


class _Refused(Exception):
    """Answer ``status`` with a JSON error and close the connection."""

    def __init__(self, status: int, code: str, message: str, target: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.code, self.target = status, code, target


async def _within(deadline: float, awaitable: Awaitable[T]) -> T:
    """``awaitable`` before ``deadline`` (time.monotonic()); a timeout scope, no extra task."""
    async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
        return await awaitable


class Front:
    def __init__(self, config: FrontConfig, hits: FrontHits | None = None) -> None:
        """``hits``: answers plain L2 hits here, without gunicorn (app/front_hits.py)."""
        self._config = config
        self._hits = hits
        self._between_requests: set[asyncio.StreamWriter] = set()  # idle keep-alive
        self._connections = 0
        self._closing = False
        self._idle: list[_Upstream] = []
        self._buffered = 0
        self._buffer_cap = config.max_buffered_bytes or 8 * config.max_body_bytes

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= self._config.max_connections:
            writer.close()
            return
        self._connections += 1
        peer = writer.get_extra_info("peername")
        client_ip = peer[0] if isinstance(peer, tuple) and peer else ""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self._config.max_header_bytes)
        held = [0]  # body bytes this connection counts in self._buffered
        try:
            while not self._closing:
                try:
                    request = await self._read_request(conn, reader, writer, held)
                except _Refused as exc:
                    await self._refuse(writer, exc)
                    return
                if request is None:
                    return
                head, body = request
                try:
                    answer = None
                    if self._hits is not None:
                        answer = await self._hits.answer(
                            head.method, head.target, head.headers, body, client_ip
                        )
                    if answer is None:
                        answer = await self._forward(head, body, client_ip)
                    status, headers, payload = answer
                finally:
                    self._release(held)
                reason = _REASONS.get(status, "").encode()
                answer = conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
                answer = answer or b""
                answer += conn.send(h11.Data(data=payload)) or b""
                writer.write(answer + (conn.send(h11.EndOfMessage()) or b""))
                await _within(time.monotonic() + self._config.send_timeout, writer.drain())
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (TimeoutError, ConnectionError, h11.LocalProtocolError, h11.RemoteProtocolError):
            return
        finally:
            self._release(held)
            self._connections -= 1
            writer.close()

    def _release(self, held: list[int]) -> None:
        self._buffered -= held[0]
        held[0] = 0

    async def _read_request(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        held: list[int],
    ) -> tuple[h11.Request, bytes] | None:
        """One complete request (head within the header deadline, body within the body
        deadline), or None when the client closed or idled out between requests."""
        config = self._config
        deadline = time.monotonic() + config.header_timeout
        head: h11.Request | None = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Refused(exc.error_status_hint, "bad_request", str(exc)) from None
            if event is h11.NEED_DATA:
                idle = head is None and not conn.trailing_data[0]  # between requests
                if idle:
                    self._between_requests.add(writer)
                try:
                    data = await _within(deadline, reader.read(_READ_CHUNK))
                except TimeoutError:
                    if head is None and not conn.trailing_data[0]:
                        return None  # idle keep-alive connection: close quietly
                    phase = "headers" if head is None else "body"
                    raise _Refused(
                        408, "request_timeout", f"request {phase} not received in time"
                    ) from None
                finally:
                    self._between_requests.discard(writer)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Request):
                head = event
                declared = _content_length(event)
                if declared is not None and declared > config.max_body_bytes:
                    raise _TooLarge(event.target, config.max_body_bytes)
                if conn.client_is_waiting_for_100_continue:
                    writer.write(conn.send(h11.InformationalResponse(status_code=100)) or b"")
                deadline = time.monotonic() + config.body_timeout
            elif isinstance(event, h11.Data):
                assert head is not None
                body += event.data
                if len(body) > config.max_body_bytes:
                    raise _TooLarge(head.target, config.max_body_bytes)
                held[0] += len(event.data)
                self._buffered += len(event.data)
                if self._buffered > self._buffer_cap:
                    raise _Refused(
                        503, "unavailable", "too many request bodies in flight", head.target
                    )
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, bytes(body)

    async def _forward(
        self, head: h11.Request, body: bytes, client_ip: str
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Send the complete request to gunicorn; its complete answer. Connections to gunicorn
        are kept alive and reused (briefly: well under its keep-alive timeout); a reused one
        that turns out closed before any answer byte is retried once on a fresh one."""
        headers = [(k, v) for k, v in head.headers if _forwardable(k)]
        headers += [
            (b"content-length", str(len(body)).encode()),
            (b"x-forwarded-for", client_ip.encode()),
        ]
        request = h11.Request(method=head.method, target=head.target, headers=headers)
        deadline = time.monotonic() + self._config.upstream_timeout
        for _ in range(2):
            try:
                upstream, reused = await self._checkout(deadline)
            except (OSError, TimeoutError):
                message = "the service is starting or stopping"
                return _json_error(head.target, 503, "unavailable", message)
            try:
                answer = await self._exchange(upstream, request, body, deadline, reused)
            except _StaleConnection:
                upstream.close()
                continue
            except (OSError, TimeoutError, h11.ProtocolError):
                upstream.close()
                path = head.target.split(b"?", 1)[0][:200]  # never the query: it may carry data
                log.warning("upstream failed for %s %r", head.method.decode(), path)
                return _json_error(head.target, 502, "bad_gateway", "the worker did not answer")
            self._checkin(upstream)
            return answer
        return _json_error(head.target, 502, "bad_gateway", "the worker did not answer")

    async def _checkout(self, deadline: float) -> tuple[_Upstream, bool]:
        now = time.monotonic()
        while self._idle:
            upstream = self._idle.pop()
            if now - upstream.idle_since < _UPSTREAM_IDLE_SECONDS:
                return upstream, True
            upstream.close()
        connecting = asyncio.open_unix_connection(self._config.upstream)
        reader, writer = await _within(deadline, connecting)
        return _Upstream(reader, writer, h11.Connection(h11.CLIENT)), False

    def _checkin(self, upstream: _Upstream) -> None:
        conn = upstream.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE and len(self._idle) < 64:
            conn.start_next_cycle()
            upstream.idle_since = time.monotonic()
            self._idle.append(upstream)
        else:
            upstream.close()

    @staticmethod
    async def _exchange(
        upstream: _Upstream, request: h11.Request, body: bytes, deadline: float, reused: bool
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        conn = upstream.conn
        data = conn.send(request) or b""
        data += conn.send(h11.Data(data=body)) or b""
        upstream.writer.write(data + (conn.send(h11.EndOfMessage()) or b""))
        try:
            await _within(deadline, upstream.writer.drain())
        except ConnectionError:
            if reused:
                raise _StaleConnection() from None
            raise
        status, headers, payload = 502, [], bytearray()
        answered, declared = False, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    chunk = await _within(deadline, upstream.reader.read(_READ_CHUNK))
                except ConnectionError:
                    chunk = b""
                if not chunk and reused and not answered and request.method in _IDEMPOTENT:
                    raise _StaleConnection()
                conn.receive_data(chunk)
            elif isinstance(event, h11.Response):
                answered = True
                status = event.status_code
                declared = [v for k, v in event.headers if k == b"content-length"]
                headers = [(k, v) for k, v in event.headers if k not in _NOT_RELAYED]
            elif isinstance(event, h11.Data):
                payload += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if request.method == b"HEAD":
            headers += [(b"content-length", v) for v in declared[:1]]  # what a GET would send
        elif status >= 200 and status not in (204, 304):
            headers.append((b"content-length", str(len(payload)).encode()))
        return status, headers, bytes(payload)

    async def _refuse(self, writer: asyncio.StreamWriter, exc: _Refused) -> None:
        status, headers, body = _json_error(exc.target, exc.status, exc.code, str(exc))
        head = f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n".encode()
        head += b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        writer.write(head + b"connection: close\r\n\r\n" + body)
        try:
            await asyncio.wait_for(writer.drain(), 5)
        except (TimeoutError, ConnectionError):
            pass

    def close(self) -> None:
        """Stop after the request in progress on each connection; idle keep-alive connections
        are closed now (a client sees the close before sending, and retries elsewhere)."""
        self._closing = True
        for writer in list(self._between_requests):
            writer.close()


class _TooLarge(_Refused):
    def __init__(self, target: bytes, limit: int) -> None:
        super().__init__(413, "too_large", f"request body over {limit} bytes", target)


_REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
    405: "Method Not Allowed", 422: "Unprocessable Content", 500: "Internal Server Error",
    504: "Gateway Timeout", 408: "Request Timeout", 413: "Content Too Large",
    431: "Request Header Fields Too Large", 502: "Bad Gateway", 503: "Service Unavailable",
}  # fmt: skip


def _content_length(request: h11.Request) -> int | None:
    for name, value in request.headers:
        if name == b"content-length":
            return int(value)  # h11 has validated it
    return None


def _json_error(
    target: bytes, status: int, code: str, message: str
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """An error in the form the path's protocol uses (PaddleX envelope on ``/ocr``)."""
    path = target.split(b"?", 1)[0]
    if path == b"/ocr":
        import uuid

        body = orjson.dumps({"logId": str(uuid.uuid4()), "errorCode": status, "errorMsg": message})
    else:
        body = orjson.dumps(error_envelope(code, message))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    return status, headers, body


async def serve(
    host: str, port: int, config: FrontConfig, parent: int | None, hits: FrontHits | None = None
) -> None:
    front = Front(config, hits)
    server = await asyncio.start_server(
        front.handle, host, port, backlog=1024, reuse_address=True,
        reuse_port=config.reuse_port or None,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("HTTP front on %s:%d -> unix:%s", host, port, config.upstream)
    async with server:
        while not stop.is_set():
            if parent is not None and os.getppid() != parent:
                log.warning("the serving process is gone; stopping the HTTP front")
                break
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        server.close()  # no new connections; requests in progress finish
        front.close()
        grace = time.monotonic() + config.upstream_timeout
        while front._connections and time.monotonic() < grace:
            await asyncio.sleep(0.05)
        if hits is not None:
            await hits.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.front")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--max-body-bytes", type=int, required=True)
    parser.add_argument("--header-timeout", type=float, required=True)
    parser.add_argument("--body-timeout", type=float, required=True)
    parser.add_argument("--upstream-timeout", type=float, required=True)
    parser.add_argument("--max-buffered-bytes", type=int, default=0)
    parser.add_argument("--reuse-port", action="store_true", help="one of several fronts")
    parser.add_argument("--parent", type=int, default=None)
    parser.add_argument("--hit-spec", default="", help="answer REST L2 hits (app/front_hits.py)")
    args = parser.parse_args(argv)
    memory.keep_large_buffers()
    logsafe.install()
    logging.basicConfig(
        level=os.environ.get("LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = FrontConfig(
        upstream=args.upstream,
        max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        upstream_timeout=args.upstream_timeout,
        max_buffered_bytes=args.max_buffered_bytes,
        reuse_port=args.reuse_port,
    )
    try:  # libuv's loop: a shorter hop on every request; plain asyncio works the same
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    hits = None
    if args.hit_spec:
        from app.config import Settings
        from app.front_hits import FrontHits

        hits = FrontHits(Settings.from_env(), args.hit_spec)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.host, args.port, config, args.parent, hits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
