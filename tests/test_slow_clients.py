"""Slow clients cannot starve the service: against a real `python -m app serve` (the command
docker/entrypoint.sh execs) with one worker x 2 threads, 64 clients trickling their headers and
64 trickling their bodies must not delay normal requests by more than 1 s; they are cut off at
their deadlines. Without app/front.py, 2 such clients stopped all HTTP service."""

from __future__ import annotations

import selectors
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import requests

from app.embedded_redis import EmbeddedRedis, free_port
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import WORD_EN
from tests.helpers import b64
from tests.test_serve import serving

SLOW = 64  # per kind: headers trickled, body trickled
DEADLINE = 8.0  # HTTP_HEADER_TIMEOUT_SECONDS and HTTP_BODY_TIMEOUT_SECONDS of the service
TOKEN = "t" * 20  # CACHE_CONTROL_TOKEN; TRUSTED_NETWORKS is 10.0.0.0/8, the tests are 127.0.0.1


@pytest.fixture(scope="module")
def service(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    tmp = tmp_path_factory.mktemp("slow")
    port, grpc_port = free_port(), free_port()
    overrides = dict(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_PORT=str(grpc_port),
        WEB_CONCURRENCY="1", WEB_THREADS="2", REDIS_URL=redis_server.url,
        CACHE_KEY_PREFIX="slow-clients", OCR_WORK_DIR=str(tmp / "models"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"), MAX_REQUEST_BYTES="1048576",
        HTTP_HEADER_TIMEOUT_SECONDS=str(DEADLINE), HTTP_BODY_TIMEOUT_SECONDS=str(DEADLINE),
        TRUSTED_NETWORKS="10.0.0.0/8", CACHE_CONTROL_TOKEN=TOKEN,
    )  # fmt: skip
    with serving(overrides) as (_, base):
        yield base, port, grpc_port


class Trickler:
    """Connections that send their request one byte per ``interval`` (never finishing)."""

    def __init__(self, port: int, interval: float = 0.5) -> None:
        body = b'{"image": "' + b"A" * 4000
        self.socks: list[tuple[socket.socket, bytes]] = []
        for i in range(SLOW):
            head = f"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nX-Slow-{i}: ".encode() + b"a" * 5000
            self.socks.append((socket.create_connection(("127.0.0.1", port)), head))
        for _ in range(SLOW):
            sock = socket.create_connection(("127.0.0.1", port))
            head = b"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: 200000\r\n\r\n")
            self.socks.append((sock, body))
        self.closed_by_server: set[int] = set()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while not self._stop.wait(self._interval):
            for i, (sock, data) in enumerate(self.socks):
                if i in self.closed_by_server:
                    continue
                try:
                    sock.send(data[offset % len(data) : offset % len(data) + 1])
                except OSError:
                    self.closed_by_server.add(i)
            offset += 1

    def wait_all_cut(self, timeout: float) -> int:
        """How many connections the server ended (EOF or an error answer) within timeout."""
        sel = selectors.DefaultSelector()
        for i, (sock, _) in enumerate(self.socks):
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, i)
        ended: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(ended) < len(self.socks) and time.monotonic() < deadline:
            for key, _ in sel.select(0.2):
                i = key.data
                try:
                    chunk = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk or chunk.startswith(b"HTTP/1.1 408"):
                    ended.add(i)
                    sel.unregister(key.fileobj)
        return len(ended)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock, _ in self.socks:
            sock.close()


