"""Slow clients cannot starve the service: against a real `python -m app serve` (the command
docker/entrypoint.sh execs) with nginx at the edge and one worker x 2 threads, 64 clients
trickling their headers and 64 trickling their bodies hold nginx connections only (nginx reads
every request whole before granian sees it), so normal requests are all answered meanwhile.
A head must arrive within HTTP_HEADER_TIMEOUT_SECONDS, and a body that stops arriving is cut
after HTTP_BODY_TIMEOUT_SECONDS. Without a buffering edge, 2 such clients stopped all HTTP
service (gunicorn's two threads blocked reading them)."""

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

from app.edge import find_nginx
from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import WORD_EN
from tests.fleet import wait_for
from tests.helpers import b64
from tests.test_serve import serving

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

SLOW = 64  # per kind: headers trickled, body trickled
HITS = 20  # normal requests made while they trickle
DEADLINE = 8.0  # HTTP_HEADER_TIMEOUT_SECONDS and HTTP_BODY_TIMEOUT_SECONDS of the service
# Generous bounds on a loaded machine (never reached when it works): the report, not the
# assertion, says how fast the hits were.
HIT_TIMEOUT = 30.0
CUT_WITHIN = DEADLINE + 30.0
TOKEN = "t" * 20  # CACHE_CONTROL_TOKEN; TRUSTED_NETWORKS is 10.0.0.0/8, the tests are 127.0.0.1