def _timed_hits(base: str, body: dict, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        resp = requests.post(f"{base}/v1/ocr", json=body, timeout=30)  # a new connection each
        times.append(time.perf_counter() - started)
        assert resp.status_code == 200 and resp.headers["X-Cache"] == "HIT"
    return times


def test_slow_clients_do_not_delay_normal_requests(service):
    base, port, grpc_port = service
    body = {"image": b64(WORD_EN.read_bytes())}
    assert requests.post(f"{base}/v1/ocr", json=body, timeout=60).status_code == 200
    baseline = _timed_hits(base, body, 10)
    slow = Trickler(port)
    try:
        time.sleep(1.0)  # every slow connection is open and trickling
        under_attack = _timed_hits(base, body, 20)
        stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        reply = stub.inference(pb2.Request(key=["image"], value=[body["image"]]), timeout=10)
        assert reply.err_no == 0  # gRPC is served throughout
        assert not slow.closed_by_server, "cut before their deadline"
        delay = max(under_attack) - statistics.median(baseline)
        assert delay < 1.0, (baseline, under_attack)
        # Past their deadline every slow connection is ended: they hold nothing for long.
        assert slow.wait_all_cut(DEADLINE + 10) == 2 * SLOW
    finally:
        slow.close()
    assert max(_timed_hits(base, body, 5)) < 1.0 + statistics.median(baseline)


def test_front_refuses_oversized_and_malformed_requests(service):
    base, port, _ = service
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = b"POST /ocr HTTP/1.1\r\nHost: x\r\nContent-Length: 1048577\r\n\r\n"
        sock.sendall(head)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b'"errorCode":413' in answer  # PaddleX's envelope on /ocr
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    # Chunked bodies are read whole by the front and passed on with a Content-Length.
    data = ('{"image": "' + b64(WORD_EN.read_bytes()) + '"}').encode()
    resp = requests.post(
        f"{base}/v1/ocr", data=iter([data[:1000], data[1000:]]),
        headers={"Content-Type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert resp.status_code == 200 and resp.json()["lines"]


def test_the_front_passes_the_real_client_address(service):
    """A client cannot claim a trusted address: the front replaces X-Forwarded-For."""
    base, _, _ = service
    body = {"image": b64(WORD_EN.read_bytes())}
    requests.post(f"{base}/v1/ocr", json=body, timeout=60)
    spoofed = {"X-Forwarded-For": "10.0.0.1", "Cache-Control": "no-cache"}
    resp = requests.post(f"{base}/v1/ocr", json=body, headers=spoofed, timeout=60)
    assert resp.headers["X-Cache"] == "HIT"  # no-cache ignored: 127.0.0.1 is not trusted
    spoofed = {"X_Forwarded_For": "10.0.0.1", "Cache-Control": "no-cache"}
    resp = requests.post(f"{base}/v1/ocr", json=body, headers=spoofed, timeout=60)
    assert resp.headers["X-Cache"] == "HIT"
    token = {"X-Cache-Control-Token": TOKEN, "Cache-Control": "no-cache"}
    resp = requests.post(f"{base}/v1/ocr", json=body, headers=token, timeout=60)
    assert resp.headers["X-Cache"] == "MISS"  # trusted by token: recomputed


def test_clients_cannot_set_wsgi_routing_or_framing_through_the_front(service):
    """gunicorn trusts its unix socket as a proxy: SCRIPT_NAME/PATH_INFO or a scheme header
    from a client would re-route the request (``SCRIPT_NAME: /v1`` turned /v1/ocr into
    PaddleX's /ocr; ``/nope`` was a plain-text 500). The front drops them."""
    base, _, _ = service
    body = {"image": b64(WORD_EN.read_bytes())}
    for name, value in (
        ("SCRIPT_NAME", "/v1"),
        ("SCRIPT_NAME", "/nope"),
        ("PATH_INFO", "/ocr"),
        ("Script-Name", "/v1"),
        ("X-Forwarded-Proto", "https"),
        ("Forwarded", "for=10.0.0.1;proto=https"),
    ):
        resp = requests.post(f"{base}/v1/ocr", json=body, headers={name: value}, timeout=60)
        assert resp.status_code == 200, (name, value, resp.status_code, resp.text[:200])
        assert "lines" in resp.json(), (name, value)  # the REST answer, not another route
    get = requests.get(f"{base}/healthz", timeout=10)
    head = requests.head(f"{base}/healthz", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["Content-Length"] == str(len(get.content))  # what a GET would send


def test_the_front_bounds_the_bodies_it_holds_at_once(tmp_path):
    """Each body is bounded by MAX_REQUEST_BYTES, and their sum over all connections by
    max_buffered_bytes: past it a request is refused (503) instead of growing memory."""
    import asyncio

    import h11

    from app.front import Front, FrontConfig

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP server standing in for gunicorn: answers every request 200."""
        conn = h11.Connection(h11.SERVER)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.EndOfMessage):
                out = conn.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
                writer.write(out + conn.send(h11.Data(data=b"ok")) + conn.send(h11.EndOfMessage()))
                await writer.drain()
                writer.close()
                return
            elif isinstance(event, h11.ConnectionClosed):
                return

    async def scenario() -> tuple[bytes, bytes, bytes]:
        sock = str(tmp_path / "up.sock")
        up = await asyncio.start_unix_server(upstream, sock)
        config = FrontConfig(
            upstream=sock, max_body_bytes=800, header_timeout=5, body_timeout=5,
            upstream_timeout=5, max_buffered_bytes=1000,
        )  # fmt: skip
        front = await asyncio.start_server(Front(config).handle, "127.0.0.1", 0)
        port = front.sockets[0].getsockname()[1]
        head = b"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Length: 800\r\n\r\n"
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(head + b"a" * 600)  # held, not finished
        await w1.drain()
        await asyncio.sleep(0.2)
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(head + b"b" * 600)  # 1,200 bytes held in all: over the cap
        await w2.drain()
        refused = await asyncio.wait_for(r2.read(4096), 5)
        w1.write(b"a" * 200)  # the first completes and is answered
        await w1.drain()
        answered = await asyncio.wait_for(r1.read(4096), 5)
        r3, w3 = await asyncio.open_connection("127.0.0.1", port)
        w3.write(head + b"c" * 800)  # the cap is free again
        await w3.drain()
        later = await asyncio.wait_for(r3.read(4096), 5)
        for w in (w1, w2, w3):
            w.close()
        front.close()
        up.close()
        return refused, answered, later

    refused, answered, later = asyncio.run(scenario())
    assert refused.startswith(b"HTTP/1.1 503"), refused
    assert answered.startswith(b"HTTP/1.1 200") and answered.endswith(b"ok"), answered
    assert later.startswith(b"HTTP/1.1 200"), later