@pytest.fixture(scope="module")
def service(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if find_nginx() is None:
        pytest.skip("no nginx binary (Debian's nginx-light): the edge cannot be checked")
    tmp = tmp_path_factory.mktemp("slow")
    port, grpc_port = free_port(), free_port()
    overrides = dict(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_PORT=str(grpc_port),
        WEB_CONCURRENCY="1", ENGINE_PROCESSES="1", WEB_THREADS="2", REDIS_URL=redis_server.url,
        CACHE_KEY_PREFIX="slow-clients", OCR_WORK_DIR=str(tmp / "models"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"), MAX_REQUEST_BYTES="1048576",
        HTTP_HEADER_TIMEOUT_SECONDS=str(DEADLINE), HTTP_BODY_TIMEOUT_SECONDS=str(DEADLINE),
        TRUSTED_NETWORKS="10.0.0.0/8", CACHE_CONTROL_TOKEN=TOKEN,
        # serving() reads the output at the end: no access log line may fill the pipe first.
        EDGE_ACCESS_LOG="false",
    )  # fmt: skip
    with serving(overrides) as (_, base):
        yield base, port, grpc_port


class Trickler:
    """Connections that send their request one byte per ``interval`` (never finishing):
    ``SLOW`` trickling a head, ``SLOW`` a body after a complete head."""

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
        self.rounds = 0  # how many times every connection has sent its next byte
        self.bodies_paused = threading.Event()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while not self._stop.wait(self._interval):
            for i, (sock, data) in enumerate(self.socks):
                if i in self.closed_by_server or (i >= SLOW and self.bodies_paused.is_set()):
                    continue
                try:
                    sock.send(data[offset % len(data) : offset % len(data) + 1])
                except OSError:
                    self.closed_by_server.add(i)
            offset += 1
            self.rounds = offset

    def wait_cut(self, which: range, timeout: float) -> int:
        """How many of connections ``which`` the server ended (EOF, a reset or a 408 answer)
        within ``timeout``."""
        sel = selectors.DefaultSelector()
        for i in which:
            sock = self.socks[i][0]
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, i)
        ended: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(ended) < len(which) and time.monotonic() < deadline:
            for key, _ in sel.select(0.2):
                try:
                    chunk = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk or chunk.startswith(b"HTTP/1.1 408"):
                    ended.add(key.data)
                    sel.unregister(key.fileobj)
        sel.close()
        return len(ended)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock, _ in self.socks:
            sock.close()


def _hits(base: str, body: dict, n: int) -> list[float]:
    """``n`` requests, each on a new connection, all of which must be answered HITs (within
    a generous timeout each); returns how long each took, for the report."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        resp = requests.post(f"{base}/v1/ocr", json=body, timeout=HIT_TIMEOUT)
        times.append(time.perf_counter() - started)
        assert resp.status_code == 200 and resp.headers["X-Cache"] == "HIT", resp.text[:300]
        assert resp.headers["Server"] == "nginx"  # answered through the edge
    return times


def _report(name: str, times: list[float]) -> str:
    return (
        f"{name}: median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms"
    )


def test_slow_clients_do_not_stop_normal_requests(service, record_property):
    base, port, grpc_port = service
    body = {"image": b64(WORD_EN.read_bytes())}
    assert requests.post(f"{base}/v1/ocr", json=body, timeout=120).status_code == 200
    baseline = _hits(base, body, 10)
    slow = Trickler(port)
    try:
        # Every slow connection is open (at once) and trickling (a byte each, twice).
        wait_for(lambda: slow.rounds >= 2, 60, "the slow connections trickling")
        under_attack = _hits(base, body, HITS)  # all HITS answered, none waiting on them
        stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        reply = stub.inference(pb2.Request(key=["image"], value=[body["image"]]), timeout=30)
        assert reply.err_no == 0  # gRPC is served throughout
        # The report (a loaded machine may be slow; the design target is under 1 s each).
        for line in (_report("baseline", baseline), _report("under attack", under_attack)):
            print(line)
        record_property("hit_seconds_baseline_max", max(baseline))
        record_property("hit_seconds_under_attack_max", max(under_attack))
        # A head must be complete within its deadline: every trickled head is cut.
        assert slow.wait_cut(range(SLOW), CUT_WITHIN) == SLOW
        # A body is cut once it stops arriving for the body deadline.
        slow.bodies_paused.set()
        assert slow.wait_cut(range(SLOW, 2 * SLOW), CUT_WITHIN) == SLOW
    finally:
        slow.close()
    _hits(base, body, 5)  # and the service goes on as before


def test_the_edge_refuses_oversized_and_malformed_requests(service):
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
    # Chunked bodies are read whole by nginx and passed on with a Content-Length.
    data = ('{"image": "' + b64(WORD_EN.read_bytes()) + '"}').encode()
    resp = requests.post(
        f"{base}/v1/ocr", data=iter([data[:1000], data[1000:]]),
        headers={"Content-Type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert resp.status_code == 200 and resp.json()["lines"]


def test_the_edge_passes_the_real_client_address(service):
    """A client cannot claim a trusted address: nginx replaces X-Forwarded-For."""
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


def test_clients_cannot_set_wsgi_routing_or_framing_through_the_edge(service):
    """SCRIPT_NAME/PATH_INFO or a scheme header from a client must not re-route the request
    (under gunicorn, which trusted its unix socket as a proxy, ``SCRIPT_NAME: /v1`` turned
    /v1/ocr into PaddleX's /ocr; ``/nope`` was a plain-text 500). nginx drops header names
    with underscores, and granian takes no forwarder or scheme headers (test_front_server)."""
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


def test_many_bodies_held_at_once_do_not_stop_normal_requests(service):
    """nginx holds bodies that are still arriving (each up to MAX_REQUEST_BYTES; past its
    buffer in a temporary file, not in memory): 32 clients each half-way through a 900 KB
    body hold no worker, and each is answered once it completes."""
    base, port, _ = service
    body = {"image": b64(WORD_EN.read_bytes())}
    payload = b'{"image": "' + b"A" * (900_000 - 13) + b'"}'
    head = (
        b"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n"
    )
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(32)]
    try:
        for sock in socks:
            sock.sendall(head + payload[: len(payload) // 2])
        _hits(base, body, 5)  # answered while every one of them is held
        for sock in socks:
            sock.sendall(payload[len(payload) // 2 :])
        for sock in socks:  # not an image: the app's 400, in REST form
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
            assert b'"error"' in answer
    finally:
        for sock in socks:
            sock.close()
